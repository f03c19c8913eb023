"""Every transport under the shipped PostgreSQL roles (issue 43): store,
restart, store again, with each process logged in as its own role of
``ops/roles.sql``.

For each transport (Redis stream, Redis list, NATS JetStream, SQS, AMQP)
``switchboard ingest`` runs as the ingester's login and, where the acker
acks, ``switchboard ack`` as the acker's. AMQP runs no acker: its ingester
acks on the channel that received the messages and marks those acks itself
(policy ``switchboard_ingester_own_acks``), so an acker beside it would
hide a refused mark. Each phase produces N messages and waits until all
of them are stored and acked, in PostgreSQL (``ack_state`` 'acked') and at
the broker (nothing pending, in flight or unacked). Between phases the
ingester is stopped and started again under the same consumer name:
SIGTERM (a clean exit), kill -9 while idle, kill -9 right after a commit
(failpoint ``after_commit``: its acks not sent, the batch redelivered and
stored again) and, for AMQP, kill -9 right after its own ack (failpoint
``after_own_ack``: the mark not written, settled by the next channel's
``settle_own_acks``). Every phase ends with exactly one inbox row, event
and todo per message so far, every ack discharged; and no process logged
a refusal or a duplicate key.

The brokers are the suite's own, with their admin users: the least-privilege
broker users of ``ops/`` are other tests' (test_least_privilege for Redis's
ACL file, the adapters' permission tests for NATS and RabbitMQ)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from ingest.adapters.redis.lists import processing_key
from ingest.embedded.processes import SwitchboardProcess, wait_for, wait_ready
from ingest.embedded.sqs_server import client_env
from tests.support import amqp, db, nats, sqs
from tests.support.config import write_config
from tests.support.oracle import assert_stored_once
from tests.support.processes import Processes, assert_clean_exit
from tests.support.roles import LOGIN_PASSWORD, RoleDatabase, migrate_and_grant, role_database
from tests.support.servers import ServerUrls
from tests.support.streams import produce, xpending

pytestmark = pytest.mark.system

N = 30  # messages per phase
BATCH = 10  # so a kill after the first commit leaves messages read and not stored
SOURCE = "orders"  # stream, list, queue; NATS's stream is NATS_STREAM
QUEUE = "orders"  # the todo queue
NATS_STREAM, NATS_SUBJECT, GROUP = "ORDERS", "ORDERS.new", "switchboard"
CONSUMER = "ingester-1"  # every incarnation of the ingester: it finds what the last one left
SETTLE_TIMEOUT_S = 60.0
# What no process under the shipped roles may log: a refused statement
# (SQLSTATE 42501, as psycopg names it and as PostgreSQL words it), an
# AMQP ack mark refused or failed, or a second row for one key.
REFUSALS = re.compile(
    r"InsufficientPrivilege|permission denied|row-level security|own_acks_unmarked|AckStateError"
    r"|UniqueViolation|duplicate key",
    re.IGNORECASE,
)


class Broker:
    """One transport's side of the test: its adapter table, its producer,
    and the broker's own record of what is still owed. ``acked_by_ingester``:
    its ingester acks (no acker runs); ``kill_points``: the failpoints an
    ingester is killed -9 at, one phase each."""

    name = ""
    acked_by_ingester = False
    kill_points: tuple[str, ...] = ("after_commit",)

    def adapter(self) -> dict[str, Any]:
        raise NotImplementedError

    def env(self) -> dict[str, str]:
        """What every process of this transport needs in its environment."""
        return {}

    def produce(self, start: int, n: int) -> list[str]:
        """Messages ``start`` .. ``start + n - 1``, each distinct; their keys."""
        raise NotImplementedError

    def owed(self) -> object:
        """The broker's figures of what is undelivered or unacked: falsy
        (0, or all zeros) when nothing is."""
        raise NotImplementedError

    def settled(self) -> bool:
        owed = self.owed()
        return not any(owed) if isinstance(owed, tuple) else not owed

    def _body(self, i: int) -> bytes:
        return json.dumps({"transport": self.name, "order": i}).encode()


class RedisStream(Broker):
    name = "redis-stream"

    def __init__(self, url: str) -> None:
        self.url = url

    def adapter(self) -> dict[str, Any]:
        return {"name": "orders", "transport": "redis", "mode": "stream", "source": SOURCE, "group": GROUP,
                "queue": QUEUE, "batch_size": BATCH, "block_ms": 200, "url": self.url}  # fmt: skip

    def produce(self, start: int, n: int) -> list[str]:
        return [f"redis:{SOURCE}:{entry}" for entry in produce(self.url, SOURCE, n, start)]

    def owed(self) -> object:
        with redis.Redis.from_url(self.url, socket_timeout=10) as r:
            if not r.exists(SOURCE):
                return 0
        return xpending(self.url, SOURCE, GROUP)


class RedisList(Broker):
    name = "redis-list"

    def __init__(self, url: str) -> None:
        self.url = url

    def adapter(self) -> dict[str, Any]:
        return {"name": "orders", "transport": "redis", "mode": "list", "source": SOURCE, "queue": QUEUE,
                "batch_size": BATCH, "block_ms": 200, "url": self.url}  # fmt: skip

    def produce(self, start: int, n: int) -> list[str]:
        bodies = [self._body(i) for i in range(start, start + n)]
        with redis.Redis.from_url(self.url, socket_timeout=10) as r:
            r.lpush(SOURCE, *bodies)
        return [f"redis:{SOURCE}:{hashlib.sha256(b).hexdigest()}" for b in bodies]

    def owed(self) -> object:
        """(on the source list, on the ingester's processing list)."""
        with redis.Redis.from_url(self.url, socket_timeout=10) as r:
            return int(r.llen(SOURCE)), int(r.llen(processing_key(SOURCE, CONSUMER)))


class NatsJetStream(Broker):
    name = "nats-jetstream"

    def __init__(self, url: str) -> None:
        self.url = url
        nats.create_stream(url, NATS_STREAM)

    def adapter(self) -> dict[str, Any]:
        # ack_wait: what a killed ingester fetched and never stored comes back this soon.
        return {"name": "orders", "transport": "nats", "mode": "jetstream", "source": NATS_STREAM,
                "group": GROUP, "queue": QUEUE, "url": self.url, "batch_size": BATCH, "block_ms": 200,
                "ack_wait_ms": 3000}  # fmt: skip

    def produce(self, start: int, n: int) -> list[str]:
        sequences = nats.publish(self.url, NATS_SUBJECT, [self._body(i) for i in range(start, start + n)])
        return [f"nats:{NATS_STREAM}:{seq}" for seq in sequences]

    def owed(self) -> object:
        """The consumer's (unacked, undelivered); (-1, -1) before it exists."""
        figures = nats.consumer_figures(self.url, NATS_STREAM, GROUP)
        return (-1, -1) if figures is None else figures


class Sqs(Broker):
    name = "sqs"

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.client = sqs.client(endpoint)
        self.queue_url = sqs.create_queue(self.client, SOURCE)

    def adapter(self) -> dict[str, Any]:
        # ack_wait: the visibility timeout; what a killed ingester received comes back this soon.
        return {"name": "orders", "transport": "sqs", "source": SOURCE, "queue": QUEUE, "url": self.endpoint,
                "region": sqs.REGION, "batch_size": BATCH, "block_ms": 1000, "ack_wait_ms": 3000}  # fmt: skip

    def env(self) -> dict[str, str]:
        return client_env()  # the emulator's dummy credentials, never the caller's AWS ones

    def produce(self, start: int, n: int) -> list[str]:
        ids = sqs.send(self.client, self.queue_url, [self._body(i) for i in range(start, start + n)])
        return [f"sqs:{SOURCE}:{i}" for i in ids]

    def owed(self) -> object:
        """(visible, in flight, delayed)."""
        return sqs.counts(self.client, self.queue_url)


class Amqp(Broker):
    name = "amqp"
    acked_by_ingester = True
    kill_points = ("after_commit", "after_own_ack")

    def __init__(self, url: str) -> None:
        self.url = url
        amqp.declare_queue(url, SOURCE)

    def adapter(self) -> dict[str, Any]:
        return {"name": "orders", "transport": "amqp", "source": SOURCE, "queue": QUEUE, "url": self.url,
                "batch_size": BATCH, "block_ms": 200}  # fmt: skip

    def produce(self, start: int, n: int) -> list[str]:
        ids = [f"m-{i}" for i in range(start, start + n)]
        amqp.publish(self.url, SOURCE, [self._body(i) for i in range(start, start + n)], message_ids=ids)
        return [f"amqp:{SOURCE}:{i}" for i in ids]

    def owed(self) -> object:
        """(ready, unacked): the broker's own figures."""
        ready, unacked, _consumers = amqp.queue_counts(self.url, SOURCE)
        return ready, unacked


@contextlib.contextmanager
def broker_for(name: str, redis_url: str) -> Iterator[Broker]:
    """The transport's broker: the session's Redis, or a server of the test's own."""
    if name == "redis-stream":
        yield RedisStream(redis_url)
    elif name == "redis-list":
        yield RedisList(redis_url)
    elif name == "nats-jetstream":
        with nats.owned_nats() as server:
            yield NatsJetStream(server.url)
    elif name == "sqs":
        with sqs.owned_sqs() as emulator:
            yield Sqs(emulator.url)
    elif name == "amqp":
        with amqp.owned_rabbitmq() as rabbit:  # skips, counted in the summary, without RabbitMQ
            yield Amqp(rabbit.url)
    else:
        raise ValueError(f"no broker {name!r}")


TRANSPORTS = ("redis-stream", "redis-list", "nats-jetstream", "sqs", "amqp")


@pytest.fixture(params=TRANSPORTS)
def broker(request: pytest.FixtureRequest, redis_url: str) -> Iterator[Broker]:
    with broker_for(request.param, redis_url) as b:
        yield b


@pytest.fixture
def roles_db(servers: ServerUrls) -> Iterator[RoleDatabase]:
    """An empty database, ops/roles.sql run, migrated as the migrator, the file run again."""
    with role_database(servers.database) as rdb:
        migrate_and_grant(rdb)
        yield rdb


def _config(path: Path, rdb: RoleDatabase, role: str, broker: Broker, redis_url: str) -> Path:
    return write_config(path, database_url=rdb.url(role), redis_url=redis_url, adapters=[broker.adapter()])


def _figures(admin: str) -> tuple[int, int, int]:
    """(inbox rows, of them acked, todos)."""
    row = db.query(
        admin,
        "SELECT (SELECT count(*) FROM inbox), (SELECT count(*) FROM inbox WHERE ack_state = 'acked'),"
        " (SELECT count(*) FROM todos)",
    )[0]
    return int(row[0]), int(row[1]), int(row[2])


def _sessions(admin: str) -> set[str]:
    """The users connected to the database, its superuser (this test) aside."""
    rows = db.query(
        admin,
        "SELECT DISTINCT usename FROM pg_stat_activity"
        " WHERE datname = current_database() AND usename <> current_user",
    )
    return {str(u) for (u,) in rows}


def _refusals(procs: Processes) -> list[str]:
    """Every log line (of every process, every incarnation) naming a refusal."""
    return [line for line in procs.logs_text().splitlines() if REFUSALS.search(line)]


def test_store_restart_store_under_the_shipped_roles(
    tmp_path: Path, roles_db: RoleDatabase, broker: Broker, redis_url: str, procs: Processes
) -> None:
    admin = roles_db.admin_url
    ingester_config = _config(tmp_path / "ingester.toml", roles_db, "ingester", broker, redis_url)
    acker_config = _config(tmp_path / "acker.toml", roles_db, "acker", broker, redis_url)
    env = broker.env()
    keys: list[str] = []

    def start_ingester(failpoints: str | None = None) -> SwitchboardProcess:
        return procs.start("ingest", ingester_config, name=CONSUMER, env=env, failpoints=failpoints)

    def settle(phase: str) -> None:
        """Until every message so far is stored and acked, and the broker owes nothing."""
        total = len(keys)
        try:
            wait_for(
                lambda: _figures(admin) == (total, total, total) and broker.settled(),
                timeout_s=SETTLE_TIMEOUT_S,
                interval_s=0.2,
                what=f"{broker.name}, {phase}: {total} messages stored and acked, the broker settled",
            )
        except AssertionError as exc:
            found = f"(inbox, acked, todos) = {_figures(admin)}, broker owes {broker.owed()}"
            raise AssertionError(f"{exc}; {found}; refusals logged: {_refusals(procs)[:5]}") from exc
        assert_stored_once(admin, keys, queue=QUEUE)

    if not broker.acked_by_ingester:
        acker = procs.start("ack", acker_config, name="acker-1", env=env)
        wait_ready(acker)

    # First start.
    ingester = start_ingester()
    wait_ready(ingester)
    keys += broker.produce(0, N)
    settle("first start")

    # SIGTERM: a clean exit, then the same consumer again.
    assert_clean_exit(ingester, ingester.terminate())
    ingester = start_ingester()
    wait_ready(ingester)
    keys += broker.produce(len(keys), N)
    settle("restarted after SIGTERM")
    assert _figures(admin) == (2 * N, 2 * N, 2 * N)

    # kill -9 of an idle ingester.
    ingester.kill()
    assert ingester.proc.returncode == -signal.SIGKILL
    ingester = start_ingester()
    wait_ready(ingester)
    keys += broker.produce(len(keys), N)
    settle("restarted after kill -9")

    # kill -9 mid-run: at a failpoint of the first batch, its messages already waiting.
    for point in broker.kill_points:
        assert_clean_exit(ingester, ingester.terminate())
        before = len(keys)
        keys += broker.produce(before, N)
        doomed = start_ingester(failpoints=f"{point}=kill@1")
        # A bounded wait: subprocess.TimeoutExpired if the failpoint never fires.
        assert doomed.wait(SETTLE_TIMEOUT_S) == -signal.SIGKILL, doomed.raw_log()[-3000:]
        stored, acked, _todos = _figures(admin)
        assert before < stored, f"{point}: killed before its first commit"
        if broker.acked_by_ingester:
            # Its last batch's rows left pending (no acker marks them): the
            # next ingester's to settle, under the same policies.
            assert acked < stored, f"{point}: no row left pending by the killed ingester"
        ingester = start_ingester()
        wait_ready(ingester)
        settle(f"restarted after kill -9 at {point}")

    # Each process is connected as its role's login user, and as no other.
    logins = {roles_db.login("ingester")} | (set() if broker.acked_by_ingester else {roles_db.login("acker")})
    wait_for(lambda: _sessions(admin) == logins, timeout_s=10, what=f"sessions of exactly {sorted(logins)}")
    for proc in procs.all:
        if proc.alive():
            assert_clean_exit(proc, proc.terminate())
    assert _refusals(procs) == []
    heartbeats = {r for (r,) in db.query(admin, "SELECT DISTINCT role FROM processes")}
    assert heartbeats == ({"ingest"} if broker.acked_by_ingester else {"ingest", "ack"})
    procs.assert_no_secret_logged()
    assert LOGIN_PASSWORD not in procs.logs_text()
