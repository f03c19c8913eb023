"""The database's backlog, as the acker's gauges report it: pending acks and
the oldest one's age per adapter, and the active todos per queue and status.

Both are read every ``[metrics] refresh_interval_ms``, so both stay cheap
however large the tables grow: ``ack_queue`` holds only acks still owed, the
inbox rows an ack cursor has not passed yet are read from where it stands, and
the active todos are counted through the partial indexes that hold exactly
them (``ix_todos_claimable``, ``ix_todos_running_lease``), never over the finished ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from schema import inbox, todos
from schema.tables import ack_cursors, ack_queue

ACTIVE = ("pending", "dispatched", "running")


@dataclass(frozen=True, slots=True)
class AckBacklog:
    pending: int
    oldest_age_s: float  # 0.0: none pending


async def ack_backlog(conn: AsyncConnection, own_acked: Sequence[str] = ()) -> dict[str, AckBacklog]:
    """Per adapter with acks owed or waiting (ack_after = "complete"): the
    queued ones and the ones the adapter's cursor has not passed yet; and
    for ``own_acked``, adapters whose ingester acks (its transport binds acks
    to the consuming channel), the intents
    still pending (no cursor walks them; their mark clears ``ack_xid``, so
    ``ix_inbox_ack_cursor`` holds just those)."""
    queued = sa.select(
        ack_queue.c.adapter,
        sa.func.count().label("pending"),
        sa.func.min(ack_queue.c.inbox_id).label("oldest_id"),
    ).group_by(ack_queue.c.adapter)
    rows = list(await conn.execute(queued)) + list(await conn.execute(_cursor_owed()))
    if own_acked:
        own = (
            sa.select(inbox.c.adapter, sa.func.count(), sa.func.min(inbox.c.id))
            .where(
                inbox.c.adapter.in_(list(own_acked)),
                inbox.c.ack_xid.isnot(None),
                inbox.c.ack_state == "pending",
            )
            .group_by(inbox.c.adapter)
        )
        rows += list(await conn.execute(own))
    owed: dict[str, tuple[int, int]] = {}
    for adapter, n, oldest_id in rows:
        if n:
            before = owed.get(adapter)
            owed[adapter] = (n, oldest_id) if before is None else (before[0] + n, min(before[1], oldest_id))
    if not owed:
        return {}
    age = sa.extract("epoch", sa.func.now() - inbox.c.stored_at)
    oldest = sorted({i for _, i in owed.values()})
    ages: dict[int, float] = {
        int(i): float(a)
        for i, a in await conn.execute(sa.select(inbox.c.id, age).where(inbox.c.id.in_(oldest)))
    }
    return {a: AckBacklog(int(n), max(0.0, ages.get(i, 0.0))) for a, (n, i) in owed.items()}


def _cursor_owed() -> sa.Select[tuple[str, int, int]]:
    """Per adapter cursor, the rows owed from where it stands: a walk of
    ``ix_inbox_ack_cursor`` from the cursor (per cursor, LATERAL, so the
    plan does not hang on statistics). A row a long transaction holds back
    is counted, and ages, like any other."""
    behind = (
        sa.select(sa.func.count().label("pending"), sa.func.min(inbox.c.id).label("oldest_id"))
        .where(
            inbox.c.adapter == ack_cursors.c.adapter,
            inbox.c.ack_xid.isnot(None),
            sa.tuple_(inbox.c.ack_xid, inbox.c.id) > sa.tuple_(ack_cursors.c.xid, ack_cursors.c.inbox_id),
            inbox.c.ack_state == "pending",
        )
        .lateral("owed")
    )
    return sa.select(ack_cursors.c.adapter, behind.c.pending, behind.c.oldest_id).select_from(
        ack_cursors.join(behind, sa.true())
    )


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
