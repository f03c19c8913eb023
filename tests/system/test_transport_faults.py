"""Every transport under the same real faults, one test each, parametrized
over the transports that can suffer the fault:

* kill -9 chaos: two ingesters and an acker killed at random moments and
  started again, new messages published halfway (Redis streams, NATS
  JetStream, SQS, AMQP);
* the broker killed with kill -9 mid-run and started again on the same
  port and store (Redis, NATS, AMQP; moto, the suite's SQS, keeps its
  queues in memory, and AWS's queues have no such fault).

Each ends with one todo, one inbox row and one event per message, every
ack intent discharged, and the broker's own record empty: nothing
unacknowledged, nothing undelivered. Each broker is one this test owns.
The chaos seed is printed (SWITCHBOARD_TEST_SEED replays it). What only one
transport has (AMQP's failpoints, SQS's FIFO groups, a cluster's failover)
stays in its own module."""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import pytest

from ingest.embedded.processes import wait_for
from tests.support.amqp import declare_queue, owned_rabbitmq, queue_counts
from tests.support.amqp import publish as amqp_publish
from tests.support.amqp_plain import publish_without_ids
from tests.support.chaos import kill9_rounds, seeded
from tests.support.config import stream_adapter
from tests.support.db import acked
from tests.support.nats import consumer_figures, create_stream, owned_nats
from tests.support.nats import publish as nats_publish
from tests.support.oracle import assert_stored_once
from tests.support.processes import Processes, stop_settled
from tests.support.sqs import client, counts, create_queue, owned_sqs, send, use_emulator_credentials
from tests.support.streams import produce, xpending

pytestmark = pytest.mark.system
QUEUE = "orders"  # every transport's adapter fills this todo queue


def bodies(n: int, start: int = 0, **extra: Any) -> list[bytes]:
    return [json.dumps({"order": i, **extra}).encode() for i in range(start, start + n)]


class Broker(Protocol):
    """One transport's broker, owned by the test, and what was published to it."""

    keys: set[str]  # the idempotency keys of every message published
    per_phase: int  # messages published before the chaos, and again halfway
    rounds: int  # chaos rounds: each strikes a process at work (tests/support/chaos.py)
    around_restart: int  # published before the broker's kill, and again after its restart

    def adapter(self, **overrides: Any) -> dict[str, Any]:
        """The ``[[adapters]]`` table (name and queue ``orders``)."""

    def publish(self, n: int, start: int) -> None: ...

    def settled(self, db_url: str) -> bool:
        """Every message acked in the inbox and nothing left at the broker."""

    def kill(self) -> None: ...

    def start(self) -> None: ...


@dataclass
class RedisStream:
    server: Any  # RedisServer
    keys: set[str] = field(default_factory=set)
    per_phase: int = 2000
    rounds: int = 6
    around_restart: int = 500
    stream: str = "orders"

    def adapter(self, **overrides: Any) -> dict[str, Any]:
        # A short claim_idle_ms, so a survivor claims a dead consumer's entries.
        table = stream_adapter(self.stream, batch_size=100, claim_idle_ms=1500, claim_interval_ms=500)
        return {**table, "queue": QUEUE, **overrides}

    def publish(self, n: int, start: int) -> None:
        self.keys |= {
            f"redis:{self.stream}:{i}" for i in produce(self.server.url, self.stream, n, start=start)
        }

    def settled(self, db_url: str) -> bool:
        return acked(db_url) == len(self.keys) and xpending(self.server.url, self.stream) == 0

    def kill(self) -> None:
        self.server.kill()

    def start(self) -> None:
        self.server.start()  # appendfsync always: every acknowledged XADD survived


