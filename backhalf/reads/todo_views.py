"""Operator reads over the todos (``switchboard todos list / show``) and the
checks behind an operator's retry and cancel.

Reads only: every write to ``todos`` and ``todo_events`` is in
:mod:`backhalf.lifecycle.todos`. SQLAlchemy Core, bound parameters only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
import sqlalchemy as sa
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection

from backhalf.housekeeping.heartbeats import ProcessRow
from backhalf.lifecycle.todos import MOVED_TRIES
from backhalf.redaction import redact
from schema import todo_events, todos
from schema.tables import TODO_ACTIVE_PREDICATE, TODO_STATUSES


@dataclass(frozen=True, slots=True)
class TodoRow:
    """Every column of one todo but its payload and trace context: a line of
    ``todos list``, and what an action reads under the row's lock."""

    id: int
    queue: str
    status: str
    attempts: int
    idempotency_key: str
    created_at: datetime
    updated_at: datetime
    run_after: datetime
    lease_until: datetime | None
    last_error: str | None


@dataclass(frozen=True, slots=True)
class TodoDetail(TodoRow):
    """The whole todo, for ``todos show``: its row, its payload and its trace."""

    payload: Any  # the decoded JSON
    # The trace its runs join (todos.trace_context's trace id), None without one.
    trace_id: str | None = None


def _columns() -> list[sa.ColumnElement[Any]]:
    """The columns of a :class:`TodoRow`, in its order."""
    return [todos.c[f.name] for f in dataclasses.fields(TodoRow)]


@dataclass(frozen=True, slots=True)
class TodoEvent:
    """One ``todo_events`` row: a state change of the todo."""

    created_at: datetime
    from_status: str | None  # None: the todo's creation
    to_status: str
    detail: str | None


def _todo_row(values: Sequence[Any]) -> TodoRow:
    """A row as every front end shows it: an error stored before errors
    were redacted on write is redacted here."""
    row = TodoRow(*values)
    return row if row.last_error is None else dataclasses.replace(row, last_error=redact(row.last_error))


def distinct_queues() -> sa.CTE:
    """Every queue that has a todo: a loose scan of ``ix_todos_queue_status_id``
    (the next queue is the least one above the last: one index descent per
    queue, however many todos each holds)."""
    found = sa.select(sa.func.min(todos.c.queue).label("queue")).cte("queues", recursive=True)
    later = todos.alias("later")
    following = sa.select(sa.func.min(later.c.queue)).where(later.c.queue > found.c.queue).scalar_subquery()
    # The last row is NULL (no queue above the last one): callers skip it.
    return found.union_all(sa.select(following).where(found.c.queue.isnot(None)))


@dataclass(frozen=True, slots=True, kw_only=True)
class TodoQuery:
    """Which todos a list shows (``None``: any), and the page: at most
    ``limit``, with an id below ``before_id``."""

    queue: str | None = None
    status: str | None = None
    limit: int = 50
    before_id: int | None = None


async def list_todos(conn: AsyncConnection, wanted: TodoQuery = TodoQuery()) -> list[TodoRow]:
    """Todos, newest (highest id) first; ``before_id``: only those with a
    lower id (the next page, keyset: no OFFSET walks the pages before it).

    Each page reads about ``limit`` rows however many the history holds
    (issue 45, tests/integration/processes/test_flat_in_history.py): with a
    queue and a status, ``ix_todos_queue_status_id`` backwards; with
    neither, the primary key backwards; with only one of them, that walk
    once per queue (found by a loose scan) or per status, merged. A filter
    on the primary key alone found rare rows (the failed ones among months
    of done) only after reading every newer todo."""
    queue, status, limit, before_id = wanted.queue, wanted.status, wanted.limit, wanted.before_id
    columns = _columns()
    newer_than_page = [todos.c.id < before_id] if before_id is not None else []
    # With the queue and status fixed, ordering by them too is the same
    # order, and the index's own: no plan that sorts or filters is cheaper.
    in_index_order = (todos.c.queue.desc(), todos.c.status.desc(), todos.c.id.desc())
    if queue is None and status is None:
        query = sa.select(*columns).where(*newer_than_page).order_by(todos.c.id.desc()).limit(limit)
        return [_todo_row(row) for row in await conn.execute(query)]
    if queue is not None and status is not None:
        where = [todos.c.queue == queue, todos.c.status == status, *newer_than_page]
        query = sa.select(*columns).where(*where).order_by(*in_index_order).limit(limit)
        return [_todo_row(row) for row in await conn.execute(query)]
    if status is not None:
        queues = distinct_queues()
        walks: Any = sa.select(queues.c.queue).where(queues.c.queue.isnot(None)).subquery("walks")
        own = [todos.c.queue == walks.c.queue, todos.c.status == status]
    else:
        walks = sa.values(sa.column("status", sa.Text), name="walks").data([(s,) for s in TODO_STATUSES])
        own = [todos.c.queue == queue, todos.c.status == walks.c.status]
    walk = (
        sa.select(*columns)
        .where(*own, *newer_than_page)
        .order_by(*in_index_order)
        .limit(limit)
        .lateral("walk")
    )
    merged = sa.select(walk).select_from(walks).join(walk, sa.true()).order_by(walk.c.id.desc()).limit(limit)
    return [_todo_row(row) for row in await conn.execute(merged)]


