"""A message's timeline, as ``switchboard trace`` and the console show it:
every recorded moment of one inbox row's trail, oldest first.

A stream entry id is ``<ms>-<seq>``, the milliseconds being Redis's clock
when the producer's XADD ran, so a stream message's timeline starts at its
XADD; the other steps are PostgreSQL's ``now()`` of the transaction that
wrote them (two clocks: an offset below zero, or a large first one, says
they disagree).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime

from backhalf import trace
from ingest.adapters.base import AckIntentView
from ingest.adapters.factory import describe_ack

# A Redis stream entry id as stored: milliseconds, a dash, a sequence number.
ENTRY_ID = re.compile(r"^([0-9]+)-([0-9]+)$")


@dataclass(frozen=True, slots=True)
class Step:
    """One moment of a message's timeline."""

    at: datetime
    what: str
    # What kind of moment: xadd, stored, event, acked, or the todo status
    # entered (pending, dispatched, running, done, failed, cancelled); the
    # console's ``data-step``.
    kind: str


def xadd_time(entry_id: str | None) -> datetime | None:
    """When Redis took the entry (its id's milliseconds), or None: not an entry id."""
    match = ENTRY_ID.match(entry_id or "")
    if match is None:
        return None
    try:
        return datetime.fromtimestamp(int(match.group(1)) / 1000, UTC)
    except (OverflowError, ValueError, OSError):  # an explicit id far beyond any clock
        return None


def xadd_of(row: trace.InboxTrail) -> datetime | None:
    # Only a stream entry's id is a time; a list or pub/sub row has none.
    return xadd_time(row.source_message_id) if row.ack_kind == "xack" or row.mode == "stream" else None


def timeline(t: trace.Trail) -> list[Step]:
    """Every recorded moment of the message, oldest first (ties in the order
    the pipeline takes them)."""
    row = t.inbox
    steps: list[Step] = []
    xadd = xadd_of(row)
    if xadd is not None:
        steps.append(
            Step(xadd, f"XADD {row.source_message_id} (the entry id's time, on Redis's clock)", "xadd")
        )
    steps.append(Step(row.stored_at, f"stored: inbox row {row.inbox_id}, {row.status}", "stored"))
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
        steps.append(Step(row.acked_at, f"acked: {ack_command(row)}", "acked"))
    # sorted() is stable: equal times (one transaction's now()) keep this order.
    return sorted(steps, key=lambda s: s.at)


def offset(at: datetime, first: datetime) -> str:
    return f"{(at - first).total_seconds():+.3f} s"


def ack_command(row: trace.InboxTrail) -> str:
    intent = AckIntentView(row.ack_kind, row.ack_key, row.ack_group, row.ack_entry_id, row.ack_copies)
    return describe_ack(row.transport, intent)
