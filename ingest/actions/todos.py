"""Retry and cancel one todo (``switchboard todos retry / cancel``), and
the todos as every front end reads them (``todos list / show``, the
console's todo pages): the same rows, the same reason to wait.

Each call is its own transaction: the todo's row is locked, its status
checked (and for a retry, that no other active todo holds its (queue, key)),
then the change and its ``todo_events`` row are written
(:mod:`backhalf.lifecycle.todos`). A refusal rolls the transaction back.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

import psycopg
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from backhalf.housekeeping import heartbeats
from backhalf.lifecycle import todos
from backhalf.reads import todo_views
from ingest.actions.outcomes import Refused
from schema import ACTIVE_TODO_STATUSES

# ``todo_events.detail`` of an operator's change.
RETRIED_BY_OPERATOR = "retried by an operator"
CANCELLED_BY_OPERATOR = "cancelled by an operator"

# What ``retry_todos`` takes back to pending (its SQL says the same).
RETRYABLE_STATUSES = ("failed", "cancelled")
# The partial unique index that allows one active todo per (queue, key).
ACTIVE_KEY_INDEX = "uq_todos_queue_key_active"


@dataclass(frozen=True, slots=True)
class Retried:
    """The todo is pending again, its attempts reset to 0."""

    todo_id: int
    was: str  # its status before: failed or cancelled


@dataclass(frozen=True, slots=True)
class Cancelled:
    """The todo is cancelled; if it ``was`` running, its handler finishes and
    its result is discarded."""

    todo_id: int
    was: str  # its status before: pending, dispatched or running


class _Refusal(Exception):
    """Leaves the transaction (rolling it back) with the reason."""


class _KeyTaken(Exception):
    """The retry's UPDATE broke the one-active-todo-per-key index."""

    def __init__(self, state: todo_views.TodoRow) -> None:
        super().__init__(state.id)
        self.state = state


async def retry(engine: AsyncEngine, todo_id: int) -> Retried | Refused:
    """Make a failed or cancelled todo pending again, attempts reset."""
    try:
        state = await _changed(engine, todo_id, _retry_locked)
    except _KeyTaken as taken:
        return await _lost_the_key(engine, taken.state)
    return state if isinstance(state, Refused) else Retried(todo_id, was=state.status)


async def _changed(
    engine: AsyncEngine,
    todo_id: int,
    change: Callable[[AsyncConnection, int], Awaitable[todo_views.TodoRow]],
) -> todo_views.TodoRow | Refused:
    """``change`` in a transaction of its own: the todo's state before the
    change, or the refusal it raised. Any other exception (a retry's
    ``_KeyTaken``) rolls the transaction back and propagates."""
    try:
        async with engine.begin() as conn:
            return await change(conn, todo_id)
    except _Refusal as refusal:
        return Refused(str(refusal))


async def _retry_locked(conn: AsyncConnection, todo_id: int) -> todo_views.TodoRow:
    """The retry inside its transaction; the todo's state before it."""
    state = await _locked(
        conn, todo_id, RETRYABLE_STATUSES, "not failed or cancelled: only those can be retried"
    )
    holder = await todo_views.active_holder(conn, state.queue, state.idempotency_key, other_than=todo_id)
    if holder is not None:
        raise _Refusal(_held_by(state, holder))
    try:
        retried = await todos.retry(conn, [todo_id], RETRIED_BY_OPERATOR)
    except IntegrityError as exc:
        if not _violates_active_key(exc):
            raise
        raise _KeyTaken(state) from exc
    if retried != [todo_id]:  # not expected: its row is locked since the check
        raise _Refusal(f"todo {todo_id} was not retried (its status changed meanwhile)")
    return state


async def _locked(
    conn: AsyncConnection, todo_id: int, allowed: tuple[str, ...], refused: str
) -> todo_views.TodoRow:
    """The todo's row locked, its state read under the lock; refused (``todo
    N is STATUS, <refused>``) when its status is not one ``allowed``."""
    state = await todo_views.lock_todo(conn, todo_id)
    if state is None:
        raise _Refusal(f"todo {todo_id} does not exist")
    if state.status not in allowed:
        raise _Refusal(f"todo {todo_id} is {state.status}, {refused}")
    return state


