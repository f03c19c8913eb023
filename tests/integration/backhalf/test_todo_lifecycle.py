"""The todos table as the workers' queue (DESIGN.md section 7b), statement by
statement against real PostgreSQL (backhalf.lifecycle.todos): who may claim a todo,
who may end a run or extend its lease, what the rescuer puts back, and who
is woken. Assertions are on the rows, their todo_events, and the
notifications a LISTEN on another connection receives."""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter

import psycopg
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from backhalf import queries
from backhalf.db import driver_connection
from backhalf.lifecycle import todos
from tests.support.db import claim, end, insert_todos, libpq, listening, query, scalar


def due_in(db_url: str, todo_id: int, seconds: float) -> None:
    query(
        db_url,
        "UPDATE todos SET run_after = now() + make_interval(secs => %(s)s) WHERE id = %(i)s",
        {"s": seconds, "i": todo_id},
    )


def ids(claimed: list[todos.Claimed]) -> list[int]:
    return [c.todo.id for c in claimed]


def events(db_url: str, todo_id: int) -> list[tuple[str | None, str, str | None]]:
    return [
        (f, t, d)
        for f, t, d in query(
            db_url,
            "SELECT from_status, to_status, detail FROM todo_events WHERE todo_id = %(i)s ORDER BY id",
            {"i": todo_id},
        )
    ]


# -- claim_todos ------------------------------------------------------------------


def test_a_claim_takes_only_due_todos_earliest_due_first(db_url: str) -> None:
    first, second, early, later = insert_todos(db_url, 4)
    due_in(db_url, early, -3600)  # due an hour ago: before the others, whatever its id
    due_in(db_url, later, 3600)  # a retry still waiting out its backoff
    assert ids(claim(db_url, limit=1)) == [early]
    assert ids(claim(db_url, limit=10)) == [first, second]
    assert claim(db_url, limit=10) == []
    assert query(db_url, "SELECT status, attempts FROM todos WHERE id = %(i)s", {"i": later}) == [
        ("pending", 0)
    ]
    due_in(db_url, later, -1)
    assert ids(claim(db_url)) == [later]


def test_a_claim_marks_running_counts_the_attempt_leases_and_logs_it(db_url: str) -> None:
    with psycopg.connect(libpq(db_url), autocommit=True) as conn:
        row = conn.execute(
            "INSERT INTO todos (queue, idempotency_key, payload, attempts)"
            " VALUES ('q', 'k-1', '{\"n\": 1, \"s\": \"é\"}', 2) RETURNING id"
        ).fetchone()
    assert row is not None
    todo_id = int(row[0])
    (claimed,) = claim(db_url, lease_s=45)
    assert claimed.todo == todos.Todo(todo_id, "q", {"n": 1, "s": "é"}, "k-1", 3)
    status, attempts, token, lease_left = query(
        db_url, "SELECT status, attempts, run_token, extract(epoch FROM lease_until - now()) FROM todos"
    )[0]
    assert (status, attempts, token) == ("running", 3, claimed.token)
    assert 40 < float(lease_left) <= 45
    assert events(db_url, todo_id) == [("pending", "running", todos.CLAIMED)]
    # Claimed: no other claim takes it while it runs.
    assert claim(db_url) == []


def test_rows_an_older_version_left_dispatched_are_claimed_like_pending_ones(db_url: str) -> None:
    (legacy,) = insert_todos(db_url, 1, status="dispatched")
    (pending,) = insert_todos(db_url, 1, queue="other")
    assert ids(claim(db_url, ["q", "other"])) == [legacy, pending]
    assert events(db_url, legacy) == [("dispatched", "running", todos.CLAIMED)]
    assert scalar(db_url, "SELECT count(*) FROM todos WHERE status = 'running' AND attempts = 1") == 2


def test_a_claim_takes_at_most_its_limit_walking_the_queues_in_the_order_given(db_url: str) -> None:
    a = insert_todos(db_url, 3, queue="a")
    b = insert_todos(db_url, 3, queue="b")
    (c,) = insert_todos(db_url, 1, queue="c")
    assert ids(claim(db_url, ["b", "a"], limit=4)) == sorted([*b, a[0]])
    assert ids(claim(db_url, ["a", "b"], limit=1)) == [a[1]]
    assert ids(claim(db_url, ["a", "b"], limit=10)) == [a[2]]
    # A queue not asked for is left alone.
    assert query(db_url, "SELECT status FROM todos WHERE id = %(i)s", {"i": c}) == [("pending",)]
    assert scalar(db_url, "SELECT count(*) FROM todo_events") == 6


