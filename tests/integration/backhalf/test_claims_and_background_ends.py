"""A claimed todo's run and its end, against real PostgreSQL (backhalf.lifecycle.worker,
backhalf.lifecycle.state_writer): a success ended in the background and settled after
its commit (and after a row held elsewhere is let go); a failure pending
again after its backoff, or failed on its last attempt; a claim that lost
its todo not run, and a result that lost it discarded; claims given back
unrun, their attempt uncounted; leases extended for their own run only; the
writer's plans by id whatever the table's size; close waiting for every
background end."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import psycopg
import pytest
from structlog.testing import capture_logs

from backhalf import queries
from backhalf.lifecycle import todos
from backhalf.lifecycle.queues import QueueConfig
from backhalf.lifecycle.state_writer import StateWriter
from backhalf.lifecycle.worker import Handler, Runner
from ingest.embedded.processes import wait_for
from tests.support.db import claim, insert_todos, libpq, listening, query, scalar

QUEUE = QueueConfig(name="q", handler="x:y", time_limit_ms=60_000, max_attempts=3, min_backoff_ms=10_000,
                    max_backoff_ms=20_000)  # fmt: skip


@pytest.fixture
def todo_ids(db_url: str) -> list[int]:
    return insert_todos(db_url, 4)


def claimed(db_url: str) -> todos.Claimed:
    """The oldest due todo, claimed alone."""
    (run,) = claim(db_url, limit=1)
    return run


def status(db_url: str, todo_id: int) -> str:
    return str(scalar(db_url, "SELECT status FROM todos WHERE id = %(i)s", {"i": todo_id}))


class Settled:
    """A run's ``settled`` callback, recorded; ``wait`` for it."""

    def __init__(self) -> None:
        self.outcomes: list[bool | BaseException] = []
        self._event = threading.Event()

    def __call__(self, outcome: bool | BaseException) -> None:
        self.outcomes.append(outcome)
        self._event.set()

    def wait(self, timeout_s: float = 10) -> list[bool | BaseException]:
        assert self._event.wait(timeout_s), "never settled"
        return self.outcomes


# -- background ends --------------------------------------------------------------


def test_a_background_end_is_settled_after_its_commit_even_past_a_held_row(
    writer: StateWriter, db_url: str, todo_ids: list[int]
) -> None:
    run = claimed(db_url)
    settled: list[bool | BaseException] = []
    done = threading.Event()

    def on_settled(outcome: bool | BaseException) -> None:
        # Called once durable: the row says so by now.
        settled.append(outcome)
        settled.append(status(db_url, todo_ids[0]) == "done")
        done.set()

    with psycopg.connect(libpq(db_url)) as holder:
        holder.execute("SELECT 1 FROM todos WHERE id = %s FOR UPDATE", (todo_ids[0],))
        writer.finish(todos.Ending(run, "done", None, "done"), on_settled)
        # The writer is answered busy and asks again later.
        wait_for(lambda: writer.busy_answers >= 1, timeout_s=10, what="a busy answer")
        assert not done.is_set()
        holder.rollback()
    assert done.wait(10)
    assert settled == [True, True]


def test_a_background_end_of_a_run_that_lost_its_todo_is_discarded(
    writer: StateWriter, db_url: str, todo_ids: list[int]
) -> None:
    run = claimed(db_url)
    query(db_url, "UPDATE todos SET status = 'cancelled' WHERE id = %(i)s", {"i": todo_ids[0]})
    settled = Settled()
    writer.finish(todos.Ending(run, "done", None, "done"), settled)
    assert settled.wait() == [False]
    assert status(db_url, todo_ids[0]) == "cancelled"


