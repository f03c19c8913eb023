"""The trail of one message, for ``switchboard trace``: which inbox rows hold
it, and for each its broker coordinates, its event, its todo with every
``todo_events`` row, and its ack.

Reads only; SQLAlchemy Core, every value a bound parameter.

How a message is found, and what it costs. ``ix_inbox_adapter_key`` holds
every row by ``(adapter, idempotency_key)``. So a key is probed once per
registered adapter (and per partition), and an entry id is turned into each registered
stream adapter's native key (``{key_prefix}:{source}:{entry-id}``, from the
``adapters`` row) and probed the same way: both cost a handful of index
lookups however big the inbox is (issue 45; a key with no native row was a
scan of the whole inbox before). Another message stored on a reused entry id has a
derived key of its own (``backhalf.writes.keys.reused_key``): trace it by that key.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from datetime import datetime

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from backhalf.reads import inbox_views, todo_views
from schema import adapters, events, inbox, todos


@dataclass(frozen=True, slots=True)
class EventTrail:
    id: int
    family: str
    trust_mode: str
    verified: bool
    verify_detail: str | None
    received_at: datetime


@dataclass(frozen=True, slots=True)
class Trail:
    """Everything PostgreSQL knows of one inbox row's message."""

    inbox: inbox_views.InboxRow
    # The row's adapter, from its registration (None: not registered, not
    # expected): its transport, mode and source (the stream key, list key
    # or channel), where the broker held the message.
    transport: str | None
    mode: str | None
    source: str | None
    event: EventTrail | None
    todo: todo_views.TodoDetail | None
    todo_events: list[todo_views.TodoEvent]


async def _inbox_rows(
    conn: AsyncConnection, ids: list[int]
) -> list[tuple[inbox_views.InboxRow, str | None, str | None, str | None]]:
    """Each row with its adapter's transport, mode and source."""
    if not ids:
        return []
    rows = await conn.execute(
        sa.select(
            *inbox_views.columns(),
            adapters.c.transport,
            adapters.c.mode,
            adapters.c.settings["source"].astext,
        )
        .select_from(inbox.outerjoin(adapters, adapters.c.name == inbox.c.adapter))
        .where(inbox.c.id.in_(ids))
        .order_by(inbox.c.id)
    )
    return [(inbox_views.InboxRow(*row[:-3]), *row[-3:]) for row in rows]


async def inbox_ids_by_key(conn: AsyncConnection, key: str) -> list[int]:
    """Inbox rows with this idempotency key, in any adapter: a probe of
    ``ix_inbox_adapter_key`` per registered adapter."""
    probe = (
        sa.select(inbox.c.id)
        .where(inbox.c.adapter == adapters.c.name, inbox.c.idempotency_key == key)
        .lateral("probe")
    )
    return sorted(await conn.scalars(sa.select(probe.c.id).select_from(adapters.join(probe, sa.true()))))


async def inbox_ids_by_todo(conn: AsyncConnection, todo_id: int) -> list[int]:
    """Inbox rows whose message made or was deduplicated to this todo: the
    rows with the todo's idempotency key (a todo takes its message's key)
    that point at it."""
    key = await conn.scalar(sa.select(todos.c.idempotency_key).where(todos.c.id == todo_id))
    if key is None:
        return []
    ids = await inbox_ids_by_key(conn, key)
    if not ids:
        return []
    owned = await conn.scalars(
        sa.select(inbox.c.id).where(inbox.c.id.in_(ids), inbox.c.todo_id == todo_id).order_by(inbox.c.id)
    )
    return list(owned)


async def inbox_ids_by_entry_id(conn: AsyncConnection, entry_id: str) -> list[int]:
    """Inbox rows of this stream entry id in every registered stream adapter,
    found through each one's native key."""
    # A registration without its key_prefix has its transport's default,
    # which is the transport's name.
    prefix = sa.func.coalesce(adapters.c.settings["key_prefix"].astext, adapters.c.transport)
    native = prefix + ":" + adapters.c.settings["source"].astext + ":" + sa.literal(entry_id, sa.Text)
    probe = (
        sa.select(inbox.c.id)
        .where(
            inbox.c.adapter == adapters.c.name,
            inbox.c.idempotency_key == native,
            inbox.c.source_message_id.isnot(None),
        )
        .lateral("probe")
    )
    rows = await conn.scalars(
        sa.select(probe.c.id).select_from(adapters.join(probe, sa.true())).where(adapters.c.mode == "stream")
    )
    return sorted(rows)


async def trails(conn: AsyncConnection, inbox_ids: list[int]) -> list[Trail]:
    """The trail of each of these inbox rows (those that exist), in id order."""
    out: list[Trail] = []
    for row, transport, mode, source in await _inbox_rows(conn, inbox_ids):
        event = await _event(conn, row.event_id) if row.event_id is not None else None
        todo = await todo_views.get_todo(conn, row.todo_id) if row.todo_id is not None else None
        history = await todo_views.history(conn, todo.id) if todo is not None else []
        out.append(Trail(row, transport, mode, source, event, todo, history))
    return out


# The event's columns an EventTrail holds, in its fields' order.
_EVENT_COLUMNS = tuple(f.name for f in dataclasses.fields(EventTrail))


async def _event(conn: AsyncConnection, event_id: int) -> EventTrail | None:
    row = (await conn.execute(sa.select(*events.c[_EVENT_COLUMNS]).where(events.c.id == event_id))).first()
    return None if row is None else EventTrail(*row)
