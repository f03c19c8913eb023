"""dramatiq's broker over the todos table (ingest.processes.workers.worker_broker)
against real PostgreSQL: the claimer claims what its free threads can
start, wakes on the store's NOTIFY before its poll, comes back after its
connection is lost, and gives back what it claimed and never started (at
close, from dramatiq's work queue at stop, a message a middleware skipped);
the lease keeper extends every held claim and marks the lost ones; the
broker carries todos only; and a dramatiq Worker in this process runs
todos through it end to end. Assertions are on the todos' rows."""

from __future__ import annotations

import asyncio
import gc
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dramatiq
import psycopg
import pytest
from dramatiq.worker import ConsumerThread, WorkerThread
from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncEngine
from structlog.testing import capture_logs

from backhalf.db import DatabaseSettings, create_sync_engine
from backhalf.lifecycle import todos
from backhalf.lifecycle.state_writer import StateWriter
from ingest.config import load
from ingest.embedded.processes import wait_for
from ingest.processes.workers.worker import switchboard_broker
from ingest.processes.workers.worker_broker import (
    GIVEN_BACK,
    NOT_RUN,
    SWITCHBOARD_QUEUE,
    Claimer,
    LeaseKeeper,
    Leases,
    NotAQueue,
    TodoBroker,
    TodoMessage,
)
from tests.support import handlers
from tests.support.config import stream_adapter, write_config
from tests.support.db import claim, insert_todos, libpq, query, scalar
from tests.support.downstream import HANDLER


@pytest.fixture
def sync_engine(db_url: str) -> Iterator[Engine]:
    engine = create_sync_engine(DatabaseSettings(url=db_url), pool_size=2)
    yield engine
    engine.dispose()


@pytest.fixture
def leases() -> Leases:
    return Leases()


class Claimers:
    """Claimers made by a test, closed after it."""

    def __init__(self, engine: Engine, writer: StateWriter, leases: Leases) -> None:
        self._engine, self._writer, self._leases = engine, writer, leases
        self._made: list[Claimer] = []

    def __call__(
        self, threads: int = 2, poll_interval_s: float = 0.2, queues: tuple[str, ...] = ("q",)
    ) -> Claimer:
        claimer = Claimer(self._engine, self._writer, self._leases, queues, threads=threads, lease_s=30,
                          poll_interval_s=poll_interval_s)  # fmt: skip
        self._made.append(claimer)
        return claimer

    def close(self) -> None:
        for claimer in self._made:
            claimer.release()


@pytest.fixture
def claimers(sync_engine: Engine, writer: StateWriter, leases: Leases) -> Iterator[Claimers]:
    made = Claimers(sync_engine, writer, leases)
    yield made
    made.close()


def statuses(db_url: str) -> dict[str, int]:
    return dict(query(db_url, "SELECT status, count(*) FROM todos GROUP BY status"))


def next_message(claimer: Claimer, timeout_s: float = 5) -> TodoMessage:
    message = claimer.next_message(timeout_s)
    assert message is not None, f"no todo claimed within {timeout_s} s"
    return message


# -- the claimer ------------------------------------------------------------------


def test_a_claim_takes_only_what_the_free_threads_can_start(
    claimers: Claimers, leases: Leases, db_url: str
) -> None:
    ids = insert_todos(db_url, 5)
    claimer = claimers(threads=2)
    first, second = next_message(claimer), next_message(claimer)
    assert [first.claim.todo.id, second.claim.todo.id] == ids[:2]
    assert (first.actor_name, first.queue_name, first.args) == ("switchboard:q", SWITCHBOARD_QUEUE, (ids[0],))
    assert statuses(db_url) == {"running": 2, "pending": 3}
    # Both threads busy: nothing more is claimed, however long it waits.
    assert claimer.next_message(0.5) is None
    assert statuses(db_url) == {"running": 2, "pending": 3}
    assert sorted(c.todo.id for c in leases.held()) == ids[:2]
    # A thread done with its todo (its run ended): one more claim.
    first.ran = True
    leases.release(first.claim)
    claimer.done_with(first)
    assert next_message(claimer).claim.todo.id == ids[2]
    assert statuses(db_url) == {"running": 3, "pending": 2}


