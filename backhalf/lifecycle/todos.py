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

import contextlib
import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
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
    todo_id = int(result.scalar_one())
    await conn.exec_driver_sql(queries.NOTIFY_WORKERS, {"channel": queries.TODO_CHANNEL, "queues": [queue]})
    return todo_id


async def delete_created(cur: psycopg.AsyncCursor[Any], todo_ids: Sequence[int]) -> None:
    """Delete todos a store created, with their log rows, in its transaction."""
    await cur.execute(queries.DELETE_TODOS, {"ids": list(todo_ids)})


# -- the lifecycle: workers, rescuer, operators --------------------------------

CLAIMED = "claimed"
LEASE_EXPIRED_ERROR = "lease expired: the worker running it stopped (killed, or cut off)"
RESCUED_LEASE = "rescued: its lease expired"
GIVEN_BACK = "given back unrun: the worker stopped with it claimed"


@dataclass(frozen=True, slots=True)
class Todo:
    """What a handler is called with (a contract: docs/workers.md, DESIGN.md section 7)."""

    id: int
    queue: str
    payload: Any  # the decoded JSON
    idempotency_key: str
    attempt: int  # 1 for the first run


@dataclass(frozen=True, slots=True)
class Claimed:
    """A todo a worker claimed: what its handler is called with, and the
    run's token (``todos.run_token``), which only this run holds: the guard
    of its end and of its lease's extensions."""

    todo: Todo
    token: uuid.UUID
    # Its message's trace context (JSON text, backhalf.tracing): its run's parent.
    trace_context: str | None = None


# A todo that finishes moves from todos_live to a partition of todos_done
# (decision 0007). A statement locking it after that commit, with a snapshot
# taken before, gets a serialization failure (SQLSTATE 40001) where it would
# have read the row's new version: asked again at once, in a new snapshot,
# it no longer sees the row where it was.
MOVED_TRIES = 3


def _fetch_retrying_moved(pg: psycopg.Connection[Any], statement: str, params: dict[str, Any]) -> list[Any]:
    """One statement in its own transaction (or savepoint), its rows; asked
    again when a row it locks moved to another partition meanwhile."""
    for tried in range(1, MOVED_TRIES + 1):
        block = contextlib.nullcontext() if pg.autocommit else pg.transaction()
        try:
            with block, pg.cursor() as cur:
                cur.execute(statement, params)
                return cur.fetchall()
        except psycopg.errors.SerializationFailure:
            if tried == MOVED_TRIES:
                raise
    raise AssertionError("unreachable")


def by_id_session(pg: psycopg.Connection[Any]) -> None:
    """A worker connection's set-up (the claimer's, the state writer's, the
    lease keeper's): its statements reach todos_live's rows by id, each
    planned against the table as it is now, never by a sequential scan
    (queries.sql, by_id_session: a plan kept from a quiet moment read every
    live todo per statement once a backlog had grown)."""
    pg.execute(queries.BY_ID_SESSION)


def claim(
    pg: psycopg.Connection[Any],
    queues: Sequence[str],
    limit: int,
    lease_s: float,
    *,
    per_queue: Sequence[int] | None = None,
) -> list[Claimed]:
    """Claim up to ``limit`` due todos of ``queues`` (walked in that order,
    each up to its ``per_queue`` limit, ``limit`` by default), committed on
    return (``claim_todos``: one statement; its own transaction on an
    autocommit connection): running, attempt counted, leased."""
    limits = [limit] * len(queues) if per_queue is None else [min(limit, n) for n in per_queue]
    params = {"queues": list(queues), "limits": limits, "limit": limit, "lease_s": float(lease_s),
              "detail": CLAIMED}  # fmt: skip
    rows = _fetch_retrying_moved(pg, queries.CLAIM_TODOS, params)
    return [
        Claimed(Todo(int(tid), str(queue), json.loads(payload), str(key), int(attempts)), token, context)
        for tid, queue, payload, key, attempts, token, context in rows
    ]


async def rescue(
    cur: psycopg.AsyncCursor[Any], queues: Sequence[tuple[str, int]], limit: int
) -> list[tuple[int, str, str]]:
    """Todos of ``queues`` (name, max_attempts) whose lease lapsed, moved back
    to pending (or failed, their attempts spent), in the caller's
    transaction: (id, queue, new status). The broker acks waiting for those
    that failed are released, and the workers of those pending again woken,
    on commit."""
    await cur.execute(
        queries.RESCUE_TODOS,
        {
            "queues": [q for q, _ in queues],
            "max_attempts": [m for _, m in queues],
            "limit": limit,
            "lease_error": LEASE_EXPIRED_ERROR,
            "lease_detail": RESCUED_LEASE,
        },
    )
    moved = [(int(i), str(q), str(s)) for i, q, s in await cur.fetchall()]
    await release_acks(cur, [i for i, _, status in moved if status in TERMINAL])
    await notify_workers(cur, [q for _, q, status in moved if status == "pending"])
    return moved


async def notify_workers(cur: psycopg.AsyncCursor[Any], queues: Sequence[str]) -> None:
    """Wake the workers of ``queues`` when the caller's transaction commits."""
    if queues:
        await cur.execute(queries.NOTIFY_WORKERS, {"channel": queries.TODO_CHANNEL, "queues": list(queues)})


TERMINAL = frozenset({"done", "failed", "cancelled"})
# end_runs' answers: an end that held its todo; one whose row another
# transaction held (it did not wait).
ENDED = "ended"
BUSY = "busy"


