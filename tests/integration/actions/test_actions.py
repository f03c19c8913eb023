"""The action layer (:mod:`ingest.actions`) called as a front end calls it,
against rows the tests write with SQL: assertions are on the typed outcomes
and on what PostgreSQL holds afterwards. The CLI's formatting of the same
outcomes is pinned by tests/system/test_todos_cli.py, test_cli.py and
test_operator_commands.py."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from backhalf.reads.inbox_views import ReplayFilter
from ingest.actions import adapters, inbox, todos
from ingest.actions.outcomes import Refused
from ingest.config import Settings, from_mapping
from tests.support import db


@pytest.fixture
def registered() -> tuple[tuple[str, str], ...]:
    return (("orders", "stream"), ("billing", "stream"))


@pytest.fixture
def settings(db_url: str) -> Settings:
    """``orders`` configured; ``billing`` registered (by ``engine``) but no longer configured."""
    adapter = {"name": "orders", "mode": "stream", "source": "orders"}
    return from_mapping({"database": {"url": db_url}, "adapters": [adapter]}, {})


def insert_todo(db_url: str, key: str, status: str, *, attempts: int = 0) -> int:
    return int(
        db.scalar(
            db_url,
            "INSERT INTO todos (queue, idempotency_key, payload, status, attempts)"
            " VALUES ('orders', %(k)s, '{}'::jsonb, %(s)s, %(a)s) RETURNING id",
            {"k": key, "s": status, "a": attempts},
        )
    )


def todo_state(db_url: str, todo_id: int) -> tuple[Any, ...]:
    (row,) = db.query(db_url, "SELECT status, attempts FROM todos WHERE id = %(i)s", {"i": todo_id})
    return row


def events_of(db_url: str, todo_id: int) -> list[tuple[Any, ...]]:
    return db.query(
        db_url,
        "SELECT from_status, to_status, detail FROM todo_events WHERE todo_id = %(i)s ORDER BY id",
        {"i": todo_id},
    )


def reject(db_url: str, adapter: str, n: int, error: str, body: bytes) -> int:
    return int(
        db.scalar(
            db_url,
            "INSERT INTO inbox (adapter, idempotency_key, source_message_id, body, ack_kind, ack_state,"
            " status, error, stored_at) VALUES (%(a)s, %(k)s, %(m)s, %(b)s, 'xack', 'acked', 'rejected',"
            " %(e)s, now() - interval '1 hour') RETURNING id",
            {"a": adapter, "k": f"redis:{adapter}:{n}-0", "m": f"{n}-0", "b": body, "e": error},
        )
    )


def snapshot(db_url: str) -> list[Any]:
    return [
        db.query(db_url, "SELECT id, status, error, todo_id, event_id FROM inbox ORDER BY id"),
        db.query(db_url, "SELECT id, status, attempts FROM todos ORDER BY id"),
        db.query(db_url, "SELECT id FROM events ORDER BY id"),
        db.query(db_url, "SELECT id FROM todo_events ORDER BY id"),
    ]


# -- todos ----------------------------------------------------------------------


async def test_retry_makes_a_failed_todo_pending_with_attempts_reset(
    engine: AsyncEngine, db_url: str
) -> None:
    failed = insert_todo(db_url, "k-failed", "failed", attempts=5)
    assert await todos.retry(engine, failed) == todos.Retried(failed, was="failed")
    assert todo_state(db_url, failed) == ("pending", 0)
    assert events_of(db_url, failed) == [("failed", "pending", todos.RETRIED_BY_OPERATOR)]


async def test_retry_of_a_todo_not_failed_or_cancelled_is_refused_and_changes_nothing(
    engine: AsyncEngine, db_url: str
) -> None:
    done = insert_todo(db_url, "k-done", "done", attempts=1)
    failed = insert_todo(db_url, "k-held", "failed", attempts=3)
    holder = insert_todo(db_url, "k-held", "pending")
    before = snapshot(db_url)
    assert await todos.retry(engine, done) == Refused(
        f"todo {done} is done, not failed or cancelled: only those can be retried"
    )
    assert await todos.retry(engine, 424242) == Refused("todo 424242 does not exist")
    assert await todos.retry(engine, failed) == Refused(
        f"todo {failed} was not retried: todo {holder} (pending) is the active todo of queue 'orders'"
        f" and key 'k-held', and a key has one active todo at a time (cancel todo {holder}, or let it"
        " finish, first)"
    )
    assert snapshot(db_url) == before


async def test_cancel_cancels_an_active_todo_and_refuses_a_finished_one(
    engine: AsyncEngine, db_url: str
) -> None:
    running = insert_todo(db_url, "k-running", "running", attempts=1)
    done = insert_todo(db_url, "k-done", "done", attempts=1)
    assert await todos.cancel(engine, running) == todos.Cancelled(running, was="running")
    assert todo_state(db_url, running) == ("cancelled", 1)
    assert events_of(db_url, running) == [("running", "cancelled", todos.CANCELLED_BY_OPERATOR)]

    before = snapshot(db_url)
    assert await todos.cancel(engine, done) == Refused(
        f"todo {done} is done, already finished: only pending, dispatched or running todos can be cancelled"
    )
    assert await todos.cancel(engine, running) == Refused(
        f"todo {running} is cancelled, already finished:"
        " only pending, dispatched or running todos can be cancelled"
    )
    assert snapshot(db_url) == before


# -- inbox ----------------------------------------------------------------------


async def test_replay_one_stores_a_rejected_row_and_refuses_what_still_fails(
    engine: AsyncEngine, settings: Settings, db_url: str
) -> None:
    fixed = reject(db_url, "orders", 1, "schema_mismatch: at /n", b'{"n": 1}')
    poison = reject(db_url, "orders", 2, "invalid_json: line 1", b"not json")
    unconfigured = reject(db_url, "billing", 3, "schema_mismatch: at /n", b'{"n": 3}')

    outcome = await inbox.replay_one(engine, settings, fixed)
    assert isinstance(outcome, inbox.Replayed)
    assert outcome.inbox_id == fixed
    assert db.query(db_url, "SELECT status, error, todo_id FROM inbox WHERE id = %(i)s", {"i": fixed}) == [
        ("stored", None, outcome.todo_id)
    ]
    assert db.query(db_url, "SELECT queue, payload FROM todos") == [("orders", {"n": 1})]
    assert db.scalar(db_url, "SELECT count(*) FROM events") == 1

    before = snapshot(db_url)
    refused = await inbox.replay_one(engine, settings, poison)
    assert isinstance(refused, Refused)
    assert refused.reason.startswith(f"inbox row {poison} is still rejected: invalid_json")
    assert await inbox.replay_one(engine, settings, fixed) == Refused(
        f"inbox row {fixed} is stored, not rejected"
    )
    missing = await inbox.replay_one(engine, settings, unconfigured)
    assert isinstance(missing, Refused)
    assert missing.reason.startswith(f"inbox row {unconfigured}: ")
    assert "billing" in missing.reason
    assert snapshot(db_url) == before


async def test_a_dry_run_of_a_bulk_replay_says_each_rows_fate_and_changes_nothing(
    engine: AsyncEngine, settings: Settings, db_url: str
) -> None:
    rows = [
        reject(db_url, "orders", 1, "schema_mismatch: at /n", b'{"n": 1}'),
        reject(db_url, "orders", 2, "invalid_json: line 1", b"not json"),
        reject(db_url, "orders", 3, "schema_mismatch: at /n", b'{"n": 3}'),
    ]
    before = snapshot(db_url)
    where = ReplayFilter(adapter="orders")
    report = await inbox.replay_matching(engine, settings, where, limit=2, dry_run=True)
    assert report.dry_run
    assert [r.id for r in report.selection.rows] == rows[:2]
    assert (report.selection.limit, report.selection.more) == (2, True)
    assert [r.row.id for r in report.rows] == rows[:2]
    first, second = (r.outcome for r in report.rows)
    assert first == inbox.WouldReplay()
    assert isinstance(second, inbox.WouldRefuse)
    assert second.reason.startswith(f"inbox row {rows[1]} is still rejected: invalid_json")
    assert (report.matched, report.stored, report.failed) == (2, 1, 1)
    assert snapshot(db_url) == before


async def test_a_bulk_replay_stores_what_passes_and_reports_each_row(
    engine: AsyncEngine, settings: Settings, db_url: str
) -> None:
    good = reject(db_url, "orders", 1, "schema_mismatch: at /n", b'{"n": 1}')
    poison = reject(db_url, "orders", 2, "invalid_json: line 1", b"not json")
    heard: list[inbox.RowOutcome] = []
    selection = await inbox.select_rejected(engine, ReplayFilter(error_contains="MISMATCH"))
    assert [r.id for r in selection.rows] == [good]
    report = await inbox.replay_selection(engine, settings, selection, on_row=heard.append)
    assert list(report.rows) == heard
    (done,) = report.rows
    todo_id = db.scalar(db_url, "SELECT todo_id FROM inbox WHERE id = %(i)s", {"i": good})
    assert done.outcome == inbox.Replayed(good, todo_id)
    assert (report.matched, report.stored, report.failed) == (1, 1, 0)

    report = await inbox.replay_matching(engine, settings, ReplayFilter(adapter="orders"))
    (refused,) = report.rows
    assert refused.row.id == poison
    assert isinstance(refused.outcome, Refused)
    assert (report.dry_run, report.matched, report.stored, report.failed) == (False, 1, 0, 1)
    assert dict(db.query(db_url, "SELECT id, status FROM inbox")) == {good: "stored", poison: "rejected"}


# -- adapters -------------------------------------------------------------------


async def test_enable_and_disable_set_the_flag_and_refuse_an_unknown_adapter(
    engine: AsyncEngine, db_url: str
) -> None:
    def flags() -> list[tuple[Any, ...]]:
        return db.query(db_url, "SELECT name, enabled FROM adapters ORDER BY name")

    assert await adapters.set_enabled(engine, "orders", False) == adapters.EnabledSet("orders", False)
    assert flags() == [("billing", True), ("orders", False)]
    listed = [(r.name, r.enabled) for r in await adapters.list_adapters(engine)]
    assert listed == [("billing", True), ("orders", False)]
    for enabled in (True, False):
        assert await adapters.set_enabled(engine, "ghost", enabled) == Refused(
            "no adapter named 'ghost' is registered (see `switchboard adapters list`)"
        )
    assert flags() == [("billing", True), ("orders", False)]
    assert await adapters.set_enabled(engine, "orders", True) == adapters.EnabledSet("orders", True)
    assert flags() == [("billing", True), ("orders", True)]


def test_outcomes_are_frozen() -> None:
    outcome = todos.Retried(1, was="failed")
    with pytest.raises(AttributeError):
        outcome.was = "cancelled"  # type: ignore[misc]
