"""The workers' state writer (backhalf.lifecycle.state_writer) against real PostgreSQL:
every thread's end committed before it returns, a row another transaction
holds never holding up the other ends (answered busy, asked for again), an
end written again answered as discarded, a connection killed under it
replaced, and an end the database refuses for its data failing alone."""

from __future__ import annotations

import threading

import psycopg
import pytest
from structlog.testing import capture_logs

from backhalf.errors import ChangeRefused
from backhalf.lifecycle import todos
from backhalf.lifecycle.state_writer import StateWriter, refused_for_its_data
from ingest.embedded.processes import wait_for
from tests.support.db import claim, insert_todos, libpq, query, scalar


@pytest.fixture
def runs(db_url: str) -> list[todos.Claimed]:
    """Three todos claimed, as a worker process's claimer would."""
    insert_todos(db_url, 3)
    return claim(db_url)


def done(run: todos.Claimed) -> todos.Ending:
    return todos.Ending(run, "done", None, "done")


def test_ends_are_committed_when_they_return(
    writer: StateWriter, db_url: str, runs: list[todos.Claimed]
) -> None:
    todo_id = runs[0].todo.id
    assert writer.end(done(runs[0])) is True
    assert scalar(db_url, "SELECT status FROM todos WHERE id = %(i)s", {"i": todo_id}) == "done"
    assert query(db_url, "SELECT from_status, to_status FROM todo_events WHERE todo_id = %(i)s ORDER BY id",
                 {"i": todo_id}) == [("pending", "running"), ("running", "done")]  # fmt: skip
    # The same end again (a batch written again after a lost reply): its
    # run no longer holds the todo, so it is answered as discarded.
    assert writer.end(done(runs[0])) is False
    assert scalar(db_url, "SELECT count(*) FROM todo_events WHERE to_status = 'done'") == 1


def test_a_row_held_elsewhere_holds_up_no_other_end(
    writer: StateWriter, db_url: str, runs: list[todos.Claimed]
) -> None:
    """An operator's cancel (or a store deduping to the todo) holds todo 1:
    its end is answered busy and asked again until the row is free; the end
    of todo 2 meanwhile goes through."""
    blocked, free = runs[0], runs[1]
    with psycopg.connect(libpq(db_url)) as holder:
        holder.execute("SELECT 1 FROM todos WHERE id = %s FOR UPDATE", (blocked.todo.id,))
        answers: list[bool] = []
        waiting = threading.Thread(target=lambda: answers.append(writer.end(done(blocked))))
        waiting.start()
        wait_for(lambda: writer.busy_answers >= 1, timeout_s=10, what="the held row's end answered busy")
        # The other end returns while the holder still holds its row: a
        # writer that waited for the row would hold it up until the commit
        # below, which comes only after it.
        assert writer.end(done(free)) is True
        assert waiting.is_alive(), "the held row's end returned before the row was free"
        holder.commit()
    waiting.join(timeout=10)
    assert answers == [True]
    assert dict(query(db_url, "SELECT id, status FROM todos WHERE status = 'done'")) == {
        blocked.todo.id: "done", free.todo.id: "done",
    }  # fmt: skip


def test_a_connection_killed_under_it_is_replaced(
    writer: StateWriter, db_url: str, runs: list[todos.Claimed]
) -> None:
    assert writer.end(done(runs[0])) is True
    with psycopg.connect(libpq(db_url), autocommit=True) as admin:
        killed = admin.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
            " WHERE application_name = 'switchboard-worker'"
        ).fetchone()
    assert killed == (1,)
    # The first try fails on the dead connection; the retry works.
    assert writer.end(done(runs[1])) is True
    assert scalar(db_url, "SELECT count(*) FROM todos WHERE status = 'done'") == 2


def test_a_change_the_database_refuses_for_its_data_fails_alone(
    writer: StateWriter, db_url: str, runs: list[todos.Claimed]
) -> None:
    """An end whose error text PostgreSQL cannot store (a NUL), in one batch
    with good ends: the good ones are written, the bad one refused at once
    (ChangeRefused, no retry of the batch). The batch is made certain by
    holding the writer's previous batch on a table lock until both changes
    are queued behind it."""
    locker = psycopg.connect(libpq(db_url))
    answers: dict[int, object] = {}

    def end(run: todos.Claimed, status: str, error: str | None) -> None:
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
    ids = [r.todo.id for r in runs]
    assert answers[ids[0]] is True
    assert answers[ids[2]] is True
    assert isinstance(answers[ids[1]], ChangeRefused)
    assert query(db_url, "SELECT id, status FROM todos ORDER BY id") == [
        (ids[0], "done"), (ids[1], "running"), (ids[2], "done"),
    ]  # fmt: skip
    events = [e["event"] for e in logs]
    assert "todo_ends_retried" not in events
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
