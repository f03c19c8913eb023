"""Claimed at fetch, finished in the background (issue 25), against real
PostgreSQL: a batch of todos claimed in one call; an end handed to the
writer settled after its commit (and after a row held elsewhere is let
go); a claim that waited long gets its lease again from now, or is not run
if it lost its todo meanwhile; a claim given back unrun uncounts its
attempt."""

from __future__ import annotations

import threading
import time
import uuid

import psycopg
import pytest
from structlog.testing import capture_logs

from backhalf import todos
from backhalf.queues import QueueConfig
from backhalf.state_writer import StateWriter
from backhalf.worker import Claim, Runner
from tests.support.db import insert_todos, libpq, query, scalar

QUEUE = QueueConfig(name="q", handler="x:y", time_limit_ms=60_000, lease_margin_ms=4_000, max_attempts=5)


@pytest.fixture
def todo_ids(db_url: str) -> list[int]:
    return insert_todos(db_url, 4)


def request(todo_id: int, queue: str = "q") -> todos.StartRequest:
    return todos.StartRequest(todo_id, queue, uuid.uuid4(), QUEUE.lease_ms / 1000, QUEUE.max_attempts)


def claimed(writer: StateWriter, todo_id: int) -> todos.Started:
    """Todo ``todo_id`` claimed alone, as a fetch of one message would."""
    (started,) = writer.claim([request(todo_id)])
    assert started is not None
    return started


def test_a_fetched_batch_is_claimed_at_once_each_answered(
    writer: StateWriter, db_url: str, todo_ids: list[int]
) -> None:
    libpq_url = libpq(db_url)
    with psycopg.connect(libpq_url, autocommit=True) as conn:
        conn.execute("UPDATE todos SET status = 'done' WHERE id = %s", (todo_ids[1],))
    answers = writer.claim([request(todo_ids[0]), request(todo_ids[1]), request(todo_ids[2], "other")])
    assert [a.found if a else None for a in answers] == ["dispatched", "done", todos.FOREIGN]
    assert answers[0] is not None
    assert answers[0].todo is not None
    assert answers[0].todo.attempt == 1
    assert scalar(db_url, "SELECT status FROM todos WHERE id = %(i)s", {"i": todo_ids[0]}) == "running"
    # One statement for the batch: the started todo's event, nothing for the others.
    assert query(db_url, "SELECT todo_id, to_status FROM todo_events") == [(todo_ids[0], "running")]


def test_a_background_end_is_settled_after_its_commit_even_past_a_held_row(
    writer: StateWriter, db_url: str, todo_ids: list[int]
) -> None:
    started = claimed(writer, todo_ids[0])
    settled: list[bool | BaseException] = []
    done = threading.Event()

    def on_settled(outcome: bool | BaseException) -> None:
        # Called once durable: the row says so by now.
        settled.append(outcome)
        settled.append(
            scalar(db_url, "SELECT status FROM todos WHERE id = %(i)s", {"i": todo_ids[0]}) == "done"
        )
        done.set()

    with psycopg.connect(libpq(db_url)) as holder:
        holder.execute("SELECT 1 FROM todos WHERE id = %s FOR UPDATE", (todo_ids[0],))
        writer.finish(todos.Ending(started, "done", None, "done"), on_settled)
        time.sleep(0.3)  # the writer answered busy meanwhile and asks again later
        assert not done.is_set()
        assert writer.busy_answers >= 1
        holder.rollback()
    assert done.wait(10)
    assert settled == [True, True]


def test_a_background_end_of_a_run_that_lost_its_todo_is_discarded(
    writer: StateWriter, db_url: str, todo_ids: list[int]
) -> None:
    started = claimed(writer, todo_ids[0])
    with psycopg.connect(libpq(db_url), autocommit=True) as conn:
        conn.execute("UPDATE todos SET status = 'cancelled' WHERE id = %s", (todo_ids[0],))
    outcome: list[bool | BaseException] = []
    done = threading.Event()

    def settled(o: bool | BaseException) -> None:
        outcome.append(o)
        done.set()

    writer.finish(todos.Ending(started, "done", None, "done"), settled)
    assert done.wait(10)
    assert outcome == [False]
    assert scalar(db_url, "SELECT status FROM todos WHERE id = %(i)s", {"i": todo_ids[0]}) == "cancelled"


