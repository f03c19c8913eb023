"""Operator tools over the inbox: list what was rejected, replay it once the
cause is fixed (``switchboard inbox list --rejected`` / ``inbox replay ID``).

A replay re-normalizes the stored raw body with the adapter's current rules
and, if it passes, creates (or dedups to) the todo and the event in one
transaction, turning the row from ``rejected`` into ``stored``. The broker
was acked long ago; nothing is asked of it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import JSONB, insert
from sqlalchemy.ext.asyncio import AsyncConnection

from backhalf.errors import BackhalfError, PoisonMessage
from backhalf.records import InboxRecord
from schema import events, inbox, todo_events, todos
from schema.tables import TODO_ACTIVE_PREDICATE


class ReplayError(BackhalfError):
    """The row cannot be replayed (not rejected, no body, still poison)."""


@dataclass(frozen=True, slots=True)
class InboxRow:
    id: int
    adapter: str
    idempotency_key: str
    source_message_id: str | None
    status: str
    ack_state: str
    deliveries: int
    error: str | None
    stored_at: datetime


async def list_rows(
    conn: AsyncConnection,
    *,
    rejected: bool = False,
    unacked: bool = False,
    adapter: str | None = None,
    limit: int = 100,
) -> list[InboxRow]:
    query = sa.select(
        inbox.c.id,
        inbox.c.adapter,
        inbox.c.idempotency_key,
        inbox.c.source_message_id,
        inbox.c.status,
        inbox.c.ack_state,
        inbox.c.deliveries,
        inbox.c.error,
        inbox.c.stored_at,
    )
    if rejected:
        query = query.where(inbox.c.status == "rejected")
    if unacked:
        query = query.where(inbox.c.ack_state == "pending")
    if adapter is not None:
        query = query.where(inbox.c.adapter == adapter)
    rows = await conn.execute(query.order_by(inbox.c.id.desc()).limit(limit))
    return [InboxRow(*row) for row in rows]


Normalizer = Callable[[bytes], str]


async def replay(
    conn: AsyncConnection,
    inbox_id: int,
    *,
    queue_for: Callable[[str], str],
    normalize_for: Callable[[str], Normalizer],
) -> int:
    """Replay one rejected row in the caller's transaction; return the todo id."""
    row = (
        await conn.execute(
            sa.select(
                inbox.c.adapter,
                inbox.c.idempotency_key,
                inbox.c.source_message_id,
                inbox.c.body,
                inbox.c.status,
                inbox.c.error,
            )
            .where(inbox.c.id == inbox_id)
            .with_for_update()
        )
    ).first()
    if row is None:
        raise ReplayError(f"inbox row {inbox_id} does not exist")
    adapter, key, message_id, body, status, error = row
    if status != "rejected":
        raise ReplayError(f"inbox row {inbox_id} is {status}, not rejected")
    if not body:
        raise ReplayError(f"inbox row {inbox_id} has no body to replay ({error})")
    try:
        payload = normalize_for(adapter)(bytes(body))
    except PoisonMessage as exc:
        raise ReplayError(f"inbox row {inbox_id} is still rejected: {exc}") from exc
    record = InboxRecord(key, message_id, bytes(body), payload)
    todo_id = await _upsert_todo(conn, queue_for(adapter), record)
    event_id = await conn.scalar(
        sa.insert(events)
        .values(
            family="queue",
            adapter=adapter,
            trust_mode="queue",
            verified=False,
            verify_detail=f"replayed by operator from inbox row {inbox_id}",
            idempotency_key=key,
            source_message_id=message_id,
            payload=_jsonb(record),
            todo_id=todo_id,
        )
        .returning(events.c.id)
    )
    await conn.execute(
        sa.update(inbox)
        .where(inbox.c.id == inbox_id)
        .values(status="stored", error=None, todo_id=todo_id, event_id=event_id)
    )
    return todo_id


async def _upsert_todo(conn: AsyncConnection, queue: str, record: InboxRecord) -> int:
    """Create the todo, or return the active one with the same key."""
    stmt = insert(todos).values(queue=queue, idempotency_key=record.idempotency_key, payload=_jsonb(record))
    upsert = stmt.on_conflict_do_update(
        index_elements=[todos.c.queue, todos.c.idempotency_key],
        index_where=TODO_ACTIVE_PREDICATE,
        set_={"updated_at": todos.c.updated_at},
    ).returning(todos.c.id, sa.literal_column("xmax = 0"))
    todo_id, created = (await conn.execute(upsert)).one()
    if created:
        await conn.execute(
            sa.insert(todo_events).values(todo_id=todo_id, to_status="pending", detail="created by replay")
        )
    return int(todo_id)


def _jsonb(record: InboxRecord) -> sa.ColumnElement[object]:
    # The payload is JSON text already: cast it in SQL, do not re-encode it.
    return sa.cast(sa.literal(record.payload, sa.Text()), JSONB)
