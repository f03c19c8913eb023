"""What the hot paths read does not grow with the history (issue 45).

The same work is done twice on one database: first with 10,000 finished
messages retained (every row the pipeline leaves for a done todo,
``ingest.embedded.history``), then with 100,000. The work: a real ingester
and acker storing and acking a stream's new entries (the store, the acker's
cursor and claims, the gauges), the workers' claims and ends, the rescuer,
and the console's and the CLI's reads (todo pages by status, the trace of
one message, the overview's attention reads and per-minute figures, the
rejected rows). For each, the buffers PostgreSQL touched in the four
history tables (heap, indexes, TOAST: ``pg_statio_user_tables``, counted over
every backend, autovacuum off) must be about the same both times. A plan
that starts reading retained rows touches thousands of buffers more at ten
times the history, and fails here; an index one level deeper costs a
buffer per probe, which the margin allows. Buffers, not seconds: the check
does not depend on the machine's speed.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import psycopg
import redis
from psycopg import sql
from sqlalchemy.ext.asyncio import AsyncConnection

from backhalf.db import DatabaseSettings, create_engine
from backhalf.lifecycle import todos
from backhalf.reads import attention_views, console_views, inbox_views, todo_views, trace
from ingest.embedded import history
from tests.support.db import libpq
from tests.support.in_process import pipeline, settings, wait_until

SMALL = 10_000
LARGE = 100_000
MESSAGES = 400
TABLES = ("inbox", "events", "todos", "todo_events")
STREAM = QUEUE = ADAPTER = "orders"
# Buffers a read may touch beyond half again its first figure: an index one
# level deeper, a page of the visibility map. A walk over the retained rows
# touches hundreds to thousands more (the failed-todos page without a queue:
# 17 then 90 buffers, before migration 0014).
GRACE = 20

# By table, its partitions' counts together (a partitioned table has none of
# its own; todos' partitions are todos_live and todos_done's).
BLOCKS = """
SELECT substring(relname from '^(inbox|events|todos|todo_events)'),
       sum(coalesce(heap_blks_read, 0) + coalesce(heap_blks_hit, 0) + coalesce(idx_blks_read, 0)
           + coalesce(idx_blks_hit, 0) + coalesce(toast_blks_read, 0) + coalesce(toast_blks_hit, 0)
           + coalesce(tidx_blks_read, 0) + coalesce(tidx_blks_hit, 0))
FROM pg_statio_user_tables WHERE relname ~ '^(inbox|events|todo_events|todos_done)(_p[0-9]{6})?$'
                             OR relname IN ('todos_live', 'todos_done_late')
