"""Writes to ``todos`` and ``todo_events``: every one is defined here.

A todo is created in one way only, the ``todos_create_cte`` block of
``queries.sql``: insert it, or dedup to the active todo with the same
(queue, key) (``uq_todos_queue_key_active``), and log a created todo's
'pending' row in ``todo_events`` in the same statement. The store embeds the
block in its one-round-trip write, with :func:`creating`'s parameters; inbox
replay runs it alone through :func:`create`. The store's undo of todos it
created for messages stored already is :func:`delete_created`. The workers'
state transitions (each with its ``todo_events`` row, in the same
transaction) belong here too.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
from sqlalchemy.ext.asyncio import AsyncConnection

from backhalf import queries

# ``todo_events.detail`` of a todo's 'pending' row: who created it.
CREATED_BY_STORE = "created"
CREATED_BY_REPLAY = "created by replay"


def creating(queue: str, detail: str) -> dict[str, str]:
    """The parameters of ``todos_create_cte``, in every statement that embeds it."""
    return {"queue": queue, "todo_detail": detail}


async def create(conn: AsyncConnection, *, queue: str, key: str, payload: str, detail: str) -> int:
    """Create one todo, or dedup to the active one with its key; return its id.

    ``payload`` is JSON text, cast in SQL (never re-encoded). Run through
    SQLAlchemy, in the caller's transaction, so a driver error surfaces as
    SQLAlchemy's, as the Core statements around it raise them.
    """
    result = await conn.exec_driver_sql(
        queries.CREATE_TODO, {"key": key, "payload": payload, **creating(queue, detail)}
    )
    return int(result.scalar_one())


async def delete_created(cur: psycopg.AsyncCursor[Any], todo_ids: Sequence[int]) -> None:
    """Delete todos a store created, with their log rows, in its transaction."""
    await cur.execute(queries.DELETE_TODOS, {"ids": list(todo_ids)})


# -- the lifecycle: relay, workers, rescuer, operators -------------------------

DISPATCHED_BY_RELAY = "dispatched"
STARTED = "started"
LEASE_EXPIRED_ERROR = "lease expired: the worker running it stopped (killed, or cut off)"
RESCUED_LEASE = "rescued: its lease expired"
RESCUED_STALE = "rescued: dispatched with no progress (its message was lost)"


@dataclass(frozen=True, slots=True)
class Todo:
    """What a handler is called with (a contract: README, DESIGN.md section 7)."""

    id: int
    queue: str
    payload: Any  # the decoded JSON
    idempotency_key: str
    attempt: int  # 1 for the first run


@dataclass(frozen=True, slots=True)
class Started:
    """``start``'s answer: the todo to run, or why there is none."""

    todo: Todo | None
    found: str | None  # the status it had (None: no such todo)
    # The lease this start set: the run's token, which only this run holds
    # (end_run's guard).
    lease_until: datetime | None = None


async def claim_pending(
    cur: psycopg.AsyncCursor[Any], queues: Sequence[str], limit: int
) -> list[tuple[int, str]]:
    """Pending todos of ``queues``, locked until the caller's transaction ends."""
    await cur.execute(queries.CLAIM_PENDING_TODOS, {"queues": list(queues), "limit": limit})
    return [(int(i), str(q)) for i, q in await cur.fetchall()]


async def mark_dispatched(cur: psycopg.AsyncCursor[Any], ids: Sequence[int], detail: str) -> int:
    await cur.execute(queries.MARK_DISPATCHED, {"ids": list(ids), "detail": detail})
    row = await cur.fetchone()
    return int(row[0]) if row else 0


async def rescue(
    cur: psycopg.AsyncCursor[Any],
    queues: Sequence[tuple[str, int, float]],
    limit: int,
) -> list[tuple[int, str, str]]:
    """Stuck todos of ``queues`` (name, max_attempts, stale seconds), moved to
    dispatched (or failed), locked until the caller's transaction ends:
    (id, queue, new status)."""
    await cur.execute(
        queries.RESCUE_TODOS,
        {
            "queues": [q for q, _, _ in queues],
            "max_attempts": [m for _, m, _ in queues],
            "stale_s": [s for _, _, s in queues],
            "limit": limit,
            "lease_error": LEASE_EXPIRED_ERROR,
            "lease_detail": RESCUED_LEASE,
            "stale_detail": RESCUED_STALE,
        },
    )
    moved = [(int(i), str(q), str(s)) for i, q, s in await cur.fetchall()]
    await release_acks(cur, [i for i, _, status in moved if status in TERMINAL])
    return moved


TERMINAL = frozenset({"done", "failed", "cancelled"})


async def release_acks(cur: psycopg.AsyncCursor[Any], ids: Sequence[int]) -> None:
    """The broker acks waiting for these todos (``ack_after = "complete"``)
    are owed now: call in the transaction that ended them, after the
    statement that did (``release_acks`` in queries.sql says why)."""
    if ids:
        await cur.execute(queries.RELEASE_ACKS, {"ids": list(ids), "channel": queries.ACK_CHANNEL})


def release_acks_sync(cur: psycopg.Cursor[Any], ids: Sequence[int]) -> None:
    """:func:`release_acks` for the workers' synchronous connections."""
    if ids:
        cur.execute(queries.RELEASE_ACKS, {"ids": list(ids), "channel": queries.ACK_CHANNEL})


def start(cur: psycopg.Cursor[Any], todo_id: int, lease_s: float, max_attempts: int) -> Started:
    """A worker's claim of its todo (sync: dramatiq's worker threads)."""
    params = {"id": todo_id, "lease_s": lease_s, "max_attempts": max_attempts, "detail": STARTED}
    cur.execute(queries.START_TODO, params)
    row = cur.fetchone()
    assert row is not None  # the statement returns one row whatever it finds
    tid, queue, payload, key, attempts, lease_until, _from, found = row
    if tid is None:
        return Started(None, found)
    todo = Todo(int(tid), str(queue), json.loads(payload), str(key), int(attempts))
    return Started(todo, found, lease_until)


def end_run(
    cur: psycopg.Cursor[Any], run: Started, to_status: str, *, error: str | None, detail: str
) -> bool:
    """End a run (done, failed, or dispatched for a retry); False if it no
    longer holds its todo (cancelled, or rescued or retried and started again)."""
    assert run.todo is not None
    params = {"id": run.todo.id, "lease_until": run.lease_until, "to_status": to_status}
    cur.execute(queries.END_RUN, {**params, "error": error, "detail": detail})
    row = cur.fetchone()
    held = bool(row and row[0])
    if held and to_status in TERMINAL:
        release_acks_sync(cur, [run.todo.id])
    return held


async def cancel(conn: AsyncConnection, ids: Sequence[int], detail: str) -> list[int]:
    result = await conn.exec_driver_sql(queries.CANCEL_TODOS, {"ids": list(ids), "detail": detail})
    cancelled = sorted(int(i) for (i,) in result.all())
    if cancelled:
        await conn.exec_driver_sql(queries.RELEASE_ACKS, {"ids": cancelled, "channel": queries.ACK_CHANNEL})
    return cancelled


async def retry(conn: AsyncConnection, ids: Sequence[int], detail: str) -> list[int]:
    result = await conn.exec_driver_sql(queries.RETRY_TODOS, {"ids": list(ids), "detail": detail})
    return sorted(int(i) for (i,) in result.all())