def test_a_claim_skips_rows_another_claim_holds_and_never_waits_for_them(db_url: str) -> None:
    """Two worker processes claiming at once: the first claim's transaction
    is still open (its rows locked) when the second runs; the second takes
    the other rows at once, and together they took each todo once."""
    all_ids = insert_todos(db_url, 6)
    params = {"queues": ["q"], "limits": [3], "limit": 3, "lease_s": 60.0, "detail": todos.CLAIMED}
    with psycopg.connect(libpq(db_url)) as first:
        first.execute("SET lock_timeout = '10s'")
        held = [int(r[0]) for r in first.execute(queries.CLAIM_TODOS, params).fetchall()]
        began = time.monotonic()
        with psycopg.connect(libpq(db_url), autocommit=True) as second:
            second.execute("SET lock_timeout = '10s'")
            other = ids(todos.claim(second, ["q"], 10, 60))
        assert time.monotonic() - began < 5, "the second claim waited for the first's locks"
        first.commit()
    assert held == all_ids[:3]
    assert other == all_ids[3:]
    assert scalar(db_url, "SELECT count(*) FROM todos WHERE status = 'running' AND attempts = 1") == 6


def test_claims_racing_on_separate_connections_split_the_todos_with_no_overlap(db_url: str) -> None:
    insert_todos(db_url, 120)
    taken: list[int] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def worker() -> None:
        try:
            with psycopg.connect(libpq(db_url), autocommit=True) as pg:
                while got := todos.claim(pg, ["q"], 4, 60):
                    with lock:
                        taken.extend(ids(got))
        except BaseException as exc:  # reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert errors == []
    assert len(taken) == 120
    assert Counter(taken).most_common(1)[0][1] == 1, "a todo claimed twice"
    assert query(db_url, "SELECT DISTINCT status, attempts FROM todos") == [("running", 1)]
    assert scalar(db_url, "SELECT count(*) FROM todo_events WHERE to_status = 'running'") == 120


# -- end_runs ---------------------------------------------------------------------


def test_a_run_ends_done_its_lease_and_token_gone(db_url: str) -> None:
    (todo_id,) = insert_todos(db_url, 1)
    (run,) = claim(db_url)
    assert end(db_url, todos.Ending(run, "done", None, "done")) == ({todo_id}, set())
    assert query(db_url, "SELECT status, attempts, lease_until, run_token FROM todos") == [
        ("done", 1, None, None)
    ]
    assert events(db_url, todo_id)[-1] == ("running", "done", "done")
    # Written again (a commit whose reply was lost): answered as discarded,
    # the state as it was.
    assert end(db_url, todos.Ending(run, "failed", "late", "late")) == (set(), set())
    assert scalar(db_url, "SELECT status FROM todos") == "done"


def test_a_retry_waits_out_its_backoff_with_its_attempt_counted(db_url: str) -> None:
    (todo_id,) = insert_todos(db_url, 1)
    (run,) = claim(db_url)
    ending = todos.Ending(run, "pending", "ValueError: boom", "attempt 1 of 5 failed; retried after 30 s",
                          delay_s=30)  # fmt: skip
    assert end(db_url, ending) == ({todo_id}, set())
    status, attempts, error, wait_s = query(
        db_url, "SELECT status, attempts, last_error, extract(epoch FROM run_after - now()) FROM todos"
    )[0]
    assert (status, attempts, error) == ("pending", 1, "ValueError: boom")
    assert 25 < float(wait_s) <= 30
    assert claim(db_url) == []  # not due yet
    assert events(db_url, todo_id)[-1] == ("running", "pending", "attempt 1 of 5 failed; retried after 30 s")
    due_in(db_url, todo_id, -1)
    (again,) = claim(db_url)
    assert again.todo.attempt == 2


