"""``switchboard todos list / show / retry / cancel`` run as the real CLI
against todos and todo_events rows the tests write with SQL."""

from __future__ import annotations

import json
import subprocess
import threading
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest

from backhalf.db import libpq_url
from ingest.embedded.processes import wait_for
from tests.support import db
from tests.support.processes import SECRET, error_lines, switchboard

pytestmark = pytest.mark.system

T0 = datetime(2026, 12, 1, 10, 0, 0, tzinfo=UTC)


@pytest.fixture
def todos_cli(make_config: Callable[..., Path]) -> Callable[..., subprocess.CompletedProcess[str]]:
    config = make_config()

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        result = switchboard("--config", str(config), "todos", *args)
        assert SECRET not in result.stdout + result.stderr
        assert "Traceback" not in result.stderr, result.stderr
        return result

    return run


def insert_todo(
    db_url: str,
    key: str,
    status: str,
    *,
    queue: str = "orders",
    attempts: int = 0,
    last_error: str | None = None,
    payload: Any = None,
    updated_at: datetime = T0,
    run_after: datetime = T0,
    lease_until: datetime | None = None,
) -> int:
    todo_id = db.scalar(
        db_url,
        "INSERT INTO todos (queue, idempotency_key, payload, status, attempts, last_error,"
        " created_at, updated_at, run_after, lease_until)"
        " VALUES (%(queue)s, %(key)s, %(payload)s::jsonb, %(status)s, %(attempts)s, %(error)s,"
        " %(created)s, %(updated)s, %(run_after)s, %(lease)s) RETURNING id",
        {
            "queue": queue,
            "key": key,
            "payload": json.dumps({"key": key} if payload is None else payload),
            "status": status,
            "attempts": attempts,
            "error": last_error,
            "created": T0,
            "updated": updated_at,
            "run_after": run_after,
            "lease": lease_until,
        },
    )
    return int(todo_id)


def insert_event(
    db_url: str, todo_id: int, from_status: str | None, to_status: str, detail: str, at: datetime
) -> None:
    db.query(
        db_url,
        "INSERT INTO todo_events (todo_id, from_status, to_status, detail, created_at)"
        " VALUES (%(id)s, %(from)s, %(to)s, %(detail)s, %(at)s)",
        {"id": todo_id, "from": from_status, "to": to_status, "detail": detail, "at": at},
    )


def todo_row(db_url: str, todo_id: int) -> tuple[Any, ...]:
    """Status, attempts, whether it is due now (run_after), lease_until."""
    (row,) = db.query(
        db_url,
        "SELECT status, attempts, run_after <= now(), lease_until FROM todos WHERE id = %(id)s",
        {"id": todo_id},
    )
    return row


def events_of(db_url: str, todo_id: int) -> list[tuple[Any, ...]]:
    return db.query(
        db_url,
        "SELECT from_status, to_status, detail FROM todo_events WHERE todo_id = %(id)s ORDER BY id",
        {"id": todo_id},
    )


def five_todos(db_url: str) -> dict[str, int]:
    """One todo per status, in two queues; ids ascend in this order."""
    return {
        "pending": insert_todo(db_url, "k-pending", "pending"),
        "failed": insert_todo(
            db_url, "k-failed", "failed", attempts=5, last_error="boom:\n  Traceback line\tmore"
        ),
        "cancelled": insert_todo(db_url, "k-cancelled", "cancelled", queue="billing", attempts=2),
        "done": insert_todo(db_url, "k-done", "done", attempts=1),
        "running": insert_todo(
            db_url, "k-running", "running", queue="billing", attempts=1, lease_until=T0 + timedelta(minutes=5)
        ),
    }


# -- list -----------------------------------------------------------------------


def test_list_shows_newest_first_in_columns_with_one_line_errors(todos_cli: Any, db_url: str) -> None:
    ids = five_todos(db_url)
    result = todos_cli("list")
    assert result.returncode == 0, result.stderr
    header, *lines = result.stdout.splitlines()
    assert header.split() == ["ID", "QUEUE", "STATUS", "ATTEMPTS", "UPDATED_AT", "(UTC)", "KEY", "LAST_ERROR"]
    assert [int(line.split()[0]) for line in lines] == sorted(ids.values(), reverse=True)
    failed = next(line for line in lines if int(line.split()[0]) == ids["failed"])
    assert failed.split() == [
        str(ids["failed"]), "orders", "failed", "5", "2026-12-01", "10:00:00", "k-failed",
        "boom:", "Traceback", "line", "more",
    ]  # fmt: skip
    assert failed.endswith("  boom: Traceback line more")  # one line, whitespace collapsed
    # Aligned: every row's STATUS column starts where the header's does.
    at = header.index("STATUS")
    assert all(line[at:].split()[0] in ids for line in lines)


