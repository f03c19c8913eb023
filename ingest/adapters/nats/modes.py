"""The NATS transport (JetStream): its one mode over shared plumbing (``common``).

``MODES`` registers the mode with the adapter factory
(``ingest.adapters.factory``), which imports this module only for an
adapter with ``transport = "nats"``: nats-py is the ``nats`` install extra.
``describe_ack`` puts an intent in the words of what the acker sends.
"""

from __future__ import annotations

from ingest.adapters.base import AckIntentView, ModeImplementation
from ingest.adapters.nats import jetstream
from ingest.adapters.nats.jetstream import JetStreamAcknowledger, JetStreamAdapter

# OpenTelemetry's messaging.system for this transport's spans (backhalf.tracing).
MESSAGING_SYSTEM = "nats"
MODES: dict[str, ModeImplementation] = {
    "jetstream": ModeImplementation(JetStreamAdapter, JetStreamAcknowledger, jetstream.ACK_KIND),
}


def describe_ack(intent: AckIntentView) -> str:
    return f"+ACK to {intent.ref} (stream {intent.key}, consumer {intent.group})"
