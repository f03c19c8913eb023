"""Where ``switchboard demo`` produces its orders: a Redis stream (the
default) or a NATS JetStream stream (``--transport nats``). Each source says
what its adapter table is, how to publish a chunk of bodies, and the
broker's own count of what is still unacked, in that broker's words."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import redis

STREAM = "orders"
NATS_STREAM = "ORDERS"
NATS_SUBJECT = "ORDERS.new"
GROUP = "switchboard"
TRANSPORTS = ("redis", "nats")


class DemoSource(Protocol):
    transport: str
    ack_word: str  # what the acker sends, for the report
    unacked_label: str
    restart_note: str

    def adapter(self) -> dict[str, Any]: ...

    def produce(self, bodies: list[bytes]) -> None: ...

    def unacked(self) -> int: ...


def _common_adapter() -> dict[str, Any]:
    return {"name": "orders", "queue": "orders", "ack_after": "store", "batch_size": 200, "block_ms": 200}


class RedisStreamSource:
    transport = "redis"
    ack_word = "XACK"
    unacked_label = "pending in Redis (PEL)"
    restart_note = "same consumer name: it re-reads its own PEL"

    def __init__(self, client: redis.Redis) -> None:
        self._r = client

    def adapter(self) -> dict[str, Any]:
        return {**_common_adapter(), "transport": "redis", "mode": "stream", "source": STREAM, "group": GROUP}

    def produce(self, bodies: list[bytes]) -> None:
        pipe = self._r.pipeline(transaction=False)
        for body in bodies:
            pipe.xadd(STREAM, {"body": body})
        pipe.execute()

    def unacked(self) -> int:
        return int(self._r.xpending(STREAM, GROUP)["pending"])


class NatsSource:
    """A JetStream stream on the demo's own nats-server; the calls run on one
    event loop kept for the demo's length (nats-py is asyncio only)."""

    transport = "nats"
    ack_word = "+ACK"
    unacked_label = "unacked in JetStream"
    # The demo's ack_wait: what the killed ingester held comes back this soon.
    ACK_WAIT_MS = 3000
    restart_note = f"what it held and never stored comes back after ack_wait ({ACK_WAIT_MS} ms)"

    def __init__(self, url: str, runner: asyncio.Runner) -> None:
        import nats  # the nats extra, which the embedded kit installs

        self._url, self._runner = url, runner
        self._client = runner.run(nats.connect(url, allow_reconnect=False, connect_timeout=5))
        self._js = self._client.jetstream(timeout=10)
        runner.run(self._js.add_stream(name=NATS_STREAM, subjects=[f"{NATS_STREAM}.>"]))

    def adapter(self) -> dict[str, Any]:
        return {
            **_common_adapter(),
            "transport": "nats",
            "mode": "jetstream",
            "source": NATS_STREAM,
            "group": GROUP,
            "url": self._url,
            "ack_wait_ms": self.ACK_WAIT_MS,
        }

    def produce(self, bodies: list[bytes]) -> None:
        async def publish() -> None:
            acks = [await self._js.publish(NATS_SUBJECT, body, timeout=10) for body in bodies]
            assert len(acks) == len(bodies)

        self._runner.run(publish())

    def unacked(self) -> int:
        async def figures() -> int:
            info = await self._js.consumer_info(NATS_STREAM, GROUP)
            return int(info.num_ack_pending or 0) + int(info.num_pending or 0)

        return self._runner.run(figures())

    def close(self) -> None:
        self._runner.run(self._client.close())


@contextlib.contextmanager
def demo_source(transport: str, base: Path, redis_client: redis.Redis) -> Iterator[tuple[DemoSource, str]]:
    """The source for ``transport``, and a line saying where its server runs
    (a nats-server of its own in ``base`` for NATS; Redis is the demo's)."""
    if transport == "redis":
        yield RedisStreamSource(redis_client), ""
        return
    from ingest.embedded.nats_server import nats_server

    with nats_server(base / "nats") as server, asyncio.Runner() as runner:
        source = NatsSource(server.url, runner)
        try:
            yield source, f"NATS (JetStream) on 127.0.0.1:{server.port} (pid {server.pid})"
        finally:
            source.close()
