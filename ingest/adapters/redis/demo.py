"""The demo's source on this transport (``switchboard demo --transport redis``;
the developer kit, ``embedded`` extra): a Redis stream on a Valkey (or
redis-server) of the demo's own. Loaded by ``ingest.embedded.demo_sources``
by the transport's name, only for a demo on it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import redis

from ingest.embedded.demo_sources import GROUP, demo_adapter
from ingest.embedded.servers import RedisServer

STREAM = "orders"


class RedisStreamSource:
    transport = "redis"
    source_word = "stream"
    ack_word = "XACK"
    unacked_label = "pending in Redis (PEL)"
    restart_note = "same consumer name: it re-reads its own PEL"

    def __init__(self, client: redis.Redis, url: str) -> None:
        self._r = client
        self._url = url
        self.process_env: dict[str, str] = {}

    def adapter(self) -> dict[str, Any]:
        return demo_adapter("redis", "stream", STREAM, self._url, group=GROUP)

    def produce(self, bodies: list[bytes], traceparent: str | None = None) -> None:
        pipe = self._r.pipeline(transaction=False)
        for body in bodies:
            fields: dict[str | bytes, str | bytes] = {"body": body}
            if traceparent:
                fields["traceparent"] = traceparent
            pipe.xadd(STREAM, fields)  # type: ignore[arg-type]
        pipe.execute()

    def unacked(self) -> int:
        return int(self._r.xpending(STREAM, GROUP)["pending"])


@contextlib.contextmanager
def opened(base: Path) -> Iterator[tuple[RedisStreamSource, str]]:
    """The source on a server of its own in ``base``, and where it runs."""
    server = RedisServer.create(base / "redis", appendfsync="always")
    try:
        server.start()
        with contextlib.closing(redis.Redis.from_url(server.url, socket_timeout=10)) as client:
            where = f"{server.binary.name} on 127.0.0.1:{server.port} (pid {server.pid})"
            yield RedisStreamSource(client, server.url), where
    finally:
        server.cleanup()