def test_the_claimers_connection_walks_the_claimable_index(claimers: Claimers, db_url: str) -> None:
    """Its session prices sorts out (queries.sql, claimer_session): the
    claim's plan cannot be a read and sort of a whole backlog; and its
    commits wait for no WAL flush (a claim lost in a crash is run again)."""
    insert_todos(db_url, 1)
    claimer = claimers()
    next_message(claimer)
    pg = claimer._pg()
    assert pg is not None
    assert pg.execute("SHOW enable_sort").fetchone() == ("off",)
    assert pg.execute("SHOW synchronous_commit").fetchone() == ("off",)


async def test_the_stores_notification_wakes_the_claimer_long_before_its_poll(
    claimers: Claimers, engine: AsyncEngine, db_url: str
) -> None:
    claimer = claimers(poll_interval_s=60)
    assert await asyncio.to_thread(claimer.next_message, 0.3) is None  # listening from now on
    waiting = asyncio.ensure_future(asyncio.to_thread(claimer.next_message, 20))
    await asyncio.sleep(0.5)
    assert not waiting.done()
    began = time.monotonic()
    async with engine.begin() as conn:
        todo_id = await todos.create(conn, queue="q", key="k", payload='{"n": 1}', detail="created by replay")
    message = await asyncio.wait_for(waiting, timeout=30)
    assert message is not None
    assert message.claim.todo.id == todo_id
    assert time.monotonic() - began < 10, "woken by the poll (60 s), not by the NOTIFY"


def test_a_claim_on_a_lost_connection_is_backed_off_and_resumes(claimers: Claimers, db_url: str) -> None:
    claimer = claimers(poll_interval_s=0.2)
    assert claimer.next_message(0.3) is None  # connected, listening
    pg = claimer._pg()
    assert pg is not None
    with psycopg.connect(libpq(db_url), autocommit=True) as admin:
        killed = admin.execute("SELECT pg_terminate_backend(%s)", (pg.info.backend_pid,)).fetchone()
    assert killed == (True,)
    (todo_id,) = insert_todos(db_url, 1)
    with capture_logs() as logs:
        message = next_message(claimer, 10)
    assert message.claim.todo.id == todo_id
    events = [e["event"] for e in logs]
    assert "todo_claim_failed" in events
    assert events.index("todo_claim_failed") < events.index("todo_claims_resumed")


def test_claims_not_handed_out_are_given_back_at_close(
    claimers: Claimers, leases: Leases, db_url: str
) -> None:
    ids = insert_todos(db_url, 3)
    claimer = claimers(threads=3)
    taken = next_message(claimer)  # the other two wait in the claimer
    claimer.release()
    assert dict(query(db_url, "SELECT id, status FROM todos")) == {
        ids[0]: "running", ids[1]: "pending", ids[2]: "pending",
    }  # fmt: skip
    assert query(
        db_url, "SELECT DISTINCT attempts, run_after <= now() FROM todos WHERE status = 'pending'"
    ) == [(0, True)]
    assert scalar(db_url, "SELECT count(*) FROM todo_events WHERE detail = %(d)s", {"d": GIVEN_BACK}) == 2
    assert [c.todo.id for c in leases.held()] == [taken.claim.todo.id]
    # The same claimer serves the consumer dramatiq starts next (after an
    # error): connected again, its count of what is in flight whole.
    again = next_message(claimer)
    assert again.claim.todo.id in ids[1:]
    claimer.stop_claiming()
    claimer.release()
    assert claimer.next_message(0.2) is None  # stopping: claims no more


