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
from datetime import datetime
from typing import Any, NamedTuple

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
    """What a handler is called with (a contract: docs/workers.md, DESIGN.md section 7)."""

    id: int
    queue: str
    payload: Any  # the decoded JSON
    idempotency_key: str
    attempt: int  # 1 for the first run


@dataclass(frozen=True, slots=True)
class Started:
    """``start``'s answer: the todo to run, or why there is none."""

    todo: Todo | None
    found: str | None  # the status it had (None: no such todo; BUSY: its row was held)
    # The run's token (todos.run_token), which only this run holds: its
    # end's guard. The lease it set, for the log.
    token: uuid.UUID | None = None
    lease_until: datetime | None = None


async def claim_pending(
    cur: psycopg.AsyncCursor[Any], queues: Sequence[str], limit: int
) -> list[tuple[int, str]]:
    """Pending todos of ``queues``, up to ``limit`` of each, oldest first,
    locked until the caller's transaction ends."""
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
# write_states' answers beside a todo's status: an end that held its todo;
# a start whose row another transaction holds (it did not wait); a start
# naming a todo of another queue (its message is refused, never run).
ENDED = "ended"
BUSY = "busy"
FOREIGN = "foreign"


async def release_acks(cur: psycopg.AsyncCursor[Any], ids: Sequence[int]) -> None:
    """The broker acks waiting for these todos (``ack_after = "complete"``)
    are owed now: call in the transaction that ended them, after the
    statement that did (``release_acks`` in queries.sql says why)."""
    if ids:
        await cur.execute(queries.RELEASE_ACKS, {"ids": list(ids), "channel": queries.ACK_CHANNEL})


class StartRequest(NamedTuple):
    """One start, as :func:`write_states` takes it: the todo, the queue whose
    actor received its message (a todo of another queue is not started),
    the run's token, the lease and the queue's attempts."""

    todo_id: int
    queue: str
    token: uuid.UUID
    lease_s: float
    max_attempts: int


@dataclass(frozen=True, slots=True)
class Ending:
    """One run's end, as :func:`write_states` takes it."""

    run: Started
    to_status: str  # done, failed, or dispatched (for a retry, or given back unrun)
    error: str | None
    detail: str
    # A claim given back before its handler ran (the worker stopping with
    # it fetched): dispatched again, its attempt not counted.
    unrun: bool = False


async def release_orphaned_acks(cur: psycopg.AsyncCursor[Any], limit: int) -> int:
    """Acks still waiting for a todo that ended (``release_orphaned_acks``):
    owed now; how many."""
    await cur.execute(queries.RELEASE_ORPHANED_ACKS, {"limit": limit, "channel": queries.ACK_CHANNEL})
    row = await cur.fetchone()
    return int(row[0]) if row else 0


