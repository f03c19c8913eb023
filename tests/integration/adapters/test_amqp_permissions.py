"""The least-privilege RabbitMQ user of ops/rabbitmq-definitions.json, its
permissions and its queue read from that file (so the example and this
test cannot drift), on a real RabbitMQ: the pipeline stores and acks as
that user, and the broker refuses it, with ACCESS_REFUSED, what it must
not do: publish, declare or delete a queue, consume another queue. The
file itself imports with ``rabbitmqctl import_definitions``."""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aio_pika
import aiormq.exceptions
import pytest
from aio_pika.abc import AbstractChannel, AbstractIncomingMessage

from ingest.adapters.amqp.common import close_connection
from ingest.adapters.factory import make_adapter
from ingest.embedded.rabbitmq_server import AmqpQueue, AmqpUser, RabbitMqServer, password_hash
from ingest.errors import BrokerError
from tests.support.amqp import owned_rabbitmq, publish, queue_counts
from tests.support.db import query, scalar
from tests.support.in_process import pipeline, settings, wait_until

DEFINITIONS = Path(__file__).parents[3] / "ops" / "rabbitmq-definitions.json"
INGEST = "switchboard-ingest"
QUEUE = "orders"
# A queue the user has no right to, declared by the test's broker beside the file's.
ELSEWHERE = "payments"
NAME = "orders"


def definitions() -> dict[str, Any]:
    document: dict[str, Any] = json.loads(DEFINITIONS.read_text())
    return document


def ingest_user(password: str) -> AmqpUser:
    """The file's user with its permissions as written, and ``password``."""
    document = definitions()
    (user,) = [u for u in document["users"] if u["name"] == INGEST]
    (granted,) = [p for p in document["permissions"] if p["user"] == INGEST]
    return AmqpUser(
        INGEST,
        password,
        configure=granted["configure"],
        write=granted["write"],
        read=granted["read"],
        vhost=granted["vhost"],
        tags=tuple(user["tags"]),
    )


def file_queues() -> list[AmqpQueue]:
    return [
        AmqpQueue(q["name"], durable=q["durable"], arguments=q["arguments"], vhost=q["vhost"])
        for q in definitions()["queues"]
    ]


@dataclass(frozen=True)
class Broker:
    server: RabbitMqServer
    password: str  # the ingest user's

    @property
    def ingest_url(self) -> str:
        return self.server.url_as(INGEST, self.password)


@pytest.fixture(scope="module")
def broker() -> Iterator[Broker]:
    password = secrets.token_urlsafe(18)
    queues = [*file_queues(), AmqpQueue(ELSEWHERE)]
    with owned_rabbitmq(users=[ingest_user(password)], queues=queues) as server:
        yield Broker(server, password)


@pytest.fixture
def registered() -> tuple[tuple[str, str], ...]:
    return ()  # the pipeline registers its adapter itself


def table(url: str, queue: str = QUEUE) -> dict[str, Any]:
    return {"name": NAME, "transport": "amqp", "source": queue, "url": url, "consumer": "c1", "block_ms": 100}


def test_the_file_grants_one_queue_to_read_and_nothing_else() -> None:
    document = definitions()
    assert [u["name"] for u in document["users"]] == [INGEST]
    (user,) = document["users"]
    assert user["tags"] == []  # no management or monitoring views
    assert user["hashing_algorithm"] == "rabbit_password_hashing_sha256"
    assert user["password_hash"].startswith("REPLACE")  # a placeholder, no one's password
    assert document["permissions"] == [
        {"user": INGEST, "vhost": "/", "configure": "", "write": "", "read": f"^{QUEUE}$"}
    ]
    assert [q["name"] for q in document["queues"]] == [QUEUE]


async def test_the_pipeline_stores_and_acks_as_the_files_user(
    broker: Broker, db_url: str, redis_url: str
) -> None:
    bodies = [json.dumps({"n": n}).encode() for n in range(20)]
    publish(broker.server.url, QUEUE, bodies)  # the queue's producer, not the ingester
    s = settings(db_url, redis_url, table(broker.ingest_url))
    async with pipeline(s, acker=False):
        await wait_until(
            lambda: scalar(db_url, "SELECT count(*) FROM inbox WHERE ack_state = 'acked'") == len(bodies)
        )
        await wait_until(lambda: queue_counts(broker.server.url, QUEUE)[:2] == (0, 0))
    rows = query(db_url, "SELECT body FROM inbox")
    assert sorted(bytes(b) for (b,) in rows) == sorted(bodies)
    assert query(db_url, "SELECT DISTINCT verify_detail FROM events") == [(f"amqp user: {INGEST} vhost: /",)]
    assert queue_counts(broker.server.url, QUEUE) == (0, 0, 0)


