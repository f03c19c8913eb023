"""The console's reads that must stay cheap on a big inbox (``switchboard
web``, issue 31): the last hour's figures per adapter and minute.

The audit views answer the same questions over the whole inbox (there is no
index on ``stored_at`` or ``acked_at``: each would cost on the hot insert
path, ``schema.tables``). Inbox ids grow with time, so the first row of the
window is found by a binary search over the primary key (about 20 index
probes for a million rows), and the figures are read from that id on: the
rows of the window only, however big the table. Same definitions as
``audit_adapter_minutes`` (``schema.views``), with one difference: a row
acked in the window but stored before it is not counted (an acker down for
longer than the window); ``tests/integration/backhalf/test_console_views.py``
holds the two equal on rows of the window.

SQLAlchemy Core, every value a bound parameter.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from schema import events, inbox

WINDOW = timedelta(hours=1)


@dataclass(frozen=True, slots=True)
class MinuteFigures:
    """One adapter's minute, as ``audit_adapter_minutes`` defines its columns."""

    adapter: str
    minute: datetime
    consumed: int
    deduplicated_inbox: int
    deduplicated_todo: int
    rejected: int
    acked: int
    ack_latency_p50_s: float | None
    ack_latency_p95_s: float | None
    ack_latency_p99_s: float | None


async def window_start_id(conn: AsyncConnection, cutoff: sa.ColumnElement[datetime]) -> int | None:
    """The lowest inbox id stored at or after ``cutoff`` (None: no such row),
    by a binary search over the primary key, one row read per probe.

    Ids may have gaps, so the search is over the id space for the smallest
    ``x`` whose first row at or after ``x`` is inside the window: that holds
    for every larger ``x`` too, as ``stored_at`` grows with the id."""
    low, high = (await conn.execute(sa.select(sa.func.min(inbox.c.id), sa.func.max(inbox.c.id)))).one()
    if low is None or not await _first_inside(conn, high, cutoff):
        return None
    while low < high:
        middle = (low + high) // 2
        if await _first_inside(conn, middle, cutoff):
            high = middle
        else:
            low = middle + 1
    first = sa.select(inbox.c.id).where(inbox.c.id >= low).order_by(inbox.c.id).limit(1)
    found: int = (await conn.execute(first)).scalar_one()
    return found


async def _first_inside(conn: AsyncConnection, at_or_after: int, cutoff: sa.ColumnElement[datetime]) -> bool:
    """Whether the first row at or after the id was stored at or after ``cutoff``."""
    probe = (
        sa.select(inbox.c.stored_at >= cutoff).where(inbox.c.id >= at_or_after).order_by(inbox.c.id).limit(1)
    )
    return bool((await conn.execute(probe)).scalar())


async def recent_minutes(
    conn: AsyncConnection, window: timedelta = WINDOW, adapter: str | None = None, *, detail: bool = True
) -> list[MinuteFigures]:
    """Per adapter and minute of the last ``window``, oldest first. Without
    ``detail`` (the overview's sparklines), the counts only: the todo
    dedup (an index probe per row) is 0 and the latencies None, at about
    half the cost."""
    cutoff = sa.func.now() - sa.literal(window, sa.Interval)
    first = await window_start_id(conn, cutoff)
    if first is None:
        return []
    own = [inbox.c.id >= first]
    if adapter is not None:
        own.append(inbox.c.adapter == adapter)
    earlier = events.alias("earlier")
    todo_dedup: sa.ColumnElement[bool] = (
        sa.exists()
        .where(earlier.c.todo_id == inbox.c.todo_id, earlier.c.id < inbox.c.event_id)
        .correlate(inbox)
        if detail
        else sa.false()
    )
    stored = sa.select(
        inbox.c.adapter.label("adapter"),
        sa.func.date_trunc("minute", inbox.c.stored_at).label("minute"),
        sa.true().label("stored"),
        (inbox.c.deliveries - 1).label("redeliveries"),
        (inbox.c.status == "rejected").label("rejected"),
        todo_dedup.label("todo_dedup"),
        sa.cast(sa.null(), sa.Float).label("ack_latency_s"),
    ).where(*own, inbox.c.stored_at >= cutoff)
    acked = sa.select(
        inbox.c.adapter,
        sa.func.date_trunc("minute", inbox.c.acked_at),
        sa.false(),
        sa.cast(sa.null(), sa.Integer),
        sa.false(),
        sa.false(),
        sa.cast(sa.extract("epoch", inbox.c.acked_at - inbox.c.stored_at), sa.Float),
    ).where(*own, inbox.c.acked_at >= cutoff)
    m = sa.union_all(stored, acked).subquery("m")
    latency = m.c.ack_latency_s

    def pct(p: float) -> sa.ColumnElement[float]:
        if not detail:
            return sa.cast(sa.null(), sa.Float)
        return sa.func.percentile_cont(p).within_group(latency)

    query = (
        sa.select(
            m.c.adapter,
            m.c.minute,
            sa.func.count().filter(m.c.stored),
            sa.func.coalesce(sa.func.sum(m.c.redeliveries), 0),
            sa.func.count().filter(m.c.todo_dedup),
            sa.func.count().filter(m.c.rejected),
            sa.func.count().filter(sa.not_(m.c.stored)),
            pct(0.5),
            pct(0.95),
            pct(0.99),
        )
        .group_by(m.c.adapter, m.c.minute)
        .order_by(m.c.minute, m.c.adapter)
    )
    return [MinuteFigures(*row) for row in await conn.execute(query)]


def by_adapter(minutes: list[MinuteFigures]) -> dict[str, list[MinuteFigures]]:
    """``recent_minutes``' rows per adapter, each oldest first."""
    grouped: dict[str, list[MinuteFigures]] = {}
    for m in minutes:
        grouped.setdefault(m.adapter, []).append(m)
    return grouped