def write_states(
    pg: psycopg.Connection[Any],
    endings: Sequence[Ending],
    starts: Sequence[StartRequest],
    *,
    release: bool = True,
) -> tuple[set[int], set[int], list[Started]]:
    """Workers' state changes, committed on return: runs ended and todos
    started (:class:`StartRequest`), every id
    distinct, in one statement (``write_states``); then, if ``release`` and
    a run ended, the broker acks waiting for the todos that ended
    (``release_acks``: a statement of its own after it, in the same
    transaction). Without a release the statement is the whole transaction:
    one round trip, on a connection in autocommit mode (the state writer's)
    or not. A change whose row another transaction holds is not made (and
    not waited for): the end is in the second set returned, the start
    answered ``found = BUSY``.

    Returns the todos whose run still held them when it ended (the others
    were cancelled, or rescued or retried and started again: their results
    are discarded), the ends found busy, and one answer per start, in order."""
    ids = [e.run.todo.id for e in endings if e.run.todo is not None]
    assert len(ids) == len(endings), "only a started run can end"
    terminal = [i for i, e in zip(ids, endings, strict=True) if e.to_status in TERMINAL]
    params = {
        "end_ids": ids,
        "end_tokens": [e.run.token for e in endings],
        "to_status": [e.to_status for e in endings],
        "errors": [e.error for e in endings],
        "details": [e.detail for e in endings],
        "unrun": [e.unrun for e in endings],
        "start_ids": [s.todo_id for s in starts],
        "start_queues": [s.queue for s in starts],
        "start_tokens": [s.token for s in starts],
        "lease_s": [float(s.lease_s) for s in starts],
        "max_attempts": [s.max_attempts for s in starts],
        "start_detail": STARTED,
        "foreign": FOREIGN,
    }
    releasing = release and bool(terminal)
    # One statement alone on an autocommit connection commits by itself; a
    # BEGIN and a COMMIT would be two more round trips.
    block = pg.transaction() if releasing or not pg.autocommit else contextlib.nullcontext()
    with block, pg.cursor() as cur:
        cur.execute(queries.WRITE_STATES, params, prepare=True)  # one plan, kept (state_writer)
        rows = cur.fetchall()
        if releasing:
            cur.execute(queries.RELEASE_ACKS, {"ids": terminal, "channel": queries.ACK_CHANNEL})
    held: set[int] = set()
    busy: set[int] = set()
    answers: dict[int, Started] = {}
    end_ids = set(ids)  # distinct from the starts' (the writer's rule)
    tokens = {s.todo_id: s.token for s in starts}
    for tid, queue, payload, key, attempts, lease_until, found in rows:
        if int(tid) in end_ids:
            (held if found == ENDED else busy).add(int(tid))
        elif queue is None:
            answers[int(tid)] = Started(None, found)
        else:
            todo = Todo(int(tid), str(queue), json.loads(payload), str(key), int(attempts))
            answers[int(tid)] = Started(todo, found, tokens[int(tid)], lease_until)
    return held, busy, [answers[s.todo_id] for s in starts]


def extend_leases(
    pg: psycopg.Connection[Any], runs: Sequence[tuple[Started, float]]
) -> dict[int, bool | None]:
    """Each run's lease again from now, ``lease_s`` seconds (``extend_leases``),
    by todo: True if extended, False if the run no longer holds its todo,
    None if another transaction held the row (not waited for). One
    statement; its own transaction on an autocommit connection."""
    held = [(r.todo.id, r.token, float(s)) for r, s in runs if r.todo is not None and r.token is not None]
    params = {"ids": [h[0] for h in held], "tokens": [h[1] for h in held], "lease_s": [h[2] for h in held]}
    block = contextlib.nullcontext() if pg.autocommit else pg.transaction()
    with block, pg.cursor() as cur:
        cur.execute(queries.EXTEND_LEASES, params)
        answers = {"extended": True, "lost": False, "busy": None}
        return {int(i): answers[str(found)] for i, found in cur.fetchall()}


def start(
    pg: psycopg.Connection[Any], todo_id: int, lease_s: float, max_attempts: int, *, queue: str
) -> Started:
    """One worker's claim of its todo of ``queue``, committed (:func:`write_states` of one)."""
    request = StartRequest(todo_id, queue, uuid.uuid4(), lease_s, max_attempts)
    _, _, (started,) = write_states(pg, [], [request])
    return started


def end_run(
    pg: psycopg.Connection[Any], run: Started, to_status: str, *, error: str | None, detail: str
) -> bool:
    """End one run, committed (:func:`write_states` of one); False if it no
    longer holds its todo."""
    assert run.todo is not None
    held, _, _ = write_states(pg, [Ending(run, to_status, error, detail)], [])
    return run.todo.id in held


async def cancel(conn: AsyncConnection, ids: Sequence[int], detail: str) -> list[int]:
    result = await conn.exec_driver_sql(queries.CANCEL_TODOS, {"ids": list(ids), "detail": detail})
    cancelled = sorted(int(i) for (i,) in result.all())
    if cancelled:
        await conn.exec_driver_sql(queries.RELEASE_ACKS, {"ids": cancelled, "channel": queries.ACK_CHANNEL})
    return cancelled


async def retry(conn: AsyncConnection, ids: Sequence[int], detail: str) -> list[int]:
    result = await conn.exec_driver_sql(queries.RETRY_TODOS, {"ids": list(ids), "detail": detail})
    return sorted(int(i) for (i,) in result.all())