def test_dramatiqs_work_queue_at_stop_is_given_back(claimers: Claimers, leases: Leases, db_url: str) -> None:
    ids = insert_todos(db_url, 2)
    claimer = claimers(threads=2)
    messages = [next_message(claimer), next_message(claimer)]
    claimer.requeue(messages)
    assert query(db_url, "SELECT DISTINCT status, attempts FROM todos") == [("pending", 0)]
    assert scalar(db_url, "SELECT count(*) FROM todo_events WHERE detail = %(d)s", {"d": GIVEN_BACK}) == 2
    assert leases.held() == []
    # Its threads are free again: the todos are claimed anew.
    assert sorted([next_message(claimer).claim.todo.id, next_message(claimer).claim.todo.id]) == ids


def test_a_message_a_middleware_skipped_is_given_back_when_done_with(
    claimers: Claimers, leases: Leases, db_url: str
) -> None:
    """A middleware after Switchboard's (an AgeLimit, a user's own) skips a
    claimed message: its actor never takes the claim, which is given back,
    not left running until its lease expires."""
    insert_todos(db_url, 1)
    claimer = claimers()
    message = next_message(claimer)
    assert query(db_url, "SELECT status, attempts FROM todos") == [("running", 1)]
    claimer.done_with(message)  # message.ran is False: its actor never ran
    assert query(db_url, "SELECT status, attempts FROM todos") == [("pending", 0)]
    assert scalar(db_url, "SELECT detail FROM todo_events ORDER BY id DESC LIMIT 1") == NOT_RUN
    assert leases.held() == []


# -- the lease keeper -------------------------------------------------------------

LEASE_LEFT = "SELECT id, extract(epoch FROM lease_until - now()) FROM todos WHERE status = 'running'"


def test_the_lease_keeper_extends_every_held_claim_and_marks_the_lost_ones(
    sync_engine: Engine, leases: Leases, db_url: str
) -> None:
    ids = insert_todos(db_url, 3)
    kept, lost, released = claim(db_url, lease_s=5)
    leases.hold([kept, lost, released])
    leases.release(released)
    query(db_url, "UPDATE todos SET status = 'cancelled' WHERE id = %(i)s", {"i": lost.todo.id})
    keeper = LeaseKeeper(leases, sync_engine, lease_s=60)
    try:
        with capture_logs() as logs:
            keeper.beat()
    finally:
        keeper.close()
    left = {i: float(s) for i, s in query(db_url, LEASE_LEFT)}
    assert left[ids[0]] > 55  # extended: the whole lease again
    assert left[ids[2]] <= 5  # released (its end settled): not extended
    assert leases.lost(lost)
    assert not leases.lost(kept)
    assert [e["todo_id"] for e in logs if e["event"] == "todo_claim_lost"] == [lost.todo.id]


# -- plans that follow the backlog ------------------------------------------------

BACKLOG = 20_000
RUNNING = 5_000
LIVE_ROWS_READ = """
SELECT (SELECT coalesce(sum(idx_tup_read), 0) FROM pg_stat_user_indexes WHERE relname = 'todos_live')
       + (SELECT seq_tup_read FROM pg_stat_user_tables WHERE relname = 'todos_live')
"""
GROW = """
INSERT INTO todos (queue, idempotency_key, payload, status, attempts, run_token, lease_until)
SELECT 'q', %(status)s || g, '{}', %(status)s, %(attempts)s,
       CASE WHEN %(status)s = 'running' THEN gen_random_uuid() END,
       CASE WHEN %(status)s = 'running' THEN now() + interval '1 hour' END
FROM generate_series(1, %(n)s::int) g
"""


def live_rows_read(db_url: str, held: list[psycopg.Connection[Any]]) -> int:
    """Index entries and rows of todos_live read so far, the statistics of
    every ``held`` connection flushed first (each flushes its own)."""
    for pg in held:
        pg.execute("SELECT pg_stat_force_next_flush()")
        pg.execute("SELECT 1")  # its end flushes them
    with psycopg.connect(libpq(db_url), autocommit=True) as conn:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        row = conn.execute(LIVE_ROWS_READ).fetchone()
    assert row is not None
    return int(row[0])


