"""What the console's overview flags (``switchboard web``, issue 44): failed
todos, running todos and for how long, the oldest claimable todo of a queue,
rejected inbox rows. Read every few seconds while a browser shows the
overview, so each read is bounded by an index, whatever the history holds:

* **failed todos**: ``ix_todos_queue_status_id`` (queue, status, id). The queues
  are found by a loose scan of that index (one descent per queue, however
  many todos each holds), then each queue's failed entries are read, at
  most ``limit`` + 1: past ``limit`` the count says "more" ("1000+"). The
  newest (the highest id: the first row of ``/todos?status=failed``) is
  exact up to ``limit``; past it, it is looked for among the
  ``NEWEST_SCAN_ROWS`` highest ids at or above the highest one read, and
  when it is not there (the failures are older than that many todos), the
  highest one read is given, said to be not the newest (``newest_exact``).
* **running todos**: ``ix_todos_running_lease`` holds exactly the running
  rows (as many as the workers have threads); at most ``RUNNING_READ_MAX``.
  A running todo's ``updated_at`` is its claim (lease extensions leave it).
* **the oldest claimable todo of a queue**: ``ix_todos_claimable`` (queue,
  run_after, id), its first entry.
* **rejected inbox rows**: ``ix_inbox_rejected``, read in its own order
  (adapter, id) so no plan but the index is cheaper, at most ``limit`` + 1.

SQLAlchemy Core, every value a bound parameter.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from backhalf.reads import todo_views
from backhalf.redaction import redact
from schema import inbox, todos
from schema.tables import CLAIMABLE_TODO_STATUSES

COUNT_LIMIT = 1000  # a count past it is shown as "1000+"
NEWEST_SCAN_ROWS = 10_000
RUNNING_READ_MAX = 1000
ERROR_SHOWN_CHARS = 300


@dataclass(frozen=True, slots=True)
class FailedTodo:
    id: int
    queue: str
    failed_s: float  # since it failed (its last change)
    last_error: str | None  # its first ERROR_SHOWN_CHARS characters


@dataclass(frozen=True, slots=True)
class FailedTodos:
    """``count`` failed todos, or more when ``more`` (each queue read up to
    the limit); ``by_queue`` the same per queue; ``newest``, the failed todo
    with the highest id, or (``newest_exact`` False) a recent one."""

    count: int
    more: bool
    by_queue: dict[str, int]
    newest: FailedTodo | None
    newest_exact: bool = True


@dataclass(frozen=True, slots=True)
class RunningTodo:
    id: int
    queue: str
    running_s: float  # since its claim


async def failed_todos(conn: AsyncConnection, limit: int = COUNT_LIMIT) -> FailedTodos:
    queues = todo_views.distinct_queues()
    read = (
        sa.select(todos.c.id)
        .where(todos.c.queue == queues.c.queue, todos.c.status == "failed")
        .limit(limit + 1)
        .lateral("failed")
    )
    per_queue = (
        sa.select(queues.c.queue, sa.func.count(), sa.func.max(read.c.id))
        .select_from(queues.join(read, sa.true()))
        .where(queues.c.queue.isnot(None))
        .group_by(queues.c.queue)
    )
    rows = [(q, int(n), int(top)) for q, n, top in await conn.execute(per_queue)]
    if not rows:
        return FailedTodos(0, False, {}, None)
    more = any(n > limit for _, n, _ in rows)
    highest = max(top for _, _, top in rows)
    exact = True
    if more:
        found = await _newest_failed_from(conn, highest)
        highest, exact = (highest, False) if found is None else (found, True)
    by_queue = {q: min(n, limit) for q, n, _ in rows}
    newest = await _failed_todo(conn, highest)
    return FailedTodos(sum(by_queue.values()), more, by_queue, newest, exact)


async def _newest_failed_from(conn: AsyncConnection, at_least: int) -> int | None:
    """The highest failed id among the ``NEWEST_SCAN_ROWS`` highest ids, if
    one is at or above ``at_least`` (a failed todo's id)."""
    top = (
        sa.select(todos.c.id, todos.c.status)
        .where(todos.c.id >= at_least)
        .order_by(todos.c.id.desc())
        .limit(NEWEST_SCAN_ROWS)
        .subquery("top")
    )
    found = (await conn.execute(sa.select(sa.func.max(top.c.id)).where(top.c.status == "failed"))).scalar()
    return None if found is None else int(found)


async def _failed_todo(conn: AsyncConnection, todo_id: int) -> FailedTodo | None:
    row = (
        await conn.execute(
            sa.select(
                todos.c.id,
                todos.c.queue,
                sa.extract("epoch", sa.func.now() - todos.c.updated_at),
                todos.c.last_error,
            ).where(todos.c.id == todo_id, todos.c.status == "failed")
        )
    ).first()
    if row is None:
        return None
    # Redacted whole, then cut: a cut first could leave half a credential
    # the redaction no longer recognizes.
    error = None if row[3] is None else redact(row[3])[:ERROR_SHOWN_CHARS]
    return FailedTodo(int(row[0]), row[1], max(0.0, float(row[2])), error)


async def running_todos(conn: AsyncConnection, limit: int = RUNNING_READ_MAX) -> list[RunningTodo]:
    """The running todos, the longest running first (at most ``limit``)."""
    rows = await conn.execute(
        sa.select(todos.c.id, todos.c.queue, sa.extract("epoch", sa.func.now() - todos.c.updated_at))
        .where(todos.c.status == "running")
        .order_by(todos.c.updated_at, todos.c.id)
        .limit(limit)
    )
    return [RunningTodo(int(i), q, max(0.0, float(s))) for i, q, s in rows]


async def oldest_claimable(conn: AsyncConnection, queues: Sequence[str]) -> dict[str, float]:
    """Per queue of ``queues`` with a claimable todo: how long its oldest has
    been due, in seconds (negative: none is due yet, the soonest in that
    many)."""
    due: dict[str, float] = {}
    for queue in queues:
        first = (
            sa.select(sa.extract("epoch", sa.func.now() - todos.c.run_after))
            .where(todos.c.queue == queue, todos.c.status.in_(CLAIMABLE_TODO_STATUSES))
            .order_by(todos.c.run_after)
            .limit(1)
        )
        seconds = (await conn.execute(first)).scalar()
        if seconds is not None:
            due[queue] = float(seconds)
    return due


@dataclass(frozen=True, slots=True)
class Bounded:
    """A count read up to a limit: ``count``, or more when ``more``."""

    count: int
    more: bool


async def rejected_rows(conn: AsyncConnection, limit: int = COUNT_LIMIT) -> Bounded:
    read = (
        sa.select(inbox.c.id)
        .where(inbox.c.status == "rejected")
        .order_by(inbox.c.adapter, inbox.c.id)
        .limit(limit + 1)
        .subquery("rejected")
    )
    n = int((await conn.execute(sa.select(sa.func.count()).select_from(read))).scalar_one())
    return Bounded(min(n, limit), n > limit)