def test_a_last_attempt_ends_failed_with_its_error(db_url: str) -> None:
    (todo_id,) = insert_todos(db_url, 1)
    (run,) = claim(db_url)
    assert end(db_url, todos.Ending(run, "failed", "RuntimeError: no", "attempt 1 of 1 failed"))[0] == {
        todo_id
    }
    assert query(db_url, "SELECT status, last_error, lease_until FROM todos") == [
        ("failed", "RuntimeError: no", None)
    ]
    assert claim(db_url) == []


def test_a_claim_given_back_unrun_is_due_now_uncounted_and_wakes_the_workers(db_url: str) -> None:
    first, second = insert_todos(db_url, 2)
    runs = claim(db_url)
    with listening(db_url, queries.TODO_CHANNEL) as received:
        held, busy = end(
            db_url, *(todos.Ending(r, "pending", None, todos.GIVEN_BACK, unrun=True) for r in runs)
        )
        assert received(5, 1) == ["q"]  # once for the queue, however many todos
        assert received(0.3) == []
    assert (held, busy) == ({first, second}, set())
    assert query(db_url, "SELECT DISTINCT status, attempts, lease_until, run_token FROM todos") == [
        ("pending", 0, None, None)
    ]
    assert scalar(db_url, "SELECT count(*) FROM todos WHERE run_after <= now()") == 2
    assert events(db_url, first) == [
        ("pending", "running", todos.CLAIMED),
        ("running", "pending", todos.GIVEN_BACK),
    ]
    assert [c.todo.attempt for c in claim(db_url)] == [1, 1]


def test_an_end_without_a_give_back_wakes_no_worker(db_url: str) -> None:
    insert_todos(db_url, 1)
    (run,) = claim(db_url)
    with listening(db_url, queries.TODO_CHANNEL) as received:
        end(db_url, todos.Ending(run, "pending", "boom", "retry", delay_s=60))
        assert received(0.5) == []  # not due for a minute: the poll finds it


def test_a_run_whose_token_no_longer_holds_the_todo_is_discarded(db_url: str) -> None:
    (todo_id,) = insert_todos(db_url, 1)
    (run,) = claim(db_url)
    stranger = todos.Claimed(run.todo, uuid.uuid4())
    assert end(db_url, todos.Ending(stranger, "done", None, "done")) == (set(), set())
    assert query(db_url, "SELECT status, run_token FROM todos") == [("running", run.token)]
    assert events(db_url, todo_id) == [("pending", "running", todos.CLAIMED)]
    assert end(db_url, todos.Ending(run, "done", None, "done")) == ({todo_id}, set())


def test_an_end_of_a_row_another_transaction_holds_is_answered_busy_at_once(db_url: str) -> None:
    held_id, free_id = insert_todos(db_url, 2)
    held_run, free_run = claim(db_url)
    with psycopg.connect(libpq(db_url)) as holder:
        holder.execute("SELECT 1 FROM todos WHERE id = %s FOR UPDATE", (held_id,))
        began = time.monotonic()
        with psycopg.connect(libpq(db_url), autocommit=True) as pg:
            pg.execute("SET lock_timeout = '10s'")
            answer = todos.end_runs(
                pg,
                [todos.Ending(held_run, "done", None, "done"), todos.Ending(free_run, "done", None, "done")],
            )
        assert time.monotonic() - began < 5, "the end waited for the held row"
        holder.rollback()
    assert answer == ({free_id}, {held_id})
    assert dict(query(db_url, "SELECT id, status FROM todos")) == {held_id: "running", free_id: "done"}


async def test_a_late_result_after_cancel_and_retry_cannot_end_the_new_run(
    engine: AsyncEngine, db_url: str
) -> None:
    """Cancelled while running, retried by an operator (attempts back to 0),
    claimed again as attempt 1: the old run's late result must not end the
    new run, which attempts alone would not tell apart."""
    (todo_id,) = insert_todos(db_url, 1)
    (old,) = claim(db_url)
    async with engine.begin() as conn:
        assert await todos.cancel(conn, [todo_id], "cancelled by an operator") == [todo_id]
        assert await todos.retry(conn, [todo_id], "retried by an operator") == [todo_id]
    (new,) = claim(db_url)
    assert old.todo.attempt == new.todo.attempt == 1
    assert end(db_url, todos.Ending(old, "failed", "late", "late")) == (set(), set())
    assert scalar(db_url, "SELECT status FROM todos") == "running"
    assert end(db_url, todos.Ending(new, "done", None, "done")) == ({todo_id}, set())
    assert [(f, t) for f, t, _ in events(db_url, todo_id)] == [
        ("pending", "running"), ("running", "cancelled"), ("cancelled", "pending"),
        ("pending", "running"), ("running", "done"),
    ]  # fmt: skip