async def release_acks(cur: psycopg.AsyncCursor[Any], ids: Sequence[int]) -> None:
    """The broker acks waiting for these todos (``ack_after = "complete"``)
    are owed now: call in the transaction that ended them, after the
    statement that did (``release_acks`` in queries.sql says why)."""
    if ids:
        await cur.execute(queries.RELEASE_ACKS, {"ids": list(ids), "channel": queries.ACK_CHANNEL})


@dataclass(frozen=True, slots=True)
class Ending:
    """One run's end, as :func:`end_runs` takes it."""

    run: Claimed
    to_status: str  # done, failed, or pending (a retry after ``delay_s``, or given back unrun)
    error: str | None
    detail: str
    # A claim given back before its handler ran (the worker stopping with
    # it claimed): pending and due now, its attempt not counted.
    unrun: bool = False
    delay_s: float = 0.0  # a retry's backoff


async def release_orphaned_acks(cur: psycopg.AsyncCursor[Any], limit: int) -> int:
    """Acks still waiting for a todo that ended (``release_orphaned_acks``):
    owed now; how many."""
    await cur.execute(queries.RELEASE_ORPHANED_ACKS, {"limit": limit, "channel": queries.ACK_CHANNEL})
    row = await cur.fetchone()
    return int(row[0]) if row else 0


def end_runs(
    pg: psycopg.Connection[Any], endings: Sequence[Ending], *, release: bool = True
) -> tuple[set[int], set[int]]:
    """Runs ended, committed on return, every todo distinct, in one statement
    (``end_runs``); then, if ``release`` and a run ended terminal, the
    broker acks waiting for those todos (``release_acks``: a statement of
    its own after it, in the same transaction); and where a claim was given
    back, the workers woken. Without either the statement is the whole
    transaction: one round trip, on a connection in autocommit mode (the
    state writer's) or not.

    Returns the todos whose run still held them when it ended (the others
    were cancelled, or rescued and claimed again: their results are
    discarded), and the ends whose row another transaction held (not made,
    not waited for)."""
    ids = [e.run.todo.id for e in endings]
    terminal = [i for i, e in zip(ids, endings, strict=True) if e.to_status in TERMINAL]
    given_back = sorted({e.run.todo.queue for e in endings if e.unrun})
    params = {
        "ids": ids,
        "tokens": [e.run.token for e in endings],
        "to_status": [e.to_status for e in endings],
        "errors": [e.error for e in endings],
        "details": [e.detail for e in endings],
        "unrun": [e.unrun for e in endings],
        "delay_s": [float(e.delay_s) for e in endings],
    }
    releasing = release and bool(terminal)
    # One statement alone on an autocommit connection commits by itself; a
    # BEGIN and a COMMIT would be two more round trips.
    several = releasing or bool(given_back)
    block = pg.transaction() if several or not pg.autocommit else contextlib.nullcontext()
    with block, pg.cursor() as cur:
        # Prepared (parsed once); planned at each batch on the writer's connection (by_id_session).
        cur.execute(queries.END_RUNS, params, prepare=True)
        rows = cur.fetchall()
        if releasing:
            cur.execute(queries.RELEASE_ACKS, {"ids": terminal, "channel": queries.ACK_CHANNEL})
        if given_back:
            cur.execute(queries.NOTIFY_WORKERS, {"channel": queries.TODO_CHANNEL, "queues": given_back})
    held = {int(tid) for tid, found in rows if found == ENDED}
    busy = {int(tid) for tid, found in rows if found == BUSY}
    return held, busy


def extend_leases(
    pg: psycopg.Connection[Any], runs: Sequence[Claimed], lease_s: float
) -> dict[tuple[int, uuid.UUID], bool | None]:
    """Each run's lease again from now, ``lease_s`` seconds (``extend_leases``),
    by run (todo id, token): True if extended, False if the run no longer
    holds its todo, None if another transaction held the row (not waited
    for). One statement; its own transaction on an autocommit connection."""
    params = {"ids": [r.todo.id for r in runs], "tokens": [r.token for r in runs], "lease_s": float(lease_s)}
    answers = {"extended": True, "lost": False, "busy": None}
    rows = _fetch_retrying_moved(pg, queries.EXTEND_LEASES, params)
    return {(int(i), token): answers[str(found)] for i, token, found in rows}


async def cancel(conn: AsyncConnection, ids: Sequence[int], detail: str) -> list[int]:
    result = await conn.exec_driver_sql(queries.CANCEL_TODOS, {"ids": list(ids), "detail": detail})
    cancelled = sorted(int(i) for (i,) in result.all())
    if cancelled:
        await conn.exec_driver_sql(queries.RELEASE_ACKS, {"ids": cancelled, "channel": queries.ACK_CHANNEL})
    return cancelled


async def retry(conn: AsyncConnection, ids: Sequence[int], detail: str) -> list[int]:
    """Failed or cancelled todos pending again, the workers woken on commit."""
    result = await conn.exec_driver_sql(queries.RETRY_TODOS, {"ids": list(ids), "detail": detail})
    found: list[Any] = list(result.all())
    rows = [(int(tid), str(queue)) for tid, queue in found]
    if rows:
        queues = sorted({q for _, q in rows})
        await conn.exec_driver_sql(
            queries.NOTIFY_WORKERS, {"channel": queries.TODO_CHANNEL, "queues": queues}
        )
    return sorted(i for i, _ in rows)