def test_list_filters_by_queue_status_and_limit(todos_cli: Any, db_url: str) -> None:
    ids = five_todos(db_url)

    def listed(*args: str) -> list[int]:
        result = todos_cli("list", "--json", *args)
        assert result.returncode == 0, result.stderr
        return [row["id"] for row in json.loads(result.stdout)]

    assert listed("--status", "failed") == [ids["failed"]]
    assert listed("--queue", "billing") == [ids["running"], ids["cancelled"]]
    assert listed("--queue", "billing", "--status", "cancelled") == [ids["cancelled"]]
    assert listed("--limit", "2") == [ids["running"], ids["done"]]
    assert listed("--queue", "nowhere") == []
    empty = todos_cli("list", "--queue", "billing", "--status", "pending")
    assert (empty.returncode, empty.stdout) == (0, "no todos match\n")


def test_list_json_carries_every_column(todos_cli: Any, db_url: str) -> None:
    ids = five_todos(db_url)
    result = todos_cli("list", "--json", "--status", "failed")
    assert result.returncode == 0, result.stderr
    (row,) = json.loads(result.stdout)
    assert row == {
        "id": ids["failed"],
        "queue": "orders",
        "status": "failed",
        "attempts": 5,
        "idempotency_key": "k-failed",
        "created_at": "2026-12-01T10:00:00+00:00",
        "updated_at": "2026-12-01T10:00:00+00:00",
        "run_after": "2026-12-01T10:00:00+00:00",
        "lease_until": None,
        "last_error": "boom:\n  Traceback line\tmore",
    }


@pytest.mark.parametrize("bad", ["bogus", "PENDING", ""])
def test_an_unknown_status_is_a_one_line_usage_error(todos_cli: Any, db_url: str, bad: str) -> None:
    result = todos_cli("list", "--status", bad)
    assert result.returncode == 2
    assert result.stdout == ""
    (line,) = error_lines(result)
    assert "--status" in line
    assert repr(bad) in line
    assert "'failed'" in line  # names the statuses it takes


# -- show -----------------------------------------------------------------------


def test_show_prints_the_todo_its_payload_and_its_history_in_order(todos_cli: Any, db_url: str) -> None:
    todo_id = insert_todo(
        db_url,
        "redis:orders:1-0",
        "failed",
        attempts=2,
        last_error="ValueError: no\nsecond line",
        payload={"order": 7, "items": ["a", "é"]},
        updated_at=T0 + timedelta(seconds=9),
        run_after=T0 + timedelta(seconds=5),
    )
    other = insert_todo(db_url, "other", "pending")
    # Written out of order: the history is ordered by time, not by row id.
    insert_event(db_url, todo_id, "running", "failed", "handler raised", T0 + timedelta(seconds=9))
    insert_event(db_url, todo_id, None, "pending", "created", T0)
    insert_event(db_url, todo_id, "pending", "running", "claimed", T0 + timedelta(seconds=1))
    insert_event(
        db_url,
        todo_id,
        "running",
        "pending",
        "attempt 1 of 3 failed; retried after 4 s",
        T0 + timedelta(seconds=1, milliseconds=250),
    )
    insert_event(db_url, todo_id, "pending", "running", "claimed", T0 + timedelta(seconds=5, milliseconds=3))
    insert_event(db_url, other, None, "pending", "not this todo's", T0)

    result = todos_cli("show", str(todo_id))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    fields = dict(line.split(None, 1) for line in out.split("payload:")[0].splitlines() if line[:1] != " ")
    assert fields == {
        "id": str(todo_id),
        "queue": "orders",
        "status": "failed",
        "attempts": "2",
        "idempotency_key": "redis:orders:1-0",
        "created_at": "2026-12-01 10:00:00.000 UTC",
        "updated_at": "2026-12-01 10:00:09.000 UTC",
        "run_after": "2026-12-01 10:00:05.000 UTC",
        "lease_until": "-",
        "last_error": "ValueError: no",
        "trace_id": "-",
    }
    assert "second line" in out.split("payload:")[0]
    payload_text = out.split("payload:\n")[1].split("history:")[0]
    assert json.loads(payload_text) == {"order": 7, "items": ["a", "é"]}
    assert payload_text.count("\n") > 3  # pretty-printed, not one line
    history = out.split("history:\n")[1].splitlines()
    assert history[0].split() == ["CREATED_AT", "(UTC)", "CHANGE", "DETAIL"]
    assert [line.split(None, 2)[2].split("  ")[0].strip() for line in history[1:]] == [
        "(new) -> pending",
        "pending -> running",
        "running -> pending",
        "pending -> running",
        "running -> failed",
    ]
    assert history[3].split()[:2] == ["2026-12-01", "10:00:01.250"]
    assert history[3].endswith("attempt 1 of 3 failed; retried after 4 s")
    assert history[5].endswith("handler raised")
    assert "not this todo's" not in out

    as_json = todos_cli("show", str(todo_id), "--json")
    assert as_json.returncode == 0, as_json.stderr
    document = json.loads(as_json.stdout)
    assert document["payload"] == {"order": 7, "items": ["a", "é"]}
    assert document["status"] == "failed"
    assert document["lease_until"] is None
    assert [(e["from_status"], e["to_status"]) for e in document["history"]] == [
        (None, "pending"),
        ("pending", "running"),
        ("running", "pending"),
        ("pending", "running"),
        ("running", "failed"),
    ]