def test_a_claim_given_back_unrun_is_dispatched_with_its_attempt_uncounted(
    writer: StateWriter, db_url: str, todo_ids: list[int]
) -> None:
    answers = writer.claim([request(todo_ids[0]), request(todo_ids[1])])
    runs = [a for a in answers if a is not None]
    assert scalar(db_url, "SELECT sum(attempts) FROM todos") == 2
    endings = [todos.Ending(r, "dispatched", None, "given back", unrun=True) for r in runs]
    assert writer.end_all(endings) == [True, True]
    rows = query(
        db_url,
        "SELECT status, attempts, lease_until, run_token FROM todos"
        " WHERE attempts > 0 OR status <> 'dispatched' OR lease_until IS NOT NULL",
    )
    assert rows == []
    assert (
        query(db_url, "SELECT from_status, to_status, detail FROM todo_events WHERE detail = 'given back'")
        == [("running", "dispatched", "given back")] * 2
    )


def runner_with(writer: StateWriter, ran: list[int]) -> Runner:
    return Runner(writer, {"q": (QUEUE, lambda todo: ran.append(todo.id))})


def test_a_claim_that_waited_long_has_its_lease_again_from_now(
    writer: StateWriter, db_url: str, todo_ids: list[int]
) -> None:
    started = claimed(writer, todo_ids[0])
    with psycopg.connect(libpq(db_url), autocommit=True) as conn:
        # As if claimed a minute ago: its lease has nearly run out.
        conn.execute(
            "UPDATE todos SET lease_until = now() + interval '1 second' WHERE id = %s", (todo_ids[0],)
        )
    ran: list[int] = []
    runner_with(writer, ran).run("q", todo_ids[0], Claim(started, time.monotonic() - 60))
    assert ran == [todo_ids[0]]
    # Extended before the run (at least the whole lease from then on), then ended.
    assert scalar(db_url, "SELECT status FROM todos WHERE id = %(i)s", {"i": todo_ids[0]}) == "done"
    assert query(
        db_url, "SELECT to_status FROM todo_events WHERE todo_id = %(i)s ORDER BY id", {"i": todo_ids[0]}
    ) == [("running",), ("done",)]


def test_a_lease_is_extended_only_for_its_own_run(
    writer: StateWriter, db_url: str, todo_ids: list[int]
) -> None:
    started = claimed(writer, todo_ids[0])
    assert writer.extend([(started, 600)]) == [True]
    lease_left = "SELECT extract(epoch FROM lease_until - now()) FROM todos WHERE id = %(i)s"
    assert float(scalar(db_url, lease_left, {"i": todo_ids[0]})) > 590
    other_run = todos.Started(started.todo, started.found, uuid.uuid4(), started.lease_until)
    assert writer.extend([(other_run, 6000)]) == [False]
    assert float(scalar(db_url, lease_left, {"i": todo_ids[0]})) < 601


def test_a_claim_that_lost_its_todo_while_it_waited_does_not_run(
    writer: StateWriter, db_url: str, todo_ids: list[int]
) -> None:
    started = claimed(writer, todo_ids[0])
    with psycopg.connect(libpq(db_url), autocommit=True) as conn:
        # The rescuer took it back (its lease expired while it waited).
        conn.execute("UPDATE todos SET status = 'dispatched', run_token = NULL WHERE id = %s", (todo_ids[0],))
    ran: list[int] = []
    with capture_logs() as logs:
        runner_with(writer, ran).run("q", todo_ids[0], Claim(started, time.monotonic() - 60))
    assert ran == []
    assert [e["status"] for e in logs if e["event"] == "todo_skipped"] == ["claim_lost"]
    assert scalar(db_url, "SELECT status FROM todos WHERE id = %(i)s", {"i": todo_ids[0]}) == "dispatched"


