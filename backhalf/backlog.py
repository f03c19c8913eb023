"""The database's backlog, as the acker's gauges report it: pending acks and
the oldest one's age per adapter, and the active todos per queue and status.

Both are read every ``[metrics] refresh_interval_ms``, so both stay cheap
however large the tables grow: ``ack_queue`` holds only acks still owed, and
the active todos are counted through the partial indexes that hold exactly
them (``ix_todos_pending``, ``ix_todos_dispatched_at``,
``ix_todos_running_lease``), never over the finished ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from schema import inbox, todos
from schema.tables import ack_queue

ACTIVE = ("pending", "dispatched", "running")


@dataclass(frozen=True, slots=True)
class AckBacklog:
    pending: int
    oldest_age_s: float  # 0.0: none pending


async def ack_backlog(conn: AsyncConnection) -> dict[str, AckBacklog]:
    """Per adapter with acks owed or waiting (ack_after = "complete")."""
    owed = (
        sa.select(
            ack_queue.c.adapter,
            sa.func.count().label("pending"),
            sa.func.min(ack_queue.c.inbox_id).label("oldest_id"),
        )
        .group_by(ack_queue.c.adapter)
        .subquery()
    )
    age = sa.extract("epoch", sa.func.now() - inbox.c.stored_at)
    rows = await conn.execute(
        sa.select(owed.c.adapter, owed.c.pending, sa.func.coalesce(age, 0.0)).select_from(
            owed.outerjoin(inbox, inbox.c.id == owed.c.oldest_id)
        )
    )
    return {adapter: AckBacklog(int(n), max(0.0, float(a))) for adapter, n, a in rows}


async def active_todos(conn: AsyncConnection) -> dict[tuple[str, str], int]:
    """(queue, status) -> count, for the active statuses only."""
    counts: dict[tuple[str, str], int] = {}
    for status in ACTIVE:
        rows = await conn.execute(
            sa.select(todos.c.queue, sa.func.count()).where(todos.c.status == status).group_by(todos.c.queue)
        )
        for queue, n in rows:
            counts[(queue, status)] = int(n)
    return counts
