"""The AMQP 0-9-1 transport (RabbitMQ): its one mode, ``queue``.

``MODES`` registers the mode with the adapter factory
(``ingest.adapters.factory``), which imports this module only for an
adapter with ``transport = "amqp"``: aio-pika is the ``amqp`` install extra.
An AMQP ack is bound to the channel that received the delivery (another
connection or channel gets ``PRECONDITION_FAILED - unknown delivery tag``,
and a tag on another channel can name another message), so the ingester acks
its own deliveries after its commit (``acked_by = "consumer"``) and the acker
has no part. ``describe_ack`` puts an intent in the words of that ack.
"""

from __future__ import annotations

from ingest.adapters.amqp import frames, queue
from ingest.adapters.amqp.queue import AmqpQueueAdapter, no_acker
from ingest.adapters.base import AckIntentView, ModeImplementation

# Before any frame is read: a producer's short string that is not UTF-8 must
# not end the connection (frames.py says why).
frames.install()


# OpenTelemetry's messaging.system for this transport's spans (backhalf.tracing).
MESSAGING_SYSTEM = "rabbitmq"
MODES: dict[str, ModeImplementation] = {
    "queue": ModeImplementation(AmqpQueueAdapter, no_acker, queue.ACK_KIND, acked_by="consumer"),
}


def describe_ack(intent: AckIntentView) -> str:
    session, _, tag = (intent.ref or "-:-").rpartition(":")
    return (
        f"basic.ack of delivery tag {tag or '-'} on channel {session or '-'} of queue {intent.key or '-'},"
        " sent by the ingester that received it, after its commit"
    )
