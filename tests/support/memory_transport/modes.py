"""The in-memory transport's one mode, as the adapter factory loads it."""

from __future__ import annotations

from ingest.adapters.base import AckIntentView, ModeImplementation
from tests.support.memory_transport.broker import ACK_KIND, MemoryAcknowledger, MemoryQueueAdapter

MESSAGING_SYSTEM = "memory"
MODES: dict[str, ModeImplementation] = {
    "queue": ModeImplementation(MemoryQueueAdapter, MemoryAcknowledger, ACK_KIND),
}


def describe_ack(intent: AckIntentView) -> str:
    return f"ack {intent.ref} on {intent.key}"