@pytest.fixture
async def as_ingest(broker: Broker) -> AsyncIterator[Callable[[], Awaitable[AbstractChannel]]]:
    """Channels of one connection as the file's user, each opened afresh:
    a refusal closes the channel it came on."""
    connection = await aio_pika.connect(broker.ingest_url, timeout=10)

    async def channel() -> AbstractChannel:
        return await connection.channel(publisher_confirms=True)

    try:
        yield channel
    finally:
        await close_connection(connection, adapter="test")


async def refused(attempt: Awaitable[Any]) -> str:
    with pytest.raises(aiormq.exceptions.ChannelAccessRefused) as raised:
        await attempt
    text = str(raised.value)
    assert "ACCESS_REFUSED" in text, text
    assert f"refused for user '{INGEST}'" in text, text
    return text


async def test_the_broker_refuses_the_user_what_it_must_not_do(
    broker: Broker, as_ingest: Callable[[], Awaitable[AbstractChannel]]
) -> None:
    url = broker.server.url
    publish(url, QUEUE, [b'{"kept": 1}'])
    before = queue_counts(url, QUEUE)

    # Publish: to the queue through the default exchange, or any other.
    channel = await as_ingest()
    message = aio_pika.Message(b'{"forged": 1}', delivery_mode=aio_pika.DeliveryMode.PERSISTENT)
    text = await refused(channel.default_exchange.publish(message, routing_key=QUEUE, timeout=10))
    assert "exchange 'amq.default'" in text
    channel = await as_ingest()
    topic = await channel.get_exchange("amq.topic", ensure=False)
    assert "exchange 'amq.topic'" in await refused(topic.publish(message, routing_key=QUEUE, timeout=10))

    # Declare a queue: a new one, or its own queue as it is (only passive is allowed).
    channel = await as_ingest()
    assert "queue 'intruder'" in await refused(channel.declare_queue("intruder", durable=True, timeout=10))
    channel = await as_ingest()
    arguments = definitions()["queues"][0]["arguments"]
    own = channel.declare_queue(QUEUE, durable=True, arguments=arguments, timeout=10)
    assert f"queue '{QUEUE}'" in await refused(own)

    # Delete or bind its own queue.
    channel = await as_ingest()
    assert f"queue '{QUEUE}'" in await refused(channel.queue_delete(QUEUE, timeout=10))
    channel = await as_ingest()
    underlay = await channel.get_underlay_channel()
    assert f"queue '{QUEUE}'" in await refused(underlay.queue_bind(QUEUE, "amq.direct", routing_key="x"))

    # Consume another queue (its passive declare is allowed: no permission is checked).
    channel = await as_ingest()
    other = await channel.declare_queue(ELSEWHERE, passive=True, timeout=10)

    async def never(_message: AbstractIncomingMessage) -> None:
        raise AssertionError("a delivery from a queue the user may not read")

    assert f"queue '{ELSEWHERE}'" in await refused(other.consume(never, timeout=10))

    # Nothing changed: no message added or taken, no queue made or lost.
    assert queue_counts(url, QUEUE) == before
    with pytest.raises(LookupError):
        queue_counts(url, "intruder")


async def test_the_adapter_on_another_queue_is_refused_as_a_broker_error(
    broker: Broker, db_url: str, redis_url: str
) -> None:
    (cfg,) = settings(db_url, redis_url, table(broker.ingest_url, ELSEWHERE)).adapters
    adapter = make_adapter(cfg, ledger=None)
    try:
        with pytest.raises(BrokerError, match=rf"ACCESS_REFUSED - access to queue '{ELSEWHERE}'") as raised:
            await adapter.start()
    finally:
        await adapter.close()
    assert broker.password not in str(raised.value)


def test_the_file_imports_with_rabbitmqctl(broker: Broker, tmp_path: Path) -> None:
    """``rabbitmqctl import_definitions`` takes the file (its placeholder
    replaced by the hash of the user's password, so the user keeps working)
    and leaves the user with the same permissions."""
    document = definitions()
    document["users"][0]["password_hash"] = password_hash(broker.password)
    path = tmp_path / "definitions.json"
    path.write_text(json.dumps(document))
    broker.server.rabbitmqctl("import_definitions", str(path))
    listed = broker.server.rabbitmqctl("-q", "list_user_permissions", INGEST, "--formatter", "json")
    assert json.loads(listed) == [{"vhost": "/", "configure": "", "write": "", "read": f"^{QUEUE}$"}]
