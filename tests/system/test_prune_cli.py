"""``switchboard prune [--dry-run] [--json]`` run as the real CLI against
inbox rows, events and todos the test writes and ages with SQL."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support import db
from tests.support.config import stream_adapter
from tests.support.processes import SECRET, switchboard

pytestmark = pytest.mark.system


def seed(url: str) -> None:
    """orders: 6 inbox rows (with events) 10 days old, one of them pending;
    3 done todos 10 days old (2 log rows each) and a running one. Each row's
    linked rows are as old as it is, as the store and the lifecycle write them."""
    db.query(url, "INSERT INTO adapters (name, transport, mode) VALUES ('orders', 'redis', 'stream')")
    db.query(
        url,
        "INSERT INTO events (family, adapter, trust_mode, verified, idempotency_key, payload, received_at)"
        " SELECT 'queue', 'orders', 'queue', false, 'k' || n, '{}', now() - interval '10 days'"
        " FROM generate_series(1, 6) AS n",
    )
    db.query(
        url,
        "INSERT INTO inbox (adapter, idempotency_key, source_message_id, body, ack_kind, ack_state, status,"
        " event_id, stored_at)"
        " SELECT 'orders', 'k' || e.id, e.id::text, 'x', 'xack', CASE WHEN e.id = 6 THEN 'pending' ELSE"
        " 'acked' END, 'stored', e.id, now() - interval '10 days' FROM events e ORDER BY e.id",
    )
    db.query(
        url,
        "INSERT INTO ack_queue (inbox_id, adapter, ack_kind, idempotency_key)"
        " SELECT id, adapter, ack_kind, idempotency_key FROM inbox WHERE ack_state = 'pending'",
    )
    db.query(
        url,
        "INSERT INTO todos (queue, idempotency_key, payload, status, created_at, updated_at)"
        " SELECT 'orders', 't' || n, '{}', CASE WHEN n = 4 THEN 'running' ELSE 'done' END,"
        " now() - interval '10 days', now() - interval '10 days' FROM generate_series(1, 4) AS n",
    )
    db.query(
        url,
        "INSERT INTO todo_events (todo_id, to_status, created_at)"
        " SELECT id, 'pending', now() - interval '10 days' FROM todos, generate_series(1, 2)",
    )


def counts(url: str) -> tuple[int, ...]:
    tables = ("inbox", "events", "todos", "todo_events", "ack_queue")
    return tuple(int(db.scalar(url, f"SELECT count(*) FROM {t}")) for t in tables)


@pytest.fixture
def prune(make_config: Callable[..., Path]) -> Callable[..., tuple[int, str]]:
    config = make_config(
        stream_adapter(retain_acked_days=7),
        queues={"orders": {"handler": "tests.support.handlers:scripted", "retain_done_days": 7}},
        acker={"prune_batch_size": 2},
    )

    def run(*args: str) -> tuple[int, str]:
        result = switchboard("--config", str(config), "prune", *args)
        assert SECRET not in result.stdout + result.stderr
        assert "Traceback" not in result.stderr, result.stderr
        return result.returncode, result.stdout

    return run


def test_a_dry_run_reports_what_would_go_and_changes_nothing(
    db_url: str, prune: Callable[..., tuple[int, str]]
) -> None:
    seed(db_url)
    before = counts(db_url)
    code, out = prune("--dry-run", "--json")
    assert code == 0
    report = json.loads(out)
    assert report["dry_run"] is True
    assert report["owners"] == {
        "adapter orders": {"inbox": 5, "events": 5, "delivery_attempts": 0},
        "queue orders": {"todos": 3, "todo_events": 6},
    }
    assert counts(db_url) == before

    code, out = prune("--dry-run")
    assert code == 0
    assert "adapter orders: would delete inbox 5, events 5, delivery_attempts 0" in out
    assert counts(db_url) == before


def test_prune_deletes_past_retention_and_keeps_pending_work(
    db_url: str, prune: Callable[..., tuple[int, str]]
) -> None:
    seed(db_url)
    code, out = prune()
    assert code == 0
    assert out.splitlines() == [
        "adapter orders: deleted inbox 5, events 5, delivery_attempts 0",
        "queue orders: deleted todos 3, todo_events 6",
    ]
    # Left: the pending row, its event and its queued intent; the running
    # todo and its two log rows.
    assert counts(db_url) == (1, 1, 1, 2, 1)
    assert db.scalar(db_url, "SELECT ack_state FROM inbox") == "pending"
    assert db.scalar(db_url, "SELECT status FROM todos") == "running"