@dataclass
class NatsStream:
    server: Any  # NatsServer
    keys: set[str] = field(default_factory=set)
    per_phase: int = 1500
    rounds: int = 5
    around_restart: int = 500
    stream: str = "ORDERS"

    def adapter(self, **overrides: Any) -> dict[str, Any]:
        # ack_wait: what a killed ingester left unacked comes back this soon.
        return {
            "name": "orders",
            "transport": "nats",
            "mode": "jetstream",
            "source": self.stream,
            "group": "switchboard",
            "queue": QUEUE,
            "url": self.server.url,
            "batch_size": 100,
            "block_ms": 200,
            "ack_wait_ms": 3000,
            **overrides,
        }

    def publish(self, n: int, start: int) -> None:
        sequences = nats_publish(self.server.url, f"{self.stream}.new", bodies(n, start))
        self.keys |= {f"nats:{self.stream}:{seq}" for seq in sequences}

    def settled(self, db_url: str) -> bool:
        figures = consumer_figures(self.server.url, self.stream, "switchboard")
        return acked(db_url) == len(self.keys) and figures == (0, 0)

    def kill(self) -> None:
        self.server.kill()

    def start(self) -> None:
        self.server.start()  # file storage: the stream and its consumer survived


@dataclass
class SqsQueue:
    endpoint: str
    keys: set[str] = field(default_factory=set)
    per_phase: int = 250  # small: the emulator's receive slows with the queue's depth
    rounds: int = 4
    around_restart: int = 0  # the emulator keeps its queues in memory: not restarted

    def __post_init__(self) -> None:
        self.sqs = client(self.endpoint)
        self.url = create_queue(self.sqs, "orders", max_receive_count=50)

    def adapter(self, **overrides: Any) -> dict[str, Any]:
        # ack_wait: what a killed ingester left undeleted comes back this soon.
        return {
            "name": "orders",
            "transport": "sqs",
            "source": "orders",
            "queue": QUEUE,
            "url": self.endpoint,
            "region": "us-east-1",
            "batch_size": 50,
            "block_ms": 1000,
            "ack_wait_ms": 3000,
            **overrides,
        }

    def publish(self, n: int, start: int) -> None:
        self.keys |= {f"sqs:orders:{i}" for i in send(self.sqs, self.url, bodies(n, start))}

    def settled(self, db_url: str) -> bool:
        # Nothing in the dead-letter queue either: every message was stored first.
        dead = self.sqs.get_queue_url(QueueName="orders-dlq")["QueueUrl"]
        return acked(db_url) == len(self.keys) and counts(self.sqs, self.url) == counts(self.sqs, dead) == (
            0,
            0,
            0,
        )

    def kill(self) -> None:
        raise NotImplementedError("the emulator keeps its queues in memory: no restart to survive")

    def start(self) -> None:
        raise NotImplementedError


@dataclass
class AmqpQueue:
    server: Any  # RabbitMqServer
    keys: set[str] = field(default_factory=set)
    per_phase: int = 500  # of each kind: with and without a message id
    rounds: int = 4
    # A classic queue recovered from a crash marks every message redelivered,
    # and each redelivered message is stored alone (a suspect, as a crash
    # loop's would be: about 20 a second here): 1,010 of them took 38 s; 210
    # cross the same path.
    around_restart: int = 100
    queue: str = "orders"

    def __post_init__(self) -> None:
        declare_queue(self.server.url, self.queue)

    def adapter(self, **overrides: Any) -> dict[str, Any]:
        return {
            "name": "orders",
            "transport": "amqp",
            "source": self.queue,
            "queue": QUEUE,
            "url": self.server.url,
            "batch_size": 50,
            "block_ms": 200,
            **overrides,
        }

    def publish(self, n: int, start: int) -> None:
        ids = [f"m-{i}" for i in range(start, start + n)]
        amqp_publish(self.server.url, self.queue, bodies(n, start, kind="id"), message_ids=ids)
        self.keys |= {f"amqp:{self.queue}:{i}" for i in ids}
        # And as many without an id, every tenth twice: one todo per distinct body.
        plain = bodies(n, start, kind="body")
        plain += plain[::10]
        publish_without_ids(self.server.url, self.queue, plain)
        self.keys |= {f"amqp:{self.queue}:{hashlib.sha256(b).hexdigest()}" for b in plain}

    def settled(self, db_url: str) -> bool:
        ready, unacked, _consumers = queue_counts(self.server.url, self.queue)
        return ready == 0 and unacked == 0 and acked(db_url) == len(self.keys)

    def kill(self) -> None:
        self.server.kill()

    def start(self) -> None:
        self.server.restart()


