"""The Redis transport: one module per mode over shared plumbing (``common``).

``MODES`` is where the transport registers its modes with the adapter
factory (``ingest.adapters.factory``): the adapter that reads, the
acknowledger that discharges its committed ack intents, and the ack kind.
``describe_ack`` puts an intent in the words of the command the acker sends.
"""

from __future__ import annotations

from backhalf.records import NO_ACK
from ingest.adapters.base import AckIntentView, ModeImplementation
from ingest.adapters.redis import lists, streams
from ingest.adapters.redis.lists import ListAcknowledger, ListAdapter
from ingest.adapters.redis.pubsub import NoAcknowledger, PubSubAdapter
from ingest.adapters.redis.streams import StreamAcknowledger, StreamAdapter

# OpenTelemetry's messaging.system for this transport's spans (backhalf.tracing).
MESSAGING_SYSTEM = "redis"
MODES: dict[str, ModeImplementation] = {
    "stream": ModeImplementation(StreamAdapter, StreamAcknowledger, streams.ACK_KIND),
    "list": ModeImplementation(ListAdapter, ListAcknowledger, lists.ACK_KIND),
    "pubsub": ModeImplementation(PubSubAdapter, NoAcknowledger, NO_ACK),
}


def describe_ack(intent: AckIntentView) -> str:
    if intent.kind == streams.ACK_KIND:
        return f"XACK {intent.key} {intent.group} {intent.ref}"
    if intent.kind == lists.ACK_KIND:
        return f"LREM {intent.key} {intent.copies} <body>"
    return "none (pub/sub: nothing to ack)"
