"""Where the suite's RabbitMQ comes from (DESIGN.md section 6b): the URL in
``SWITCHBOARD_TEST_AMQP_URL``, else a broker the suite starts itself from
the system's ``rabbitmq-server`` package (``ingest.embedded.rabbitmq_server``;
``make test`` installs it under root), its one user's password the planted
secret, else a RabbitMQ container when a Docker engine answers, else none:
the tests that need one are skipped, each with a reason starting
``NO_BROKER``, and the session's summary counts them (tests/conftest.py), so
a run without RabbitMQ never reads as a pass. Tests that stop or kill the
broker own one of their own (``owned_rabbitmq``), whichever source the
shared one came from.

The rest is the tests' AMQP client (aio-pika): queues declared, messages
published persistent with the broker's confirm, queues purged and deleted;
``AmqpClient`` in a test's event loop, and blocking forms for tests without
one (which run on a thread of their own when called from inside a loop).
``queue_counts`` is the broker's own record (ready, unacked, consumers):
AMQP tells no unacked count, so it asks the broker's node (a broker the
suite started) or ``rabbitmqctl`` in the container."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Sequence
from typing import Any, TypeVar

import aio_pika
import pytest
from pamqp.commands import Basic

from ingest.embedded.rabbitmq_server import (
    AmqpQueue,
    AmqpTls,
    AmqpUser,
    RabbitMqServer,
    rabbitmq_missing,
    rabbitmq_server,
)
from ingest.embedded.servers import temp_base
from tests.support.processes import SECRET

URL_VARIABLE = "SWITCHBOARD_TEST_AMQP_URL"
# Every skip for want of a broker starts so; the session's summary counts them.
NO_BROKER = "AMQP: no RabbitMQ server"
CONNECT_TIMEOUT_S = 10.0
CALL_TIMEOUT_S = 30.0
CONTAINER_IMAGE = "rabbitmq:3.10"

# Brokers the suite runs, by URL: what queue_counts asks.
_COUNTERS: dict[str, Callable[[str], tuple[int, int, int]]] = {}

_T = TypeVar("_T")


def no_broker_reason() -> str | None:
    """Why this session has no RabbitMQ (a skip reason starting ``NO_BROKER``),
    None when it has one: a URL given, the broker's binaries installed, or Docker."""
    if os.environ.get(URL_VARIABLE):
        return None
    missing = rabbitmq_missing()
    if missing is None:
        return None
    from tests.support.servers import _docker_answers

    if _docker_answers():
        return None
    return f"{NO_BROKER} ({missing}; no Docker engine either, and {URL_VARIABLE} is not set)"


def require_rabbitmq() -> None:
    """Skip the test (counted in the summary) when the broker's binaries are
    missing: for tests that start brokers of their own."""
    if (missing := rabbitmq_missing()) is not None:
        pytest.skip(f"{NO_BROKER} ({missing})")


@contextlib.contextmanager
def shared_amqp() -> Iterator[str]:
    """The URL of the session's RabbitMQ (vhost ``/``, every permission);
    skips, counted in the summary, when there is none."""
    url = os.environ.get(URL_VARIABLE)
    if url:
        yield url
        return
    if rabbitmq_missing() is None:
        with owned_rabbitmq() as server:
            yield server.url
        return
    if (reason := no_broker_reason()) is not None:
        pytest.skip(reason)
    with _container() as url:
        yield url


@contextlib.contextmanager
def owned_rabbitmq(
    *,
    users: Sequence[AmqpUser] = (),
    queues: Sequence[AmqpQueue] = (),
    consumer_timeout_ms: int | None = None,
    conf: str = "",
    tls: AmqpTls | None = None,
) -> Iterator[RabbitMqServer]:
    """A broker this caller owns, started (``switchboard``'s password is
    SECRET); removed with its folder after. Skips, counted in the summary,
    without the broker's binaries. ``tls``: a TLS listener too (``tls_port``)."""
    require_rabbitmq()
    base = temp_base("switchboard-rabbitmq-")
    try:
        with rabbitmq_server(
            base / "rabbitmq",
            password=SECRET,
            users=users,
            queues=queues,
            consumer_timeout_ms=consumer_timeout_ms,
            conf=conf,
            tls=tls,
        ) as server:
            _COUNTERS[server.url] = server.queue_counts
            try:
                yield server
            finally:
                _COUNTERS.pop(server.url, None)
    finally:
        with contextlib.suppress(OSError):
            base.joinpath("owner.pid").unlink()
            base.rmdir()


@contextlib.contextmanager
def _container() -> Iterator[str]:
    """RabbitMQ in Docker (testcontainers), user ``switchboard`` with SECRET."""
    from testcontainers.core.container import DockerContainer
    from testcontainers.core.waiting_utils import wait_for_logs

    container = DockerContainer(CONTAINER_IMAGE).with_exposed_ports(5672)
    container = container.with_env("RABBITMQ_DEFAULT_USER", "switchboard").with_env(
        "RABBITMQ_DEFAULT_PASS", SECRET
    )
    with container:
        wait_for_logs(container, "Server startup complete", timeout=120)
        host, port = container.get_container_host_ip(), container.get_exposed_port(5672)
        url = f"amqp://switchboard:{SECRET}@{host}:{port}/"

        def counts(queue: str) -> tuple[int, int, int]:
            columns = ["name", "messages_ready", "messages_unacknowledged", "consumers"]
            command = ["rabbitmqctl", "-q", "list_queues", "--formatter", "json", *columns]
            code, output = container.get_wrapped_container().exec_run(command)
            if code != 0:
                raise RuntimeError(f"rabbitmqctl list_queues in the container: exit {code}")
            for row in json.loads(output):
                if row["name"] == queue:
                    return (
                        int(row["messages_ready"]),
                        int(row["messages_unacknowledged"]),
                        int(row["consumers"]),
                    )
            raise LookupError(f"no queue {queue!r}")

        _COUNTERS[url] = counts
        try:
            yield url
        finally:
            _COUNTERS.pop(url, None)