def test_claims_given_back_unrun_are_due_now_uncounted_and_wake_the_workers(
    writer: StateWriter, db_url: str, todo_ids: list[int]
) -> None:
    runs = claim(db_url, limit=2)
    assert scalar(db_url, "SELECT sum(attempts) FROM todos") == 2
    endings = [todos.Ending(r, "pending", None, todos.GIVEN_BACK, unrun=True) for r in runs]
    with listening(db_url, queries.TODO_CHANNEL) as received:
        assert writer.end_all(endings) == [True, True]
        assert received(5, 1) == ["q"]
    assert query(db_url, "SELECT DISTINCT status, attempts, lease_until, run_token FROM todos") == [
        ("pending", 0, None, None)
    ]
    assert scalar(db_url, "SELECT count(*) FROM todos WHERE run_after > now()") == 0
    assert (
        query(db_url, "SELECT from_status, to_status, detail FROM todo_events WHERE to_status = 'pending'")
        == [("running", "pending", todos.GIVEN_BACK)] * 2
    )
    # Their next claim is their first attempt again.
    assert [r.todo.attempt for r in claim(db_url, limit=2)] == [1, 1]


def test_a_give_back_whose_row_another_transaction_holds_is_left_to_the_rescuer(
    writer: StateWriter, db_url: str, todo_ids: list[int]
) -> None:
    run = claimed(db_url)
    with psycopg.connect(libpq(db_url)) as holder:
        holder.execute("SELECT 1 FROM todos WHERE id = %s FOR UPDATE", (todo_ids[0],))
        (answer,) = writer.end_all([todos.Ending(run, "pending", None, todos.GIVEN_BACK, unrun=True)])
    assert isinstance(answer, Exception)
    assert "held by another transaction" in str(answer)
    assert status(db_url, todo_ids[0]) == "running"  # its lease lapses; the rescuer puts it back


# -- runs -------------------------------------------------------------------------


def runner_with(writer: StateWriter, handler: Handler) -> Runner:
    return Runner(writer, {"q": (QUEUE, handler)})


def test_a_successful_run_is_ended_done_in_the_background(
    writer: StateWriter, db_url: str, todo_ids: list[int]
) -> None:
    run = claimed(db_url)
    seen: list[todos.Todo] = []
    settled = Settled()
    runner_with(writer, seen.append).run(run, settled=settled)
    assert settled.wait() == [True]
    assert seen == [run.todo]
    assert query(
        db_url, "SELECT status, attempts, run_token FROM todos WHERE id = %(i)s", {"i": todo_ids[0]}
    ) == [("done", 1, None)]
    assert query(db_url, "SELECT to_status FROM todo_events ORDER BY id") == [("running",), ("done",)]


def test_an_async_handler_is_run_to_completion(writer: StateWriter, db_url: str, todo_ids: list[int]) -> None:
    ran: list[int] = []

    async def handler(todo: todos.Todo) -> None:
        await asyncio.sleep(0.01)
        ran.append(todo.id)

    settled = Settled()
    runner_with(writer, handler).run(claimed(db_url), settled=settled)
    assert settled.wait() == [True]
    assert ran == [todo_ids[0]]
    assert status(db_url, todo_ids[0]) == "done"


def failing(message: str) -> Callable[[todos.Todo], None]:
    def handler(todo: todos.Todo) -> None:
        raise ValueError(message)

    return handler


def test_a_failed_attempt_waits_out_its_backoff_pending_and_is_claimed_again_after_it(
    writer: StateWriter, db_url: str, todo_ids: list[int]
) -> None:
    settled = Settled()
    runner_with(writer, failing("boom")).run(claimed(db_url), settled=settled)
    # Ended before the thread goes on: settled only once committed.
    assert settled.outcomes == [True]
    status_, attempts, error, wait_s, detail = query(
        db_url,
        "SELECT t.status, t.attempts, t.last_error, extract(epoch FROM t.run_after - now()), e.detail"
        " FROM todos t JOIN todo_events e ON e.todo_id = t.id AND e.to_status = 'pending' WHERE t.id = %(i)s",
        {"i": todo_ids[0]},
    )[0]
    assert (status_, attempts, error) == ("pending", 1, "ValueError: boom")
    assert 5 < float(wait_s) <= 20  # min_backoff_ms jittered, at most max_backoff_ms
    assert detail.startswith("attempt 1 of 3 failed; retried after ")
    # Not due yet: the next claim takes the other todos first.
    assert todo_ids[0] not in [r.todo.id for r in claim(db_url, limit=10)]