# -- extend_leases ----------------------------------------------------------------


def lease_left_s(db_url: str, todo_id: int) -> float:
    return float(
        scalar(
            db_url,
            "SELECT extract(epoch FROM lease_until - now()) FROM todos WHERE id = %(i)s",
            {"i": todo_id},
        )
    )


def extend(db_url: str, runs: list[todos.Claimed], lease_s: float) -> dict[int, bool | None]:
    """By todo id, each run's answer (``extend_leases`` answers by run)."""
    with psycopg.connect(libpq(db_url), autocommit=True) as pg:
        answers = todos.extend_leases(pg, runs, lease_s)
    assert set(answers) == {(r.todo.id, r.token) for r in runs}
    return {todo_id: answer for (todo_id, _token), answer in answers.items()}


def test_a_lease_is_extended_for_its_own_run_only(db_url: str) -> None:
    mine, lost = insert_todos(db_url, 2)
    run, lost_run = claim(db_url, lease_s=10)
    query(db_url, "UPDATE todos SET status = 'cancelled' WHERE id = %(i)s", {"i": lost})
    stranger = todos.Claimed(run.todo, uuid.uuid4())
    assert extend(db_url, [run, lost_run], 600) == {mine: True, lost: False}
    assert 590 < lease_left_s(db_url, mine) <= 600
    assert extend(db_url, [stranger], 6000) == {mine: False}
    assert lease_left_s(db_url, mine) <= 600
    # No state changed: no todo_events row.
    assert scalar(db_url, "SELECT count(*) FROM todo_events WHERE to_status <> 'running'") == 0


def test_a_lease_whose_row_another_transaction_holds_is_answered_busy_at_once(db_url: str) -> None:
    (todo_id,) = insert_todos(db_url, 1)
    (run,) = claim(db_url, lease_s=10)
    with psycopg.connect(libpq(db_url)) as holder:
        holder.execute("SELECT 1 FROM todos WHERE id = %s FOR UPDATE", (todo_id,))
        began = time.monotonic()
        with psycopg.connect(libpq(db_url), autocommit=True) as pg:
            pg.execute("SET lock_timeout = '10s'")
            assert todos.extend_leases(pg, [run], 600) == {(todo_id, run.token): None}
        assert time.monotonic() - began < 5
    assert lease_left_s(db_url, todo_id) <= 10
    assert extend(db_url, [run], 600) == {todo_id: True}


# -- rescue_todos -----------------------------------------------------------------


async def rescue(engine: AsyncEngine, queues: list[tuple[str, int]]) -> list[tuple[int, str, str]]:
    async with engine.begin() as conn:
        pg = await driver_connection(conn)
        async with pg.cursor() as cur:
            return await todos.rescue(cur, queues, 100)


def lapse(db_url: str, *todo_ids: int) -> None:
    query(
        db_url,
        "UPDATE todos SET lease_until = now() - interval '1 second' WHERE id = ANY(%(i)s)",
        {"i": list(todo_ids)},
    )


async def test_a_lapsed_lease_is_put_back_due_now_and_the_workers_woken(
    engine: AsyncEngine, db_url: str
) -> None:
    lapsed, live = insert_todos(db_url, 2)
    (other,) = insert_todos(db_url, 1, queue="other")
    lapsed_run, _live_run, _other_run = claim(db_url, ["q", "other"])
    lapse(db_url, lapsed, other)
    with listening(db_url, queries.TODO_CHANNEL) as received:
        async with engine.begin() as conn:
            pg = await driver_connection(conn)
            async with pg.cursor() as cur:
                assert await todos.rescue(cur, [("q", 3)], 100) == [(lapsed, "q", "pending")]
            assert received(0.3) == []  # not committed yet: silence
        assert received(5, 1) == ["q"]
    row = query(
        db_url,
        "SELECT status, attempts, lease_until, run_token, run_after <= now(), last_error FROM todos"
        " WHERE id = %(i)s",
        {"i": lapsed},
    )
    assert row == [("pending", 1, None, None, True, todos.LEASE_EXPIRED_ERROR)]
    assert events(db_url, lapsed)[-1] == ("running", "pending", todos.RESCUED_LEASE)
    # A live lease, and a queue the rescuer was not given, are left alone.
    assert dict(query(db_url, "SELECT id, status FROM todos WHERE id <> %(i)s", {"i": lapsed})) == {
        live: "running", other: "running",
    }  # fmt: skip
    # The run that lost it can no longer end it; the next claim runs it again.
    assert end(db_url, todos.Ending(lapsed_run, "done", None, "done")) == (set(), set())
    (again,) = claim(db_url)
    assert (again.todo.id, again.todo.attempt) == (lapsed, 2)