class AmqpClient:
    """One connection and one confirming channel, for a test's event loop."""

    def __init__(
        self, connection: aio_pika.abc.AbstractConnection, channel: aio_pika.abc.AbstractChannel
    ) -> None:
        self.connection, self.channel = connection, channel

    async def declare_queue(
        self, name: str, *, quorum: bool = False, arguments: dict[str, Any] | None = None
    ) -> None:
        """A durable queue (a quorum queue with ``quorum``); ``arguments`` add
        to or replace the ``x-`` arguments."""
        args: dict[str, Any] = {"x-queue-type": "quorum"} if quorum else {}
        await self.channel.declare_queue(name, durable=True, arguments={**args, **(arguments or {})})

    async def publish(
        self, queue: str, bodies: Sequence[bytes], *, message_ids: Sequence[str] | None = None
    ) -> None:
        """Publish ``bodies`` in order to ``queue`` through the default
        exchange, persistent, each confirmed by the broker; one that no queue
        takes is an error (mandatory)."""
        if message_ids is not None and len(message_ids) != len(bodies):
            raise ValueError(f"{len(bodies)} bodies but {len(message_ids)} message ids")
        for i, body in enumerate(bodies):
            message = aio_pika.Message(
                body,
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                message_id=None if message_ids is None else message_ids[i],
            )
            confirm = await self.channel.default_exchange.publish(
                message, routing_key=queue, mandatory=True, timeout=CALL_TIMEOUT_S
            )
            if not isinstance(confirm, Basic.Ack):
                raise AssertionError(f"the broker did not take message {i} for queue {queue!r}: {confirm!r}")

    async def counts(self, queue: str) -> tuple[int, int]:
        """(ready, consumers), as a passive declare tells them."""
        declared = await self.channel.declare_queue(queue, passive=True)
        result = declared.declaration_result
        return int(result.message_count or 0), int(result.consumer_count or 0)

    async def purge_queue(self, queue: str) -> None:
        declared = await self.channel.declare_queue(queue, passive=True)
        await declared.purge(timeout=CALL_TIMEOUT_S)

    async def delete_queue(self, queue: str) -> None:
        """Delete ``queue``, messages and consumers and all; none is no error."""
        await self.channel.queue_delete(queue, timeout=CALL_TIMEOUT_S)


@contextlib.asynccontextmanager
async def amqp_client(url: str) -> AsyncIterator[AmqpClient]:
    connection = await aio_pika.connect(url, timeout=CONNECT_TIMEOUT_S)
    try:
        channel = await connection.channel(publisher_confirms=True)
        yield AmqpClient(connection, channel)
    finally:
        await connection.close()


# Blocking forms, for tests without an event loop, and for a test's own
# loop (then on a thread of their own: asyncio.run cannot nest).


def _run(make: Callable[[], Coroutine[Any, Any, _T]]) -> _T:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(make())
    outcome: list[_T] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            outcome.append(asyncio.run(make()))
        except BaseException as exc:  # handed to the caller's thread
            failure.append(exc)

    thread = threading.Thread(target=run, name="amqp-helper")
    thread.start()
    thread.join(timeout=CALL_TIMEOUT_S * 2)
    if thread.is_alive():
        raise TimeoutError(f"an AMQP helper call still running after {CALL_TIMEOUT_S * 2}s")
    if failure:
        raise failure[0]
    return outcome[0]


def declare_queue(
    url: str, name: str, *, quorum: bool = False, arguments: dict[str, Any] | None = None
) -> None:
    async def run() -> None:
        async with amqp_client(url) as client:
            await client.declare_queue(name, quorum=quorum, arguments=arguments)

    _run(run)


def publish(
    url: str, queue: str, bodies: Sequence[bytes], *, message_ids: Sequence[str] | None = None
) -> None:
    """See ``AmqpClient.publish``."""

    async def run() -> None:
        async with amqp_client(url) as client:
            await client.publish(queue, bodies, message_ids=message_ids)

    _run(run)


def purge_queue(url: str, queue: str) -> None:
    async def run() -> None:
        async with amqp_client(url) as client:
            await client.purge_queue(queue)

    _run(run)


def delete_queue(url: str, queue: str) -> None:
    async def run() -> None:
        async with amqp_client(url) as client:
            await client.delete_queue(queue)

    _run(run)


def queue_counts(url: str, queue: str) -> tuple[int, int, int]:
    """(ready, unacked, consumers) of ``queue``, the broker's own figures,
    on a broker the suite runs (``shared_amqp``, ``owned_rabbitmq``); a test
    on a broker from ``SWITCHBOARD_TEST_AMQP_URL`` is skipped (AMQP tells
    no unacked count). ``LookupError`` when there is no such queue."""
    counter = _COUNTERS.get(url)
    if counter is None:
        pytest.skip(f"unacked counts need a RabbitMQ the suite runs, not one from {URL_VARIABLE}")
    return counter(queue)
