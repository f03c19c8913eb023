"""The todo lifecycle's statements against real PostgreSQL (backhalf.todos):
who may start a todo, and who may end a run."""

from __future__ import annotations

import psycopg
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from backhalf import todos
from backhalf.db import driver_connection
from tests.support.db import libpq, query, scalar


@pytest.fixture
def todo_id(db_url: str) -> int:
    with psycopg.connect(libpq(db_url), autocommit=True) as conn:
        row = conn.execute(
            "INSERT INTO todos (queue, idempotency_key, payload, status)"
            " VALUES ('q', 'k', '{\"n\": 1}', 'dispatched') RETURNING id"
        ).fetchone()
    assert row is not None
    return int(row[0])


def start(db_url: str, todo_id: int, lease_s: float = 60, max_attempts: int = 5) -> todos.Started:
    with psycopg.connect(libpq(db_url)) as conn:
        return todos.start(conn, todo_id, lease_s, max_attempts, queue="q")


def end(db_url: str, run: todos.Started, to_status: str = "done") -> bool:
    with psycopg.connect(libpq(db_url)) as conn:
        return todos.end_run(conn, run, to_status, error=None, detail=to_status)


def test_a_live_lease_skips_a_second_start_and_an_expired_one_does_not(db_url: str, todo_id: int) -> None:
    first = start(db_url, todo_id, lease_s=60)
    assert first.todo is not None
    assert (first.todo.attempt, first.todo.payload) == (1, {"n": 1})
    again = start(db_url, todo_id)
    assert (again.todo, again.found) == (None, "running")
    query(db_url, "UPDATE todos SET lease_until = now() - interval '1 second'")
    taken = start(db_url, todo_id)
    assert taken.todo is not None
    assert taken.todo.attempt == 2
    assert not end(db_url, first)  # the run whose lease expired no longer holds it
    assert end(db_url, taken)
    assert scalar(db_url, "SELECT status FROM todos") == "done"
    assert start(db_url, todo_id).found == "done"


def test_an_expired_lease_on_the_last_attempt_is_not_taken_over(db_url: str, todo_id: int) -> None:
    """The run the worker died in was the last one allowed: no further run
    starts from a redelivered message; the rescuer fails the todo."""
    assert start(db_url, todo_id, max_attempts=1).todo is not None
    query(db_url, "UPDATE todos SET lease_until = now() - interval '1 second'")
    late = start(db_url, todo_id, max_attempts=1)
    assert (late.todo, late.found) == (None, "running")
    assert scalar(db_url, "SELECT attempts FROM todos") == 1


async def test_a_late_result_after_cancel_and_retry_cannot_end_the_new_run(
    engine: AsyncEngine, db_url: str, todo_id: int
) -> None:
    """Cancelled while running, retried by an operator (attempts back to 0),
    started again as attempt 1: the old run's late result must not end the
    new run, which attempts alone would not tell apart."""
    old = start(db_url, todo_id)
    async with engine.begin() as conn:
        assert await todos.cancel(conn, [todo_id], "cancelled by an operator") == [todo_id]
        assert await todos.retry(conn, [todo_id], "retried by an operator") == [todo_id]
    new = start(db_url, todo_id)
    assert old.todo is not None
    assert new.todo is not None
    assert old.todo.attempt == new.todo.attempt == 1
    assert not end(db_url, old, "failed")
    assert scalar(db_url, "SELECT status FROM todos") == "running"
    assert end(db_url, new)
    assert query(db_url, "SELECT from_status, to_status FROM todo_events ORDER BY id") == [
        ("dispatched", "running"), ("running", "cancelled"), ("cancelled", "pending"),
        ("pending", "running"), ("running", "done"),
    ]  # fmt: skip


async def rescue(
    engine: AsyncEngine, stale_s: float = 10, max_attempts: int = 3
) -> list[tuple[int, str, str]]:
    async with engine.begin() as conn:
        pg = await driver_connection(conn)
        async with pg.cursor() as cur:
            return await todos.rescue(cur, [("q", max_attempts, stale_s)], 100)


async def test_each_rescue_of_a_waiting_todo_doubles_the_wait_before_the_next(
    engine: AsyncEngine, db_url: str, todo_id: int
) -> None:
    """Workers away, a backlog: a todo dispatched long ago is dispatched
    again, but not every interval: after n rescues it waits 2**n times as
    long, so its message has a few copies, not one per rescue interval."""
    aged = "UPDATE todos SET dispatched_at = now() - make_interval(secs => %(s)s)"
    query(db_url, aged, {"s": 11})
    assert await rescue(engine) == [(todo_id, "q", "dispatched")]
    query(db_url, aged, {"s": 15})  # past 10 s, not past 2 x 10 s
    assert await rescue(engine) == []
    query(db_url, aged, {"s": 21})
    assert await rescue(engine) == [(todo_id, "q", "dispatched")]
    query(db_url, aged, {"s": 39})  # not past 4 x 10 s
    assert await rescue(engine) == []
    assert scalar(db_url, "SELECT rescues FROM todos") == 2
    started = start(db_url, todo_id)
    assert started.todo is not None
    assert scalar(db_url, "SELECT rescues FROM todos") == 0  # a start resets the count


async def test_a_lease_expired_on_the_last_attempt_is_failed_by_the_rescuer(
    engine: AsyncEngine, db_url: str, todo_id: int
) -> None:
    assert start(db_url, todo_id, max_attempts=1).todo is not None
    query(db_url, "UPDATE todos SET lease_until = now() - interval '1 second'")
    assert await rescue(engine, max_attempts=1) == [(todo_id, "q", "failed")]
    assert query(db_url, "SELECT status, last_error FROM todos") == [("failed", todos.LEASE_EXPIRED_ERROR)]