GROUP BY 1
"""


def _blocks(conn: psycopg.Connection[Any]) -> dict[str, int]:
    """Buffers touched so far in each history table, by every backend that
    has ended (an ended backend has flushed its counts) and by this one (its
    own, a VACUUM's, flushed now: left pending, they were flushed a second
    later, inside the next measurement)."""
    conn.execute("SELECT pg_stat_force_next_flush()")  # done as the statement ends, idle
    conn.execute("SELECT pg_stat_clear_snapshot()")
    return {str(name): int(n) for name, n in conn.execute(BLOCKS).fetchall()}


async def _others_gone(conn: psycopg.Connection[Any]) -> None:
    """Wait until no other backend is connected to this database: each has
    flushed its statistics on exit."""

    def none_left() -> bool:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
        ).fetchone()
        return row is not None and row[0] == 0

    await wait_until(none_left, timeout_s=20)


async def _measure(conn: psycopg.Connection[Any], work: Callable[[], Awaitable[None]]) -> int:
    await _others_gone(conn)
    before = _blocks(conn)
    await work()
    await _others_gone(conn)
    after = _blocks(conn)
    return sum(after[t] - before[t] for t in TABLES)


def _drained(r: redis.Redis) -> bool:
    groups = r.xinfo_groups(STREAM)  # none before the ingester makes it
    return bool(groups) and groups[0]["lag"] == 0 and groups[0]["pending"] == 0


async def _ingest_and_ack(db_url: str, redis_url: str) -> None:
    """A real ingester and acker store and ack MESSAGES new entries."""
    r = redis.Redis.from_url(redis_url, socket_timeout=10)
    for i in range(MESSAGES):
        r.xadd(STREAM, {"body": f'{{"order_id": "new-{uuid.uuid4().hex}", "n": {i}}}'})
    s = settings(db_url, redis_url, {"name": ADAPTER, "source": STREAM, "queue": QUEUE, "batch_size": 100,
                                     "block_ms": 100})  # fmt: skip
    async with pipeline(s):
        await wait_until(lambda: _drained(r), timeout_s=60)
        # The marks commit just after the XACKs.
        await asyncio.sleep(0)
    r.close()


def _work_todos(db_url: str) -> None:
    """Workers claim the new todos and end them; a few die holding theirs."""
    with psycopg.connect(libpq(db_url), autocommit=True) as pg:
        while claimed := todos.claim(pg, [QUEUE], 50, 30.0):
            endings = [todos.Ending(run=c, to_status="done", error=None, detail="ran") for c in claimed]
            todos.end_runs(pg, endings)
        pg.execute(
            "INSERT INTO todos (queue, idempotency_key, payload)"
            " SELECT %s, 'stuck-' || gen_random_uuid(), '{}' FROM generate_series(1, 20)",
            (QUEUE,),
        )
        todos.claim(pg, [QUEUE], 20, 0.001)  # leases that lapse at once: killed workers'


async def _rescue(db_url: str) -> None:
    async with await psycopg.AsyncConnection.connect(libpq(db_url)) as pg, pg.cursor() as cur:
        await asyncio.sleep(0.01)
        moved = await todos.rescue(cur, [(QUEUE, 5)], 100)
        assert len(moved) == 20
        await pg.commit()


def _read(db_url: str, read: Callable[[AsyncConnection], Awaitable[Any]]) -> Callable[[], Awaitable[None]]:
    """One of the console's and the CLI's reads, on an engine of its own."""

    async def run() -> None:
        engine = create_engine(DatabaseSettings(url=db_url))
        try:
            async with engine.connect() as conn:
                await read(conn)
        finally:
            await engine.dispose()

    return run


async def _newest(conn: AsyncConnection) -> todo_views.TodoRow:
    return (await todo_views.list_todos(conn, todo_views.TodoQuery(limit=1)))[0]


async def _trace_newest(conn: AsyncConnection) -> None:
    newest = await _newest(conn)
    await trace.trails(conn, await trace.inbox_ids_by_key(conn, newest.idempotency_key))
    await trace.trails(conn, await trace.inbox_ids_by_todo(conn, newest.id))


async def _show_newest(conn: AsyncConnection) -> None:
    newest = await _newest(conn)
    await todo_views.get_todo(conn, newest.id)
    await todo_views.history(conn, newest.id)


async def _next_page(conn: AsyncConnection) -> None:
    page = await todo_views.list_todos(conn, todo_views.TodoQuery(limit=50))
    await todo_views.list_todos(conn, todo_views.TodoQuery(limit=50, before_id=page[-1].id))


def _page(queue: str | None, status: str) -> Callable[[AsyncConnection], Awaitable[Any]]:
    return lambda conn: todo_views.list_todos(
        conn, todo_views.TodoQuery(queue=queue, status=status, limit=50)
    )


READS: dict[str, Callable[[AsyncConnection], Awaitable[Any]]] = {
    "todos page": _next_page,
    **{f"todos page, {s}": _page(None, s) for s in ("pending", "running", "done", "failed", "cancelled")},
    **{f"todos page, {QUEUE} {s}": _page(QUEUE, s) for s in ("pending", "done", "failed")},
    "todo show": _show_newest,
    "trace": _trace_newest,
    "attention: failed todos": attention_views.failed_todos,
    "attention: running todos": attention_views.running_todos,
    "attention: oldest claimable": lambda c: attention_views.oldest_claimable(c, [QUEUE]),
    "attention: rejected rows": attention_views.rejected_rows,
    "overview minutes": console_views.recent_minutes,
    "rejected rows page": lambda c: inbox_views.replay_candidates(c, inbox_views.ReplayFilter(), limit=50),
}


async def _round(conn: psycopg.Connection[Any], db_url: str, redis_url: str) -> dict[str, int]:
    async def work_todos() -> None:
        await asyncio.to_thread(_work_todos, db_url)

    return {
        "ingest + ack": await _measure(conn, lambda: _ingest_and_ack(db_url, redis_url)),
        "worker claims and ends": await _measure(conn, work_todos),
        "rescuer": await _measure(conn, lambda: _rescue(db_url)),
        **{name: await _settled(conn, _read(db_url, read)) for name, read in READS.items()},
    }


async def _settled(conn: psycopg.Connection[Any], read: Callable[[], Awaitable[None]]) -> int:
    """A read's buffers, the lesser of two runs. The first read after the
    round's writes may also pay for the writes' leftovers (index entries of
    the rows the workers moved, which it marks dead, hint bits it sets):
    how much depends on timing, not on the history (a full suite once saw
    the pending page read 167 buffers where it reads 87-89 alone). A walk
    over the retained rows is in both runs."""
    return min(await _measure(conn, read), await _measure(conn, read))


def _retain(conn: psycopg.Connection[Any], rows: int, start: int) -> None:
    history.fill(conn, rows, adapter=ADAPTER, stream=STREAM, queue=QUEUE, start=start)
    conn.execute("VACUUM (ANALYZE) inbox, events, todos, todo_events")
    # Autovacuum off on every table that holds rows (the history tables'
    # partitions, not the partitioned tables, which hold none).
    tables = conn.execute(
        "SELECT relname::text FROM pg_class WHERE relkind = 'r' AND relnamespace = 'public'::regnamespace"
        " AND (relname ~ '^(inbox|events|todo_events|todos_done)(_p[0-9]{6})?$'"
        "      OR relname IN ('todos_live', 'todos_done_late'))"
    ).fetchall()
    for (table,) in tables:
        conn.execute(sql.SQL("ALTER TABLE {} SET (autovacuum_enabled = off)").format(sql.Identifier(table)))


def _forget_the_round(conn: psycopg.Connection[Any]) -> None:
    recent = "now() - interval '2 hours'"
    conn.execute(
        f"DELETE FROM inbox_keys WHERE inbox_id IN (SELECT id FROM inbox WHERE stored_at > {recent})"
    )
    for table, column in (("inbox", "stored_at"), ("events", "received_at"), ("todos", "created_at")):
        conn.execute(
            sql.SQL("DELETE FROM {} WHERE {} > now() - interval '2 hours'").format(
                sql.Identifier(table), sql.Identifier(column)
            )
        )
    conn.execute("DELETE FROM todo_events WHERE todo_id NOT IN (SELECT id FROM todos)")


async def test_the_hot_paths_read_the_same_with_ten_times_the_history(db_url: str, redis_url: str) -> None:
    with psycopg.connect(libpq(db_url), autocommit=True) as conn:
        conn.execute(
            "INSERT INTO adapters (name, transport, mode) VALUES (%s, 'redis', 'stream')", (ADAPTER,)
        )
        _retain(conn, SMALL, 1)
        small = await _round(conn, db_url, redis_url)
        # The history grows by rows written before the first round's: its
        # rows go, so ids follow time as in a deployment (the console's
        # window is found by id).
        _forget_the_round(conn)
        _retain(conn, LARGE - SMALL, SMALL + 1)
        large = await _round(conn, db_url, redis_url)
    print({k: (small[k], large[k]) for k in small})
    grown = {k: (small[k], large[k]) for k in small if large[k] > small[k] * 1.5 + GRACE}
    assert grown == {}, f"buffers touched with {SMALL:,} and {LARGE:,} retained: {grown}"
