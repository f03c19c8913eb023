"""The workers' state writer (backhalf.state_writer) against real PostgreSQL:
every thread's change committed before it returns, a row another
transaction holds never holding up the other changes, and a connection
killed under it replaced."""

from __future__ import annotations

import threading
import uuid

import psycopg
import pytest
from structlog.testing import capture_logs

from backhalf import todos
from backhalf.errors import ChangeRefused
from backhalf.state_writer import StateWriter, refused_for_its_data
from ingest.embedded.processes import wait_for
from tests.support.db import insert_todos, libpq, query, scalar


@pytest.fixture
def todo_ids(db_url: str) -> list[int]:
    return insert_todos(db_url, 3)


def test_changes_are_committed_when_they_return(
    writer: StateWriter, db_url: str, todo_ids: list[int]
) -> None:
    started = writer.start(todo_ids[0], "q", 60, 5)
    assert started.todo is not None
    assert scalar(db_url, "SELECT status FROM todos WHERE id = %(i)s", {"i": todo_ids[0]}) == "running"
    assert writer.end(todos.Ending(started, "done", None, "done"))
    assert query(db_url, "SELECT from_status, to_status FROM todo_events ORDER BY id") == [
        ("dispatched", "running"),
        ("running", "done"),
    ]
    assert writer.start(todo_ids[0], "q", 60, 5).found == "done"  # a redelivery: skipped


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
        waiting = threading.Thread(target=lambda: answers.append(writer.start(blocked, "q", 60, 5)))
        waiting.start()
        wait_for(lambda: writer.busy_answers >= 1, timeout_s=10, what="the held row's start answered busy")
        # The other start returns while the relay still holds its row: a
        # writer that waited for the row would hold it up until the commit
        # below, which comes only after it.
        other = writer.start(free, "q", 60, 5)
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
        mine = todos.StartRequest(todo_ids[0], "q", token, 60, 5)
        _, _, (first,) = todos.write_states(conn, [], [mine])
        _, _, (again,) = todos.write_states(conn, [], [mine])
        _, _, (other,) = todos.write_states(conn, [], [mine._replace(token=uuid.uuid4())])
    assert first.todo is not None
    assert again.todo == first.todo
    assert again.token == first.token
    assert (other.todo, other.found) == (None, "running")  # another message for it: skipped
    assert scalar(db_url, "SELECT attempts FROM todos WHERE id = %(i)s", {"i": todo_ids[0]}) == 1
    assert scalar(db_url, "SELECT count(*) FROM todo_events") == 1


def test_a_connection_killed_under_it_is_replaced(
    writer: StateWriter, db_url: str, todo_ids: list[int]
) -> None:
    assert writer.start(todo_ids[0], "q", 60, 5).todo is not None
    with psycopg.connect(libpq(db_url), autocommit=True) as admin:
        killed = admin.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
            " WHERE application_name = 'switchboard-worker'"
        ).fetchone()
    assert killed == (1,)
    # The first try fails on the dead connection; the retry works.
    started = writer.start(todo_ids[1], "q", 60, 5)
    assert started.todo is not None
    assert scalar(db_url, "SELECT count(*) FROM todos WHERE status = 'running'") == 2


def test_a_start_for_a_todo_of_another_queue_is_refused(
    writer: StateWriter, db_url: str, todo_ids: list[int]
) -> None:
    """The statement checks the queue: a message of another queue's actor
    naming this todo starts nothing (the todo is as it was)."""
    assert writer.start(todo_ids[0], "other", 60, 5) == todos.Started(None, todos.FOREIGN)
    assert query(db_url, "SELECT status, attempts FROM todos WHERE id = %(i)s", {"i": todo_ids[0]}) == [
        ("dispatched", 0)
    ]
    assert scalar(db_url, "SELECT count(*) FROM todo_events") == 0


def test_a_change_the_database_refuses_for_its_data_fails_alone(
    writer: StateWriter, db_url: str, todo_ids: list[int]
) -> None:
    """An end whose error text PostgreSQL cannot store (a NUL), in one batch
    with a good end: the good one is written, the bad one refused at once
    (ChangeRefused, no retry of the batch). The batch is made certain by
    holding the writer's previous batch on a table lock until both changes
    are queued behind it."""
    runs = [writer.start(i, "q", 60, 5) for i in todo_ids]
    locker = psycopg.connect(libpq(db_url))
    answers: dict[int, object] = {}

    def end(run: todos.Started, status: str, error: str | None) -> None:
        assert run.todo is not None
        try:
            answers[run.todo.id] = writer.end(todos.Ending(run, status, error, status))
        except ChangeRefused as exc:
            answers[run.todo.id] = exc

    with capture_logs() as logs:
        try:
            locker.execute("LOCK TABLE todo_events IN EXCLUSIVE MODE")
            threads = [threading.Thread(target=end, args=(runs[0], "done", None))]
            threads[0].start()
            wait_for(
                lambda: scalar(db_url, "SELECT count(*) FROM pg_locks WHERE NOT granted") == 1,
                timeout_s=10,
                what="the first batch waiting for the lock",
            )
            threads += [
                threading.Thread(target=end, args=(runs[1], "failed", "bad\x00text")),
                threading.Thread(target=end, args=(runs[2], "done", None)),
            ]
            for t in threads[1:]:
                t.start()
            wait_for(lambda: writer.queued == 2, timeout_s=10, what="both ends queued behind it")
        finally:
            locker.commit()
            locker.close()
        for t in threads:
            t.join(timeout=30)
    assert answers[todo_ids[0]] is True
    assert answers[todo_ids[2]] is True
    assert isinstance(answers[todo_ids[1]], ChangeRefused)
    assert query(db_url, "SELECT id, status FROM todos ORDER BY id") == [
        (todo_ids[0], "done"), (todo_ids[1], "running"), (todo_ids[2], "done"),
    ]  # fmt: skip
    events = [e["event"] for e in logs]
    assert "todo_states_retried" not in events
    assert events.count("todo_state_refused") == 1


@pytest.mark.parametrize(
    ("exc", "refused"),
    [
        (psycopg.errors.CharacterNotInRepertoire("invalid byte sequence for encoding UTF8: 0x00"), True),
        (psycopg.errors.NumericValueOutOfRange("bigint out of range"), True),
        (psycopg.errors.UniqueViolation("duplicate key"), True),
        (psycopg.DataError("PostgreSQL text fields cannot contain NUL (0x00) bytes"), True),
        (UnicodeEncodeError("utf-8", "\udcff", 0, 1, "surrogates not allowed"), True),
        (psycopg.OperationalError("server closed the connection unexpectedly"), False),
        (psycopg.errors.QueryCanceled("canceling statement due to user request"), False),
        (psycopg.errors.AdminShutdown("terminating connection due to administrator command"), False),
        (psycopg.errors.SerializationFailure("could not serialize access"), False),
    ],
)
def test_what_is_refused_for_its_data(exc: BaseException, refused: bool) -> None:
    """Written again, a data error fails again; the others may pass."""
    assert refused_for_its_data(exc) is refused
