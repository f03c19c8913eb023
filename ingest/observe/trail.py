"""A message's timeline, as ``switchboard trace`` and the console show it:
every recorded moment of one inbox row's trail, oldest first.

Where a message's id says when the broker took it (its transport's
``sent``), its timeline starts there; the other steps are PostgreSQL's
``now()`` of the transaction that wrote them (two clocks: an offset below
zero, or a large first one, says they disagree).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from backhalf.reads import trace
from ingest.adapters.base import AckIntentView
from ingest.adapters.factory import describe_ack
from ingest.config.transports import definitions


@dataclass(frozen=True, slots=True)
class Step:
    """One moment of a message's timeline."""

    at: datetime
    what: str
    # What kind of moment: the broker's (a transport's word), stored, event, acked, or the todo status
    # entered (pending, dispatched, running, done, failed, cancelled); the
    # console's ``data-step``.
    kind: str


def sent_step(t: trace.Trail) -> Step | None:
    """When the broker took the message, where its transport reads that
    from the message's id; None where it cannot. An adapter no longer
    registered is asked of every transport."""
    row = t.inbox
    known = definitions().get(t.transport or "")
    for d in [known] if known is not None else list(definitions().values()):
        if d.sent is not None and (sent := d.sent(t.mode, row.ack_kind, row.source_message_id)) is not None:
            return Step(sent.at, sent.what, sent.kind)
    return None


def sent_at(t: trace.Trail) -> datetime | None:
    step = sent_step(t)
    return None if step is None else step.at


def is_bare_id(query: str) -> bool:
    """Whether ``query`` is a message id some transport lets an operator
    give alone (a stream entry id), rather than a whole key."""
    return any(d.bare_id is not None and d.bare_id.match(query) for d in definitions().values())


def timeline(t: trace.Trail) -> list[Step]:
    """Every recorded moment of the message, oldest first (ties in the order
    the pipeline takes them)."""
    row = t.inbox
    steps: list[Step] = []
    sent = sent_step(t)
    if sent is not None:
        steps.append(sent)
    steps.append(Step(row.stored_at, f"stored: inbox row {row.id}, {row.status}", "stored"))
    if t.event is not None:
        steps.append(Step(t.event.received_at, f"event {t.event.id} recorded", "event"))
    if t.todo is not None:
        if not any(e.from_status is None for e in t.todo_events):  # creation not logged
            steps.append(Step(t.todo.created_at, f"todo {t.todo.id} created", "pending"))
        for e in t.todo_events:
            change = f"todo {t.todo.id}: {e.from_status or '(new)'} -> {e.to_status}"
            # Whitespace collapsed only: --json keeps the text as stored, and
            # text_lines makes it printable.
            detail = " ".join((e.detail or "").split())
            steps.append(Step(e.created_at, f"{change} ({detail})" if detail else change, e.to_status))
    if row.acked_at is not None:
        steps.append(Step(row.acked_at, f"acked: {ack_command(t)}", "acked"))
    # sorted() is stable: equal times (one transaction's now()) keep this order.
    return sorted(steps, key=lambda s: s.at)


def offset(at: datetime, first: datetime) -> str:
    return f"{(at - first).total_seconds():+.3f} s"


def ack_command(t: trace.Trail) -> str:
    row = t.inbox
    intent = AckIntentView(row.ack_kind, row.ack_key, row.ack_group, row.ack_entry_id, row.ack_copies)
    return describe_ack(t.transport, intent)