def test_the_last_attempts_failure_fails_the_todo(
    writer: StateWriter, db_url: str, todo_ids: list[int]
) -> None:
    query(db_url, "UPDATE todos SET attempts = 2 WHERE id = %(i)s", {"i": todo_ids[0]})
    run = claimed(db_url)
    assert run.todo.attempt == 3
    with capture_logs() as logs:
        runner_with(writer, failing("no")).run(run)
    assert query(
        db_url, "SELECT status, attempts, last_error FROM todos WHERE id = %(i)s", {"i": todo_ids[0]}
    ) == [("failed", 3, "ValueError: no")]
    assert [e["attempts"] for e in logs if e["event"] == "todo_failed"] == [3]


def test_a_handlers_error_is_kept_storable_and_without_its_secrets(
    writer: StateWriter, db_url: str, todo_ids: list[int]
) -> None:
    """A NUL (which PostgreSQL refuses in text) and a connection string's
    password in the handler's error: the todo records the rest."""
    runner_with(writer, failing("bad\x00byte at postgresql://app:hunter2@db/x")).run(claimed(db_url))
    error = str(scalar(db_url, "SELECT last_error FROM todos WHERE id = %(i)s", {"i": todo_ids[0]}))
    assert error.startswith("ValueError: bad")
    assert "\x00" not in error
    assert "hunter2" not in error
    assert status(db_url, todo_ids[0]) == "pending"


def test_a_claim_that_lost_its_todo_while_it_waited_does_not_run(
    writer: StateWriter, db_url: str, todo_ids: list[int]
) -> None:
    run = claimed(db_url)
    # The rescuer took it back (its lease lapsed while it waited for a thread).
    query(
        db_url, "UPDATE todos SET status = 'pending', run_token = NULL WHERE id = %(i)s", {"i": todo_ids[0]}
    )
    ran: list[int] = []
    settled = Settled()
    with capture_logs() as logs:
        runner_with(writer, lambda todo: ran.append(todo.id)).run(run, lost=True, settled=settled)
    assert ran == []
    assert settled.outcomes == [False]
    assert [e["status"] for e in logs if e["event"] == "todo_skipped"] == ["claim_lost"]
    assert status(db_url, todo_ids[0]) == "pending"


def test_a_result_of_a_run_whose_todo_was_cancelled_meanwhile_is_discarded(
    writer: StateWriter, db_url: str, todo_ids: list[int]
) -> None:
    def cancelled_while_running(todo: todos.Todo) -> None:
        query(db_url, "UPDATE todos SET status = 'cancelled' WHERE id = %(i)s", {"i": todo.id})

    settled = Settled()
    with capture_logs() as logs:
        runner_with(writer, cancelled_while_running).run(claimed(db_url), settled=settled)
        assert settled.wait() == [False]
    assert status(db_url, todo_ids[0]) == "cancelled"
    assert [e["reason"] for e in logs if e["event"] == "todo_result_discarded"] == [
        "cancelled or rescued while it ran"
    ]


def test_a_run_stopped_by_no_error_of_its_handler_leaves_the_todo_to_its_lease(
    writer: StateWriter, db_url: str, todo_ids: list[int]
) -> None:
    """dramatiq's Shutdown (a second signal) or a KeyboardInterrupt is not
    the handler's failure: no end is written, the claim is let go (its lease
    lapses; the rescuer puts it back), and the exception goes on up."""

    def interrupted(todo: todos.Todo) -> None:
        raise KeyboardInterrupt

    settled = Settled()
    with pytest.raises(KeyboardInterrupt):
        runner_with(writer, interrupted).run(claimed(db_url), settled=settled)
    assert len(settled.outcomes) == 1
    assert isinstance(settled.outcomes[0], KeyboardInterrupt)
    assert query(
        db_url, "SELECT status, attempts, last_error FROM todos WHERE id = %(i)s", {"i": todo_ids[0]}
    ) == [("running", 1, None)]