def test_the_workers_statements_read_their_rows_not_a_backlog_grown_since_they_were_planned(
    claimers: Claimers, writer: StateWriter, leases: Leases, sync_engine: Engine, db_url: str
) -> None:
    """todos_live holds the work in flight: a handful of rows, then a
    backlog. The claimer's, the writer's and the lease keeper's statements,
    run sixteen times on a small table (PostgreSQL then keeps a plan), must
    still read a claim's, a batch's and a beat's rows once a backlog has
    grown, not the table (a kept plan walked a whole index, or hashed every
    live todo, per statement: queries.sql, by_id_session)."""
    insert_todos(db_url, 30)
    claimer = claimers()
    keeper = LeaseKeeper(leases, sync_engine, lease_s=60)
    try:
        next_message(claimer).ran = True
        claiming = claimer._pg()
        assert claiming is not None
        beating = keeper._conn.get()
        # Planned, and kept had they been: psycopg prepares at the 6th run,
        # PostgreSQL weighs a generic plan from the 11th.
        for _ in range(16):
            (run,) = todos.claim(claiming, ["q"], 1, 60)
            todos.extend_leases(beating, [run], 60)
            assert writer.end(todos.Ending(run, "done", None, "done"))
        held = [claiming, beating, writer._conn.get()]
        query(db_url, GROW, {"status": "pending", "attempts": 0, "n": BACKLOG})
        query(db_url, GROW, {"status": "running", "attempts": 1, "n": RUNNING})
        before = live_rows_read(db_url, held)
        runs = todos.claim(claiming, ["q"], 8, 60)
        claimed = live_rows_read(db_url, held) - before
        before = live_rows_read(db_url, held)
        assert set(todos.extend_leases(beating, runs, 60).values()) == {True}
        beat = live_rows_read(db_url, held) - before
        before = live_rows_read(db_url, held)
        assert writer.end_all([todos.Ending(r, "done", None, "done") for r in runs]) == [True] * len(runs)
        ended = live_rows_read(db_url, held) - before
    finally:
        keeper.close()
    assert len(runs) == 8
    # A claim's walk and update, a beat's and a batch's lock and update, and
    # the statistics' own reads: a few dozen rows, of a table of 25,000.
    read = {"claim": claimed, "beat": beat, "end": ended}
    assert max(read.values()) < 200, read


def test_a_batch_of_ends_reads_its_rows_not_every_claim_since_the_last_vacuum(
    claimers: Claimers, writer: StateWriter, db_url: str
) -> None:
    """Each claim leaves an entry in the running todos' partial index that
    stays, dead, until a vacuum. A batch of ends must reach its rows by id,
    not through that index: a plan that hashed the running rows read every
    entry left since the last vacuum at every batch, millions a drain
    (queries.sql, end_runs). A table not analyzed yet, as a new one, makes
    that index look empty to the planner."""
    query(db_url, "ALTER TABLE todos_live SET (autovacuum_enabled = off)")
    insert_todos(db_url, 5_200)
    claimer = claimers()
    next_message(claimer).ran = True
    claiming = claimer._pg()
    assert claiming is not None
    held = [claiming, writer._conn.get()]
    for _ in range(100):
        runs = todos.claim(claiming, ["q"], 50, 60)
        assert writer.end_all([todos.Ending(r, "done", None, "done") for r in runs]) == [True] * len(runs)
    runs = todos.claim(claiming, ["q"], 50, 60)
    before = live_rows_read(db_url, held)
    assert writer.end_all([todos.Ending(r, "done", None, "done") for r in runs]) == [True] * len(runs)
    ended = live_rows_read(db_url, held) - before
    assert len(runs) == 50
    # A few entries of the primary key a row (its dead versions too), not
    # the 5,000 claims' entries in the running index (5,152 read before).
    assert ended < 1_000, ended


