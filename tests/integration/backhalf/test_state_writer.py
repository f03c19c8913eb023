"""The workers' state writer (backhalf.state_writer) against real PostgreSQL:
every thread's change committed before it returns, a row another
transaction holds never holding up the other changes, and a connection
killed under it replaced."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator

import psycopg
import pytest

from backhalf import todos
from backhalf.db import DatabaseSettings, create_sync_engine
from backhalf.state_writer import StateWriter
from ingest.embedded.processes import wait_for
from tests.support.db import libpq, query, scalar


@pytest.fixture
def todo_ids(db_url: str) -> list[int]:
    with psycopg.connect(libpq(db_url), autocommit=True) as conn:
        rows = conn.execute(
            "INSERT INTO todos (queue, idempotency_key, payload, status)"
            " SELECT 'q', 'k' || g, '{}', 'dispatched' FROM generate_series(1, 3) g RETURNING id"
        ).fetchall()
    return sorted(int(r[0]) for r in rows)


@pytest.fixture
def writer(db_url: str) -> Iterator[StateWriter]:
    w = StateWriter(
        create_sync_engine(DatabaseSettings(url=db_url), pool_size=1), deadline_ms=10_000, threads=4
    )
    yield w
    w.close()


def test_changes_are_committed_when_they_return(
    writer: StateWriter, db_url: str, todo_ids: list[int]
) -> None:
    started = writer.start(todo_ids[0], 60, 5)
    assert started.todo is not None
    assert scalar(db_url, "SELECT status FROM todos WHERE id = %(i)s", {"i": todo_ids[0]}) == "running"
    assert writer.end(todos.Ending(started, "done", None, "done"))
    assert query(db_url, "SELECT from_status, to_status FROM todo_events ORDER BY id") == [
        ("dispatched", "running"),
        ("running", "done"),
    ]
    assert writer.start(todo_ids[0], 60, 5).found == "done"  # a redelivery: skipped


def test_a_row_held_elsewhere_holds_up_no_other_change(
    writer: StateWriter, db_url: str, todo_ids: list[int]
) -> None:
    """The relay holds todo 1 (its message overtook its commit): the start
    of todo 1 is answered busy and asked again until the row is free; the
    start of todo 2 meanwhile goes through."""
    blocked, free = todo_ids[0], todo_ids[1]
    with psycopg.connect(libpq(db_url)) as relay:
        relay.execute("SELECT 1 FROM todos WHERE id = %s FOR UPDATE", (blocked,))
        answers: list[todos.Started] = []
        waiting = threading.Thread(target=lambda: answers.append(writer.start(blocked, 60, 5)))
        waiting.start()
        wait_for(lambda: writer.busy_answers >= 1, timeout_s=10, what="the held row's start answered busy")
        # The other start returns while the relay still holds its row: a
        # writer that waited for the row would hold it up until the commit
        # below, which comes only after it.
        other = writer.start(free, 60, 5)
        assert other.todo is not None
        assert waiting.is_alive(), "the held row's start returned before the row was free"
        relay.commit()
    waiting.join(timeout=10)
    (answer,) = answers
    assert answer.todo is not None
    assert answer.todo.id == blocked
    assert scalar(db_url, "SELECT count(*) FROM todo_events WHERE to_status = 'running'") == 2


def test_a_start_written_again_finds_its_own_run(db_url: str, todo_ids: list[int]) -> None:
    """A start whose commit succeeded but whose reply was lost is written
    again with the same run token: it is answered as started (the run goes
    on), not skipped as running under a live lease, and counts no second
    attempt."""
    token = uuid.uuid4()
    with psycopg.connect(libpq(db_url), autocommit=True) as conn:
        _, _, (first,) = todos.write_states(conn, [], [(todo_ids[0], token, 60, 5)])
        _, _, (again,) = todos.write_states(conn, [], [(todo_ids[0], token, 60, 5)])
        _, _, (other,) = todos.write_states(conn, [], [(todo_ids[0], uuid.uuid4(), 60, 5)])
    assert first.todo is not None
    assert again.todo == first.todo
    assert again.token == first.token
    assert (other.todo, other.found) == (None, "running")  # another message for it: skipped
    assert scalar(db_url, "SELECT attempts FROM todos WHERE id = %(i)s", {"i": todo_ids[0]}) == 1
    assert scalar(db_url, "SELECT count(*) FROM todo_events") == 1


def test_a_connection_killed_under_it_is_replaced(
    writer: StateWriter, db_url: str, todo_ids: list[int]
) -> None:
    assert writer.start(todo_ids[0], 60, 5).todo is not None
    with psycopg.connect(libpq(db_url), autocommit=True) as admin:
        killed = admin.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
            " WHERE application_name = 'switchboard-worker'"
        ).fetchone()
    assert killed == (1,)
    started = writer.start(todo_ids[1], 60, 5)  # the first try fails on the dead connection; the retry works
    assert started.todo is not None
    assert scalar(db_url, "SELECT count(*) FROM todos WHERE status = 'running'") == 2