def _broker(request: pytest.FixtureRequest, transport: str) -> Iterator[Broker]:
    if transport == "redis":
        yield RedisStream(request.getfixturevalue("own_redis"))
    elif transport == "nats":
        with owned_nats() as nats:
            create_stream(nats.url, "ORDERS")
            yield NatsStream(nats)
    elif transport == "sqs":
        use_emulator_credentials(request.getfixturevalue("monkeypatch"))  # and every process started here
        with owned_sqs() as sqs:
            yield SqsQueue(sqs.url)
    else:
        with owned_rabbitmq() as rabbit:
            yield AmqpQueue(rabbit)


@pytest.fixture(params=["redis", "nats", "sqs", "amqp"])
def any_broker(request: pytest.FixtureRequest) -> Iterator[Broker]:
    yield from _broker(request, request.param)


@pytest.fixture(params=["redis", "nats", "amqp"])
def restartable_broker(request: pytest.FixtureRequest) -> Iterator[Broker]:
    yield from _broker(request, request.param)


def config_for(make_config: Callable[..., Path], broker: Broker, **overrides: Any) -> Path:
    table = broker.adapter(**overrides)
    # A Redis adapter's broker is the file's [redis] URL: this test's own server.
    return (
        make_config(table, redis=broker.server.url) if isinstance(broker, RedisStream) else make_config(table)
    )


def test_random_kill9_of_ingesters_and_acker(
    procs: Processes, make_config: Callable[..., Path], db_url: str, any_broker: Broker
) -> None:
    seed, rng = seeded()
    broker = any_broker
    config = config_for(make_config, broker)
    broker.publish(broker.per_phase, 0)

    def halfway() -> None:
        broker.publish(broker.per_phase, broker.per_phase)

    slots, kills = kill9_rounds(procs, config, rng, broker.rounds, halfway)
    what = f"convergence after {kills} kills (seed {seed})"
    converged = functools.partial(broker.settled, db_url)
    wait_for(converged, timeout_s=120, interval_s=0.5, what=what)
    stop_settled(slots.values(), converged, what=what)
    assert_stored_once(db_url, sorted(broker.keys), queue=QUEUE)
    procs.assert_no_secret_logged()


def test_the_broker_killed_and_started_again_mid_run(
    procs: Processes, make_config: Callable[..., Path], db_url: str, restartable_broker: Broker
) -> None:
    """kill -9 of the broker while an ingester and an acker run: both notice,
    back off (not a tight loop) and carry on once it is back, nothing lost
    or doubled; both exit cleanly."""
    broker = restartable_broker
    config = config_for(make_config, broker, batch_size=20)
    broker.publish(broker.around_restart, 0)
    ingester = procs.start("ingest", config, name="ingester")
    acker = procs.start("ack", config, name="acker")
    wait_for(lambda: acked(db_url) > 0, timeout_s=60, interval_s=0.05, what="the first acks")
    broker.kill()
    wait_for(lambda: ingester.events("broker_error"), timeout_s=30, what="the ingester to notice")
    broker.start()
    broker.publish(broker.around_restart, broker.around_restart)
    wait_for(
        lambda: broker.settled(db_url), timeout_s=120, interval_s=0.5, what="convergence after the restart"
    )
    assert ingester.alive()
    assert acker.alive()
    errors = ingester.events("broker_error")
    assert all(e["adapter"] == "orders" and e["retry_in_s"] > 0 for e in errors), errors[:3]
    # Backed off, not a tight loop: the backoff is capped at 1 s here, so few attempts.
    assert len(errors) < 200
    stop_settled((ingester, acker), lambda: broker.settled(db_url), what="convergence after the restart")
    assert_stored_once(db_url, sorted(broker.keys), queue=QUEUE)
    procs.assert_no_secret_logged()
