"""The inbox's read model: one row kind, one model, for every reader.
:class:`InboxRow` is every column but the stored body; ``inbox list``, the
rows a filtered ``inbox replay`` picks and ``trace``'s trail read it, and
``inbox show`` (:class:`InboxDetail`) adds the body.

Reads only; SQLAlchemy Core, every value a bound parameter (the text of
``--error-contains`` too, its ``%`` and ``_`` escaped).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from schema import inbox

# A time bound: a moment, or an age (that long before the database's now(),
# so it is measured on the clock that wrote stored_at).
TimeBound = datetime | timedelta

_LIKE_ESCAPE = "\\"


@dataclass(frozen=True, slots=True)
class InboxRow:
    """Every column of one inbox row but its body."""

    id: int
    adapter: str
    idempotency_key: str
    source_message_id: str | None
    consumer: str | None
    status: str
    error: str | None
    deliveries: int
    ack_kind: str
    ack_key: str | None  # stream: the stream key; list: the processing list
    ack_group: str | None
    ack_entry_id: str | None
    ack_copies: int
    ack_after: str
    ack_state: str
    acked_at: datetime | None
    stored_at: datetime
    todo_id: int | None
    event_id: int | None


@dataclass(frozen=True, slots=True)
class InboxDetail(InboxRow):
    """One inbox row whole: its columns and its stored body."""

    body: bytes
    body_size: int | None  # set: ``body`` is only the first bytes of a message this long
    body_sha256: bytes | None  # ... and this is the whole message's digest


def columns(model: type[InboxRow] = InboxRow) -> list[sa.ColumnElement[Any]]:
    """The columns of ``model``, in its fields' order."""
    return [inbox.c[f.name] for f in dataclasses.fields(model)]


@dataclass(frozen=True, slots=True, kw_only=True)
class InboxQuery:
    """Which rows a list shows: only rejected ones, only those whose ack is
    pending, only one adapter's; at most ``limit``."""

    rejected: bool = False
    unacked: bool = False
    adapter: str | None = None
    limit: int = 100


async def list_rows(conn: AsyncConnection, wanted: InboxQuery = InboxQuery()) -> list[InboxRow]:
    """The newest rows first, at most ``wanted.limit``."""
    query = sa.select(*columns())
    if wanted.rejected:
        query = query.where(inbox.c.status == "rejected")
    if wanted.unacked:
        query = query.where(inbox.c.ack_state == "pending")
    if wanted.adapter is not None:
        query = query.where(inbox.c.adapter == wanted.adapter)
    rows = await conn.execute(query.order_by(inbox.c.id.desc()).limit(wanted.limit))
    return [InboxRow(*row) for row in rows]


@dataclass(frozen=True, slots=True)
class ReplayFilter:
    """Which rejected rows a filtered replay takes; ``None``: no condition."""

    adapter: str | None = None
    since: TimeBound | None = None
    until: TimeBound | None = None
    error_contains: str | None = None
    # Only rows with a higher id: where the last run stopped, so rows that
    # keep failing at the front never hide the ones after them.
    after_id: int | None = None

    def is_empty(self) -> bool:
        return (self.adapter, self.since, self.until, self.error_contains) == (None,) * 4


async def get_row(conn: AsyncConnection, inbox_id: int) -> InboxDetail | None:
    row = (await conn.execute(sa.select(*columns(InboxDetail)).where(inbox.c.id == inbox_id))).first()
    if row is None:
        return None
    detail = InboxDetail(*row)
    # bytea may arrive as a memoryview: plain bytes for the callers.
    digest = None if detail.body_sha256 is None else bytes(detail.body_sha256)
    return dataclasses.replace(detail, body=bytes(detail.body), body_sha256=digest)


def escape_like(text: str) -> str:
    """``text`` matched literally inside a LIKE pattern."""
    for special in (_LIKE_ESCAPE, "%", "_"):
        text = text.replace(special, _LIKE_ESCAPE + special)
    return text


def _bound(moment: TimeBound) -> sa.ColumnElement[datetime]:
    if isinstance(moment, timedelta):
        return sa.func.now() - sa.literal(moment, sa.Interval)
    return sa.literal(moment, sa.DateTime(timezone=True))


async def replay_candidates(conn: AsyncConnection, where: ReplayFilter, *, limit: int) -> list[InboxRow]:
    """Rejected rows matching ``where``, oldest (lowest id) first, at most
    ``limit``. Every filter has ``status = 'rejected'``, the predicate of
    ``ix_inbox_rejected``, so the rows read are the rejected ones only,
    however big the inbox (no index on stored_at is needed, nor wanted on
    the hot insert path)."""
    query = sa.select(*columns()).where(inbox.c.status == "rejected")
    if where.adapter is not None:
        query = query.where(inbox.c.adapter == where.adapter)
    if where.since is not None:
        query = query.where(inbox.c.stored_at >= _bound(where.since))
    if where.until is not None:
        query = query.where(inbox.c.stored_at < _bound(where.until))
    if where.after_id is not None:
        query = query.where(inbox.c.id > where.after_id)
    if where.error_contains is not None:
        pattern = f"%{escape_like(where.error_contains)}%"
        query = query.where(inbox.c.error.ilike(pattern, escape=_LIKE_ESCAPE))
    rows = await conn.execute(query.order_by(inbox.c.id).limit(limit))
    return [InboxRow(*row) for row in rows]
