"""The demo's source on this transport (``switchboard demo --transport amqp``;
the developer kit, ``embedded`` extra): a durable queue on a RabbitMQ of the
demo's own, the system's ``rabbitmq-server`` package run as its child.
Loaded by ``ingest.embedded.demo_sources`` by the transport's name, only for
a demo on it."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ingest.embedded import rabbitmq_server as kit
from ingest.embedded.demo_sources import AsyncClientSource, demo_adapter
from ingest.embedded.rabbitmq_server import RabbitMqServer

if TYPE_CHECKING:
    from aio_pika.abc import AbstractChannel, AbstractConnection

AMQP_QUEUE = "orders"


def missing() -> str | None:
    """Why the demo's broker cannot run here, with how to get it; None when
    it can (RabbitMQ comes from the system, not from a wheel)."""
    why = kit.rabbitmq_missing()
    if why is None:
        return None
    how = "" if "apt-get install rabbitmq-server" in why else " (Debian: apt-get install rabbitmq-server)"
    return f"--transport amqp runs a RabbitMQ of its own from the system's package: {why}{how}"


class AmqpSource(AsyncClientSource):
    """A durable classic queue on the demo's own RabbitMQ, through aio-pika
    (the amqp extra, which the embedded kit installs), kept for the demo's
    length. Each order is published persistent and confirmed by the broker;
    its ``message_id`` is its body's digest, the key the adapter would derive
    itself from a message without one (aio-pika would otherwise stamp a
    random id on each)."""

    transport = "amqp"
    source_word = "queue"
    ack_word = "basic.ack"
    unacked_label = "left in the RabbitMQ queue"
    restart_note = "the broker put back in the queue what its channel held unacked, as its connection ended"

    def __init__(self, server: RabbitMqServer) -> None:
        self._server = server
        self._connection: AbstractConnection | None = None
        super().__init__("demo-amqp")

    async def _open(self) -> None:
        import aio_pika  # the amqp extra, which the embedded kit installs

        self._connection = await aio_pika.connect(self._server.url, timeout=self.CALL_TIMEOUT_S)
        self._channel: AbstractChannel = await self._connection.channel(publisher_confirms=True)
        await self._channel.declare_queue(AMQP_QUEUE, durable=True, timeout=self.CALL_TIMEOUT_S)

    async def _close(self) -> None:
        if self._connection is not None:
            await self._connection.close()

    def adapter(self) -> dict[str, Any]:
        return demo_adapter("amqp", "queue", AMQP_QUEUE, self._server.url)

    def produce(self, bodies: list[bytes], traceparent: str | None = None) -> None:
        """Publish the chunk's messages at once, then wait for every confirm
        (three times the rate of one confirm at a time)."""
        headers: dict[str, Any] | None = {"traceparent": traceparent} if traceparent else None
        import aio_pika
        from pamqp.commands import Basic

        async def publish() -> None:
            exchange = self._channel.default_exchange
            confirms = await asyncio.gather(*(
                exchange.publish(
                    aio_pika.Message(body, delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                                     message_id=hashlib.sha256(body).hexdigest(), headers=headers),
                    routing_key=AMQP_QUEUE, mandatory=True, timeout=self.CALL_TIMEOUT_S,
                )
                for body in bodies
            ))  # fmt: skip
            refused = [c for c in confirms if not isinstance(c, Basic.Ack)]
            if refused:
                raise RuntimeError(f"RabbitMQ refused {len(refused)} of the demo's messages: {refused[0]!r}")

        self._call(publish, self.PRODUCE_TIMEOUT_S)

    def unacked(self) -> int:
        """Ready and delivered-but-unacked: every message not yet acked, the
        broker's own figures (AMQP tells no unacked count)."""
        ready, unacked, _consumers = self._server.queue_counts(AMQP_QUEUE)
        return ready + unacked


@contextlib.contextmanager
def opened(base: Path) -> Iterator[tuple[AmqpSource, str]]:
    """The source on a server of its own in ``base``, and where it runs."""
    with kit.rabbitmq_server(base / "rabbitmq") as rabbit:
        source = AmqpSource(rabbit)
        try:
            yield source, f"RabbitMQ on 127.0.0.1:{rabbit.port} (pid {rabbit.pid}, node {rabbit.node})"
        finally:
            source.close()