def test_show_of_a_missing_id_is_one_line_naming_it(todos_cli: Any, db_url: str) -> None:
    insert_todo(db_url, "k", "pending")
    for args in (("show", "987654"), ("show", "987654", "--json")):
        result = todos_cli(*args)
        assert result.returncode == 1
        assert result.stdout == ""
        (line,) = error_lines(result)
        assert "987654" in line
        assert "does not exist" in line


# -- retry ----------------------------------------------------------------------


def test_retry_makes_failed_and_cancelled_todos_pending_with_attempts_reset(
    todos_cli: Any, db_url: str
) -> None:
    ids = five_todos(db_url)
    # A failed retry's backoff left it due later: the operator's retry makes it due now.
    db.query(db_url, "UPDATE todos SET run_after = now() + interval '1 hour' WHERE status = 'failed'")
    result = todos_cli("retry", str(ids["failed"]), str(ids["cancelled"]))
    assert result.returncode == 0, result.stderr
    assert error_lines(result) == []
    assert result.stdout.splitlines() == [
        f"todo {ids['failed']}: pending again (was failed), attempts reset to 0",
        f"todo {ids['cancelled']}: pending again (was cancelled), attempts reset to 0",
    ]
    for name in ("failed", "cancelled"):
        assert todo_row(db_url, ids[name]) == ("pending", 0, True, None)
        assert events_of(db_url, ids[name]) == [(name, "pending", "retried by an operator")]
    assert db.scalar(
        db_url, "SELECT updated_at > %(t)s FROM todos WHERE id = %(id)s", {"t": T0, "id": ids["failed"]}
    )
    # The others are untouched.
    assert db.scalar(db_url, "SELECT count(*) FROM todo_events") == 2
    # The history shows it.
    shown = todos_cli("show", str(ids["failed"]))
    assert "failed -> pending" in shown.stdout
    assert "retried by an operator" in shown.stdout


def test_retry_refuses_todos_not_failed_or_cancelled_and_does_the_rest(todos_cli: Any, db_url: str) -> None:
    ids = five_todos(db_url)
    before = {name: todo_row(db_url, i) for name, i in ids.items()}
    result = todos_cli(
        "retry", str(ids["pending"]), str(ids["done"]), "999999", str(ids["failed"]), str(ids["running"])
    )
    assert result.returncode == 1
    assert result.stdout.splitlines() == [
        f"todo {ids['failed']}: pending again (was failed), attempts reset to 0"
    ]
    refusals = error_lines(result)
    assert len(refusals) == 4
    for line, (todo, status) in zip(
        refusals,
        [(ids["pending"], "pending"), (ids["done"], "done"), (999999, None), (ids["running"], "running")],
        strict=True,
    ):
        assert f"todo {todo} " in line
        assert (f"is {status}," in line) if status else ("does not exist" in line)
    for name in ("pending", "done", "running", "cancelled"):
        assert todo_row(db_url, ids[name]) == before[name]
        assert events_of(db_url, ids[name]) == []
    assert todo_row(db_url, ids["failed"])[:2] == ("pending", 0)


def test_retry_is_refused_while_an_active_todo_holds_the_same_queue_and_key(
    todos_cli: Any, db_url: str
) -> None:
    old = insert_todo(db_url, "dup", "failed", attempts=5, last_error="boom")
    holder = insert_todo(db_url, "dup", "running", attempts=1)  # the redelivery's new todo
    elsewhere = insert_todo(db_url, "dup", "cancelled", queue="billing")  # another queue: no conflict
    result = todos_cli("retry", str(old), str(elsewhere))
    assert result.returncode == 1
    (line,) = error_lines(result)
    assert f"todo {old} " in line
    assert f"todo {holder} (running)" in line
    assert "'dup'" in line
    assert result.stdout.splitlines() == [
        f"todo {elsewhere}: pending again (was cancelled), attempts reset to 0"
    ]
    assert todo_row(db_url, old) == ("failed", 5, True, None)
    assert events_of(db_url, old) == []
    assert todo_row(db_url, holder)[0] == "running"
    # Once the holder is finished, the retry goes through.
    db.query(db_url, "UPDATE todos SET status = 'done' WHERE id = %(id)s", {"id": holder})
    again = todos_cli("retry", str(old))
    assert again.returncode == 0, again.stderr
    assert todo_row(db_url, old)[:2] == ("pending", 0)