# The leases' statement (extend_leases) is tested in test_todo_lifecycle.py,
# the lease keeper that runs it in tests/integration/processes/test_worker_broker.py.

# -- the writer's plans -----------------------------------------------------------


def todos_seq_scans(db_url: str, writer: StateWriter) -> int:
    """Sequential scans of todos so far, the writer's own counted (its
    backend's statistics flushed first)."""
    writer._conn.get().execute("SELECT pg_stat_force_next_flush()")
    writer._conn.get().execute("SELECT 1")  # its end flushes them
    with psycopg.connect(libpq(db_url), autocommit=True) as conn:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        row = conn.execute("SELECT seq_scan FROM pg_stat_user_tables WHERE relname = 'todos'").fetchone()
    assert row is not None
    return int(row[0])


def test_the_writers_plan_made_on_a_small_table_still_reads_todos_by_id_once_it_grew(
    writer: StateWriter, db_url: str, todo_ids: list[int]
) -> None:
    """Its statements reach todos by id, never by a sequential scan, whatever
    the statistics say of the table's size: with a table analyzed never, or
    small, a plan read every todo (a hash join over a scan of every todo,
    5 ms a batch at 8,000 todos in the bench, growing with them until
    autovacuum's next ANALYZE). The writer's connection prices sequential
    scans out; what a backlog of live todos costs its plans is
    test_worker_broker.py's "plans that follow the backlog"."""
    grow = (
        "INSERT INTO todos (queue, idempotency_key, payload, status)"
        " SELECT 'q', 'grown' || g, json_build_object('pad', repeat('x', 200)), 'done'"
        " FROM generate_series(%s::int, %s::int) g"
    )
    with psycopg.connect(libpq(db_url), autocommit=True) as conn:
        conn.execute(grow, (1, 2000))  # an ingester's first batch
    runs = claim(db_url, limit=4)
    assert writer.end(todos.Ending(runs[0], "done", None, "done"))  # its connection made now
    with psycopg.connect(libpq(db_url), autocommit=True) as conn:
        conn.execute(grow, (2001, 30000))  # not analyzed yet
    before = todos_seq_scans(db_url, writer)
    assert writer.end(todos.Ending(runs[1], "pending", "boom", "retry", delay_s=5))
    assert writer.end_all(
        [todos.Ending(r, "pending", None, todos.GIVEN_BACK, unrun=True) for r in runs[2:]]
    ) == [
        True,
        True,
    ]
    assert todos_seq_scans(db_url, writer) == before


def test_close_waits_for_a_background_end_asked_for_again(
    writer: StateWriter, db_url: str, todo_ids: list[int]
) -> None:
    """An end answered busy is retried from a timer: closing the writer
    meanwhile must still write it, not drop it."""
    run = claimed(db_url)
    outcome: list[bool | BaseException] = []
    holder = psycopg.connect(libpq(db_url))
    holder.execute("SELECT 1 FROM todos WHERE id = %s FOR UPDATE", (todo_ids[0],))
    writer.finish(todos.Ending(run, "done", None, "done"), outcome.append)
    # Answered busy: a timer will ask again.
    wait_for(lambda: writer.busy_answers >= 1, timeout_s=10, what="a busy answer")
    threading.Timer(0.5, holder.close).start()  # the lock goes while close() waits
    writer.close()
    assert outcome == [True]
    assert status(db_url, todo_ids[0]) == "done"


def test_a_closed_writer_refuses_ends_and_settles_a_background_one_with_the_error(
    writer: StateWriter, db_url: str, todo_ids: list[int]
) -> None:
    run = claimed(db_url)
    writer.close()
    settled = Settled()
    writer.finish(todos.Ending(run, "done", None, "done"), settled)
    (outcome,) = settled.wait()
    assert "closed" in str(outcome)
    assert status(db_url, todo_ids[0]) == "running"