async def get_todo(conn: AsyncConnection, todo_id: int) -> TodoDetail | None:
    row = (
        await conn.execute(
            sa.select(
                *_columns(),
                todos.c.payload,
                # traceparent is version-traceid-parentid-flags (backhalf.tracing)
                sa.func.split_part(todos.c.trace_context["traceparent"].astext, "-", 2).label("trace_id"),
            ).where(todos.c.id == todo_id)
        )
    ).first()
    if row is None:
        return None
    error = None if row.last_error is None else redact(row.last_error)
    return TodoDetail(**{**row._mapping, "trace_id": row.trace_id or None, "last_error": error})


async def history(conn: AsyncConnection, todo_id: int) -> list[TodoEvent]:
    """The todo's ``todo_events`` rows, oldest first (id breaks ties: rows
    written in one transaction share its ``now()``)."""
    rows = await conn.execute(
        sa.select(
            todo_events.c.created_at,
            todo_events.c.from_status,
            todo_events.c.to_status,
            todo_events.c.detail,
        )
        .where(todo_events.c.todo_id == todo_id)
        .order_by(todo_events.c.created_at, todo_events.c.id)
    )
    return [TodoEvent(*row) for row in rows]


async def lock_todo(conn: AsyncConnection, todo_id: int) -> TodoRow | None:
    """The todo's state, its row locked until the caller's transaction ends,
    so the action that follows sees the same status. Asked again (in a
    savepoint) when the todo finished meanwhile and so moved to another
    partition (``backhalf.lifecycle.todos.MOVED_TRIES``, decision 0007)."""
    statement = sa.select(*_columns()).where(todos.c.id == todo_id).with_for_update()
    for tried in range(1, MOVED_TRIES + 1):
        try:
            async with conn.begin_nested():
                row = (await conn.execute(statement)).first()
            return None if row is None else TodoRow(*row)
        except DBAPIError as exc:
            if not isinstance(exc.orig, psycopg.errors.SerializationFailure) or tried == MOVED_TRIES:
                raise
    raise AssertionError("unreachable")


async def active_holder(conn: AsyncConnection, queue: str, key: str, *, other_than: int) -> TodoRow | None:
    """The active todo (pending, dispatched, running) other than ``other_than``
    that holds (queue, key) in ``uq_todos_queue_key_active``, if any: while it
    exists, the other todo cannot be made active again."""
    row = (
        await conn.execute(
            sa.select(*_columns())
            .where(
                todos.c.queue == queue,
                todos.c.idempotency_key == key,
                TODO_ACTIVE_PREDICATE,
                todos.c.id != other_than,
            )
            .limit(1)
        )
    ).first()
    return None if row is None else TodoRow(*row)


# A todo that may be waiting for a worker (one running or finished is not).
WAITING_STATUSES = ("pending", "dispatched")
# A worker process that claims: alive (a stuck or failing one does not, as the console judges it too).
_SERVING = ("alive",)


def waiting_reason(todo: TodoDetail, processes: Sequence[ProcessRow], now: datetime) -> str | None:
    """Why a pending todo has not run yet, in a few words (None: it is not
    waiting). Read from what the workers' heartbeats say they serve
    (``detail.queues``) and the todo's own ``run_after``."""
    if todo.status not in WAITING_STATUSES:
        return None
    if todo.run_after > now:
        wait_s = (todo.run_after - now).total_seconds()
        return f"waits for its retry's backoff: claimable in {wait_s:.0f} s"
    serving = [
        p
        for p in processes
        if p.role == "worker" and p.state in _SERVING and todo.queue in (p.detail.get("queues") or ())
    ]
    if not serving:
        return (
            f"no live worker serves queue {todo.queue}: start `switchboard worker`"
            f" (with --queues {todo.queue}, if it names queues)"
        )
    return (
        f"claimable now: {len(serving)} live worker process(es) serve queue {todo.queue},"
        " every thread busy or about to claim"
    )