# -- the broker -------------------------------------------------------------------


@pytest.fixture
def config_path(db_url: str, redis_url: str, tmp_path: Path) -> Path:
    return write_config(tmp_path / "switchboard.toml", database_url=db_url, redis_url=redis_url,
                        adapters=[stream_adapter("orders")],
                        queues={"orders": {"handler": HANDLER, "max_attempts": 2, "min_backoff_ms": 50,
                                           "max_backoff_ms": 100}},
                        worker={"lease_ms": 3000, "poll_interval_ms": 100})  # fmt: skip


def test_the_broker_carries_todos_only(config_path: Path) -> None:
    broker = switchboard_broker(load(config_path, os.environ), threads=2)
    try:
        actor = broker.get_actor("switchboard:orders")
        assert actor.queue_name == SWITCHBOARD_QUEUE
        assert broker.get_declared_queues() == {SWITCHBOARD_QUEUE}
        with pytest.raises(NotAQueue, match="take their todos from PostgreSQL"):
            actor.send(1)
        # A queue of an application's own actor gets a consumer that yields nothing.
        assert next(broker.consume("emails", timeout=10)) is None
    finally:
        broker.close()


def test_a_worker_process_freezes_its_start_up_before_its_threads_run(
    config_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Start-up out of the collector's reach once the worker boots, before
    any of its threads runs: left in it, the first full collection walked it
    all within the first second of work and stopped every thread of the
    process for 170-200 ms. (The call is recorded, not made: this test
    process's own heap stays as it is.)"""
    threads_at_freeze: list[list[str]] = []
    monkeypatch.setattr(gc, "freeze", lambda: threads_at_freeze.append(dramatiq_threads()))
    broker = switchboard_broker(load(config_path, os.environ), threads=2)
    worker = dramatiq.Worker(broker, worker_threads=2, worker_timeout=100)
    worker.start()
    try:
        assert len(dramatiq_threads()) >= 3  # its consumer and its two worker threads
    finally:
        worker.stop(timeout=30_000)
    assert threads_at_freeze == [[]]  # frozen once, before any of them ran


def dramatiq_threads() -> list[str]:
    """The dramatiq worker's and consumer's threads alive in this process."""
    return sorted(t.name for t in threading.enumerate() if isinstance(t, WorkerThread | ConsumerThread))


def test_a_dramatiq_worker_in_this_process_runs_the_todos_through_the_broker(
    config_path: Path, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Claimed, run by the handler in dramatiq's threads, ended in the
    background: done; a todo that fails once retried after its backoff and
    done; one that always fails failed on its last attempt. At stop, the
    ends are written and nothing is left running."""
    handlers.create_runs_table(libpq(db_url))
    monkeypatch.setenv(handlers.DB_VARIABLE, libpq(db_url))
    with psycopg.connect(libpq(db_url), autocommit=True) as conn:
        conn.execute(
            "INSERT INTO todos (queue, idempotency_key, payload)"
            " SELECT 'orders', 'k' || g, CASE g WHEN 1 THEN '{\"fail_times\": 1}'"
            " WHEN 2 THEN '{\"always_fail\": true}' ELSE '{}' END::jsonb FROM generate_series(1, 6) g"
        )
    monkeypatch.setattr(gc, "freeze", lambda: None)  # this test process's heap stays as it is
    broker = switchboard_broker(load(config_path, os.environ), threads=2)
    assert isinstance(broker, TodoBroker)
    worker = dramatiq.Worker(broker, worker_threads=2, worker_timeout=100)
    worker.start()
    try:
        wait_for(
            lambda: statuses(db_url) == {"done": 5, "failed": 1},
            timeout_s=60,
            what="every todo ended",
        )
    finally:
        worker.stop(timeout=30_000)
    assert dict(query(db_url, "SELECT idempotency_key, attempts FROM todos WHERE attempts > 1")) == {
        "k1": 2, "k2": 2,
    }  # fmt: skip
    runs = query(
        db_url, "SELECT count(*), count(DISTINCT todo_id) FROM handler_runs WHERE outcome = 'started'"
    )
    assert runs == [(8, 6)]
    assert (
        scalar(db_url, "SELECT count(*) FROM todos WHERE lease_until IS NOT NULL OR run_token IS NOT NULL")
        == 0
    )
    # Each todo's trail: claimed, then its end (a retry pending between).
    assert scalar(db_url, "SELECT count(*) FROM todo_events WHERE detail = 'claimed'") == 8


def test_a_slow_queue_gets_no_prefetch_from_a_quick_queues_pace(claimers: Claimers, db_url: str) -> None:
    """The prefetch follows each queue's own pace: with a quick queue timed
    and a slow one not, a claim that starts at the slow queue takes only what
    the free threads can start, and the prefetch comes from the quick one."""
    slow = insert_todos(db_url, 20, queue="slow")
    quick = insert_todos(db_url, 20, queue="quick")
    claimer = claimers(queues=("quick", "slow"), threads=2)
    claimer._pace_s["quick"] = 0.0001  # runs of 0.1 ms: the most prefetch allowed
    # The claim starts at the queue after the first (the order rotates): slow.
    first = next_message(claimer)
    claimed = [first.claim.todo.id] + [m.claim.todo.id for m in claimer._ready]
    assert len([i for i in claimed if i in slow]) == 2  # the two free threads' only
    assert len([i for i in claimed if i in quick]) > 2  # the quick queue's prefetch


def test_at_sigterm_the_claims_waiting_in_dramatiqs_work_queue_are_given_back_at_once(
    claimers: Claimers, leases: Leases, db_url: str
) -> None:
    """Not once the last running handler ends: dramatiq empties its work
    queue only after its threads have stopped, a long handler's time later."""
    from queue import PriorityQueue

    from dramatiq.worker import _WorkQueueItem

    insert_todos(db_url, 3)
    claimer = claimers(threads=3)
    running = next_message(claimer)
    claimer.began(running)  # a thread runs it, for long
    work_queue: PriorityQueue[_WorkQueueItem] = PriorityQueue()
    for _ in range(2):
        work_queue.put(_WorkQueueItem(0, next_message(claimer)))
    claimer.stop_claiming()
    claimer.drain(work_queue)
    assert work_queue.empty()
    assert work_queue.unfinished_tasks == 0
    assert dict(query(db_url, "SELECT status, count(*) FROM todos GROUP BY status")) == {
        "running": 1,
        "pending": 2,
    }
    assert [c.todo.id for c in leases.held()] == [running.claim.todo.id]
    assert claimer.next_message(0.2) is None  # stopping: no claim of them again


def test_the_lease_keeper_extends_while_the_writer_is_stuck_on_an_end(
    sync_engine: Engine, writer: StateWriter, leases: Leases, db_url: str
) -> None:
    """Its own connection: a lease beat never waits behind an end batch the
    database is slow to answer (a lease lapsing under a live run lets the
    rescuer run it twice at once)."""
    ids = insert_todos(db_url, 2)
    ending, kept = claim(db_url, lease_s=5)
    leases.hold([kept])
    with psycopg.connect(libpq(db_url)) as holder:
        # The end's row locked elsewhere: the writer asks for it again and
        # again (about 5 s), its thread busy with it.
        holder.execute("SELECT 1 FROM todos WHERE id = %s FOR UPDATE", (ending.todo.id,))
        done: list[bool | BaseException] = []
        writer.finish(todos.Ending(ending, "done", None, "done"), done.append)
        keeper = LeaseKeeper(leases, sync_engine, lease_s=60)
        try:
            began = time.monotonic()
            keeper.beat()
            assert time.monotonic() - began < 2
        finally:
            keeper.close()
        assert done == []  # the end still waits
    left = {i: float(s) for i, s in query(db_url, LEASE_LEFT)}
    assert left[ids[1]] > 55
