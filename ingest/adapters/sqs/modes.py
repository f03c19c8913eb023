"""The SQS transport: its one mode over shared plumbing (``common``).

``MODES`` registers the mode with the adapter factory
(``ingest.adapters.factory``), which imports this module only for an
adapter with ``transport = "sqs"``: aiobotocore is the ``sqs`` install extra.
``describe_ack`` puts an intent in the words of what the acker sends.
"""

from __future__ import annotations

from ingest.adapters.base import AckIntentView, ModeImplementation
from ingest.adapters.sqs import queue
from ingest.adapters.sqs.queue import SqsDeleter, SqsQueueAdapter

# OpenTelemetry's messaging.system for this transport's spans (backhalf.tracing).
MESSAGING_SYSTEM = "aws_sqs"
MODES: dict[str, ModeImplementation] = {
    "queue": ModeImplementation(SqsQueueAdapter, SqsDeleter, queue.ACK_KIND),
}


def describe_ack(intent: AckIntentView) -> str:
    handle = intent.ref or "-"
    shown = handle if len(handle) <= 24 else f"{handle[:20]}...({len(handle)} chars)"
    return f"DeleteMessage on queue {intent.key or '-'} with receipt handle {shown}"