def test_retry_racing_a_new_active_todo_reports_the_unique_violation_as_a_refusal(
    make_config: Callable[..., Path], db_url: str
) -> None:
    # The holder is inserted in a transaction still open when the retry
    # checks (so the check cannot see it) and committed while the retry's
    # UPDATE waits on it in the unique index: the UPDATE then fails on
    # uq_todos_queue_key_active.
    config = make_config()
    old = insert_todo(db_url, "dup", "failed", attempts=3)
    results: list[subprocess.CompletedProcess[str]] = []
    with psycopg.connect(libpq_url(db_url), connect_timeout=10) as racer:
        holder = racer.execute(
            "INSERT INTO todos (queue, idempotency_key, payload, status)"
            " VALUES ('orders', 'dup', '{}'::jsonb, 'pending') RETURNING id"
        ).fetchone()
        assert holder is not None
        retry = threading.Thread(
            target=lambda: results.append(switchboard("--config", str(config), "todos", "retry", str(old)))
        )
        retry.start()
        try:
            wait_for(
                lambda: db.scalar(
                    db_url,
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                    " AND application_name = 'switchboard' AND wait_event_type = 'Lock'",
                ),
                timeout_s=30,
                what="the retry's UPDATE waiting on the uncommitted holder",
            )
            racer.commit()
        finally:
            retry.join(timeout=60)
    (result,) = results
    assert result.returncode == 1, result.stderr
    assert result.stdout == ""
    (line,) = error_lines(result)
    assert f"todo {old} " in line
    assert f"todo {holder[0]} (pending)" in line
    assert todo_row(db_url, old) == ("failed", 3, True, None)
    assert events_of(db_url, old) == []


# -- cancel ---------------------------------------------------------------------


def test_cancel_cancels_active_todos_with_their_log_rows(todos_cli: Any, db_url: str) -> None:
    ids = five_todos(db_url)
    dispatched = insert_todo(db_url, "k-dispatched", "dispatched")  # as an older version (the relay) left it
    result = todos_cli("cancel", str(ids["pending"]), str(dispatched), str(ids["running"]))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        f"todo {ids['pending']}: cancelled (was pending)",
        f"todo {dispatched}: cancelled (was dispatched)",
        f"todo {ids['running']}: cancelled (was running: its handler finishes, and its result is discarded)",
    ]
    for todo, was in ((ids["pending"], "pending"), (dispatched, "dispatched"), (ids["running"], "running")):
        assert todo_row(db_url, todo)[0] == "cancelled"
        assert events_of(db_url, todo) == [(was, "cancelled", "cancelled by an operator")]
    assert todo_row(db_url, ids["running"])[3] is None  # its lease is gone
    assert db.scalar(db_url, "SELECT count(*) FROM todo_events") == 3
    # A cancelled todo can be retried; then it is pending again.
    retried = todos_cli("retry", str(ids["running"]))
    assert retried.returncode == 0, retried.stderr
    assert events_of(db_url, ids["running"]) == [
        ("running", "cancelled", "cancelled by an operator"),
        ("cancelled", "pending", "retried by an operator"),
    ]


def test_cancel_refuses_finished_and_missing_todos(todos_cli: Any, db_url: str) -> None:
    ids = five_todos(db_url)
    before = {name: todo_row(db_url, i) for name, i in ids.items()}
    result = todos_cli(
        "cancel", str(ids["done"]), str(ids["failed"]), str(ids["cancelled"]), "424242", str(ids["pending"])
    )
    assert result.returncode == 1
    assert result.stdout.splitlines() == [f"todo {ids['pending']}: cancelled (was pending)"]
    refusals = error_lines(result)
    assert len(refusals) == 4
    for line, (todo, status) in zip(
        refusals,
        [(ids["done"], "done"), (ids["failed"], "failed"), (ids["cancelled"], "cancelled"), (424242, None)],
        strict=True,
    ):
        assert f"todo {todo} " in line
        assert (f"is {status}," in line) if status else ("does not exist" in line)
    for name in ("done", "failed", "cancelled", "running"):
        assert todo_row(db_url, ids[name]) == before[name]
        assert events_of(db_url, ids[name]) == []
    assert todo_row(db_url, ids["pending"])[0] == "cancelled"