async def test_a_lapsed_lease_on_the_last_attempt_fails_the_todo(engine: AsyncEngine, db_url: str) -> None:
    (todo_id,) = insert_todos(db_url, 1)
    claim(db_url)
    lapse(db_url, todo_id)
    with listening(db_url, queries.TODO_CHANNEL) as received:
        assert await rescue(engine, [("q", 1)]) == [(todo_id, "q", "failed")]
        assert received(0.5) == []  # nothing to run: no worker woken
    assert query(db_url, "SELECT status, attempts, last_error FROM todos") == [
        ("failed", 1, todos.LEASE_EXPIRED_ERROR)
    ]
    assert events(db_url, todo_id)[-1] == ("running", "failed", todos.RESCUED_LEASE)
    assert await rescue(engine, [("q", 1)]) == []


# -- who is woken -----------------------------------------------------------------


async def test_an_operators_retry_wakes_the_workers_of_its_queues_on_commit(
    engine: AsyncEngine, db_url: str
) -> None:
    (a,) = insert_todos(db_url, 1, queue="a", status="failed")
    (b,) = insert_todos(db_url, 1, queue="b", status="cancelled")
    with listening(db_url, queries.TODO_CHANNEL) as received:
        async with engine.begin() as conn:
            assert await todos.retry(conn, [a, b], "retried by an operator") == [a, b]
            assert received(0.3) == []
        assert sorted(received(5, 2)) == ["a", "b"]
        async with engine.begin() as conn:
            assert await todos.retry(conn, [a], "again") == []  # pending already: nothing retried
        assert received(0.3) == []
    assert ids(claim(db_url, ["a", "b"])) == [a, b]


async def test_a_todo_made_by_replay_wakes_the_workers_on_commit(engine: AsyncEngine, db_url: str) -> None:
    with listening(db_url, queries.TODO_CHANNEL) as received:
        async with engine.begin() as conn:
            todo_id = await todos.create(conn, queue="orders", key="k", payload='{"n": 1}', detail="replayed")
            assert received(0.3) == []
        assert received(5, 1) == ["orders"]
    assert ids(claim(db_url, ["orders"])) == [todo_id]


@pytest.mark.parametrize("status", ["pending", "running"])
async def test_a_cancel_takes_a_todo_out_of_the_queue(engine: AsyncEngine, db_url: str, status: str) -> None:
    (todo_id,) = insert_todos(db_url, 1)
    runs = claim(db_url) if status == "running" else []
    async with engine.begin() as conn:
        assert await todos.cancel(conn, [todo_id], "cancelled by an operator") == [todo_id]
    assert claim(db_url) == []
    assert query(db_url, "SELECT status, lease_until FROM todos") == [("cancelled", None)]
    for run in runs:  # its late end is discarded
        assert end(db_url, todos.Ending(run, "done", None, "done")) == (set(), set())


def test_an_old_claim_of_a_todo_claimed_again_is_answered_lost_beside_the_new(db_url: str) -> None:
    """A process cut off long enough to be rescued may hold an old claim of
    a todo it then claims again: each run gets its own answer, by token."""
    (todo_id,) = insert_todos(db_url, 1)
    (old,) = claim(db_url, lease_s=10)
    query(db_url, "UPDATE todos SET status = 'pending', run_token = NULL WHERE id = %(i)s", {"i": todo_id})
    (new,) = claim(db_url, lease_s=10)
    with psycopg.connect(libpq(db_url), autocommit=True) as pg:
        answers = todos.extend_leases(pg, [old, new], 600)
    assert answers == {(todo_id, old.token): False, (todo_id, new.token): True}