def test_a_run_with_a_fresh_claim_makes_no_start_of_its_own(
    writer: StateWriter, db_url: str, todo_ids: list[int]
) -> None:
    started = claimed(writer, todo_ids[0])
    ran: list[int] = []
    released = threading.Event()
    runner_with(writer, ran).run("q", todo_ids[0], Claim(started, time.monotonic()), lambda: released.set)
    assert released.wait(10)
    assert ran == [todo_ids[0]]
    assert scalar(db_url, "SELECT attempts FROM todos WHERE id = %(i)s", {"i": todo_ids[0]}) == 1
    assert query(db_url, "SELECT to_status FROM todo_events ORDER BY id") == [("running",), ("done",)]


def todos_seq_scans(db_url: str, writer: StateWriter) -> int:
    """Sequential scans of todos so far, the writer's own counted (its
    backend's statistics flushed first)."""
    writer._connection().execute("SELECT pg_stat_force_next_flush()")
    writer._connection().execute("SELECT 1")  # its end flushes them
    with psycopg.connect(libpq(db_url), autocommit=True) as conn:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        row = conn.execute("SELECT seq_scan FROM pg_stat_user_tables WHERE relname = 'todos'").fetchone()
    assert row is not None
    return int(row[0])


def test_the_writers_plan_made_on_a_small_table_still_reads_todos_by_id_once_it_grew(
    writer: StateWriter, db_url: str, todo_ids: list[int]
) -> None:
    """Its statements are planned once and the plan kept until the table is
    analyzed again: a plan made on a new table (a first batch of todos) must
    not read the whole table once it holds many more (it did: a hash join
    over a scan of every todo, 5 ms a batch at 8,000 todos in the bench,
    growing with them until autovacuum's next ANALYZE)."""
    grow = (
        "INSERT INTO todos (queue, idempotency_key, payload, status)"
        " SELECT 'q', 'grown' || g, json_build_object('pad', repeat('x', 200)), 'done'"
        " FROM generate_series(%s::int, %s::int) g"
    )
    with psycopg.connect(libpq(db_url), autocommit=True) as conn:
        conn.execute(grow, (1, 2000))  # an ingester's first batch
    writer.claim([request(todo_ids[0])])  # planned now
    with psycopg.connect(libpq(db_url), autocommit=True) as conn:
        conn.execute(grow, (2001, 30000))  # not analyzed yet: the plan is kept
    before = todos_seq_scans(db_url, writer)
    answers = writer.claim([request(todo_ids[1]), request(todo_ids[2])])
    assert all(a is not None and a.todo is not None for a in answers)
    assert todos_seq_scans(db_url, writer) == before


def test_a_lease_held_by_another_transaction_is_answered_busy_not_waited_for(
    writer: StateWriter, db_url: str, todo_ids: list[int]
) -> None:
    started = claimed(writer, todo_ids[0])
    with psycopg.connect(libpq(db_url)) as holder:
        holder.execute("SELECT 1 FROM todos WHERE id = %s FOR UPDATE", (todo_ids[0],))
        began = time.monotonic()
        assert writer.extend([(started, 600)]) == [None]
        assert time.monotonic() - began < 5  # the connection's lock timeout is far longer
    assert writer.extend([(started, 600)]) == [True]


def test_close_waits_for_a_background_end_asked_for_again(
    writer: StateWriter, db_url: str, todo_ids: list[int]
) -> None:
    """An end answered busy is retried from a timer: closing the writer
    meanwhile must still write it, not drop it."""
    started = claimed(writer, todo_ids[0])
    outcome: list[bool | BaseException] = []
    holder = psycopg.connect(libpq(db_url))
    holder.execute("SELECT 1 FROM todos WHERE id = %s FOR UPDATE", (todo_ids[0],))
    writer.finish(todos.Ending(started, "done", None, "done"), outcome.append)
    time.sleep(0.1)  # answered busy at least once by now: a timer will ask again
    threading.Timer(0.5, holder.close).start()  # the lock goes while close() waits
    writer.close()
    assert outcome == [True]
    assert scalar(db_url, "SELECT status FROM todos WHERE id = %(i)s", {"i": todo_ids[0]}) == "done"