async def _lost_the_key(engine: AsyncEngine, state: todo_views.TodoRow) -> Refused:
    """An active todo with the same key was committed between the check and
    the UPDATE (the store creating one for a redelivery): the transaction was
    rolled back; say who holds the key now."""
    async with engine.begin() as conn:
        holder = await todo_views.active_holder(conn, state.queue, state.idempotency_key, other_than=state.id)
    if holder is None:
        return Refused(
            f"todo {state.id} was not retried: another todo with queue {state.queue!r} and key"
            f" {state.idempotency_key!r} was active at that moment; try again"
        )
    return Refused(_held_by(state, holder))


def _held_by(state: todo_views.TodoRow, holder: todo_views.TodoRow) -> str:
    return (
        f"todo {state.id} was not retried: todo {holder.id} ({holder.status}) is the active todo of"
        f" queue {state.queue!r} and key {state.idempotency_key!r}, and a key has one active todo at"
        f" a time (cancel todo {holder.id}, or let it finish, first)"
    )


def _violates_active_key(exc: IntegrityError) -> bool:
    orig = exc.orig
    return isinstance(orig, psycopg.errors.UniqueViolation) and orig.diag.constraint_name == ACTIVE_KEY_INDEX


async def cancel(engine: AsyncEngine, todo_id: int) -> Cancelled | Refused:
    """Cancel a pending, dispatched or running todo."""
    state = await _changed(engine, todo_id, _cancel_locked)
    return state if isinstance(state, Refused) else Cancelled(todo_id, was=state.status)


async def _cancel_locked(conn: AsyncConnection, todo_id: int) -> todo_views.TodoRow:
    """The cancel inside its transaction; the todo's state before it."""
    state = await _locked(
        conn,
        todo_id,
        ACTIVE_TODO_STATUSES,
        "already finished: only pending, dispatched or running todos can be cancelled",
    )
    cancelled = await todos.cancel(conn, [todo_id], CANCELLED_BY_OPERATOR)
    if cancelled != [todo_id]:  # not expected: its row is locked since the check
        raise _Refusal(f"todo {todo_id} was not cancelled (its status changed meanwhile)")
    return state


# -- reads ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Shown:
    """One todo whole: its row, its history (oldest first), and why it has
    not run yet (None: it is not waiting)."""

    todo: todo_views.TodoDetail
    history: tuple[todo_views.TodoEvent, ...]
    waiting: str | None


async def listed(engine: AsyncEngine, wanted: todo_views.TodoQuery) -> list[todo_views.TodoRow]:
    """Todos, newest first, at most ``wanted.limit``; ``wanted.before_id``: the next page."""
    async with engine.connect() as conn:
        return await todo_views.list_todos(conn, wanted)


async def show(engine: AsyncEngine, todo_id: int) -> Shown | None:
    """The todo, None if it does not exist."""
    async with engine.connect() as conn:
        todo = await todo_views.get_todo(conn, todo_id)
        if todo is None:
            return None
        history = await todo_views.history(conn, todo_id)
        (waiting,) = await why_waiting(conn, [todo])
    return Shown(todo, tuple(history), waiting)


async def why_waiting(
    conn: AsyncConnection, found: Sequence[todo_views.TodoDetail | None]
) -> tuple[str | None, ...]:
    """Why each pending todo of ``found`` has not run yet, from what the live
    workers' heartbeats say they serve; None for the others."""
    waits = [t is not None and t.status in todo_views.WAITING_STATUSES for t in found]
    if not any(waits):
        return (None,) * len(found)
    processes = await heartbeats.list_processes(conn)
    now = datetime.now(UTC)
    return tuple(
        todo_views.waiting_reason(t, processes, now) if t is not None and w else None
        for t, w in zip(found, waits, strict=True)
    )
