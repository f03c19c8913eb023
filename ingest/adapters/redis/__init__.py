"""The Redis transport: one module per mode over shared plumbing (``common``).

``MODES`` is where the transport registers its modes with the adapter
factory (``ingest.adapters.factory``): the adapter that reads and the
acknowledger that discharges its committed ack intents.
"""

from __future__ import annotations

from ingest.adapters.base import ModeImplementation
from ingest.adapters.redis.lists import ListAcknowledger, ListAdapter
from ingest.adapters.redis.pubsub import NoAcknowledger, PubSubAdapter
from ingest.adapters.redis.streams import StreamAcknowledger, StreamAdapter

MODES: dict[str, ModeImplementation] = {
    "stream": ModeImplementation(StreamAdapter, StreamAcknowledger),
    "list": ModeImplementation(ListAdapter, ListAcknowledger),
    "pubsub": ModeImplementation(PubSubAdapter, NoAcknowledger),
}
