"""Retention against real PostgreSQL: the pruner deletes exactly the rows
past their retention, never a pending ack, a queued intent or an active
todo, in bounded batches; the acker's prune loop runs and stops. Rows are
written and aged with SQL."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from backhalf import retention
from ingest.config import Settings, from_mapping
from ingest.prune import Pruner, Walk, prune_loop, walks
from tests.support import db

DAY = timedelta(days=1)


@pytest.fixture
def registered() -> tuple[tuple[str, str], ...]:
    return (("orders", "stream"), ("billing", "stream"))


def add_inbox(
    url: str,
    adapter: str,
    *,
    age_days: float,
    ack_state: str = "acked",
    status: str = "stored",
    queued: bool = False,
    with_event: bool = True,
) -> int:
    """One inbox row stored ``age_days`` ago (and its event); ``queued``: its
    ack intent in ack_queue."""
    event_id = None
    if with_event:
        event_id = db.scalar(
            url,
            "INSERT INTO events (family, adapter, trust_mode, verified, idempotency_key, payload)"
            " VALUES ('queue', %(a)s, 'queue', false, 'k', '{}') RETURNING id",
            {"a": adapter},
        )
    inbox_id = int(
        db.scalar(
            url,
            "INSERT INTO inbox (adapter, idempotency_key, source_message_id, body, ack_kind, ack_key,"
            " ack_group, ack_entry_id, ack_state, status, event_id, stored_at)"
            " VALUES (%(a)s, 'redis:s:' || gen_random_uuid(), gen_random_uuid()::text, 'x', 'xack', 's',"
            " 'g', '1-1', %(state)s, %(status)s, %(event)s, now() - make_interval(secs => %(age)s))"
            " RETURNING id",
            {"a": adapter, "state": ack_state, "status": status, "event": event_id, "age": age_days * 86_400},
        )
    )
    if queued:
        db.query(
            url,
            "INSERT INTO ack_queue (inbox_id, adapter, ack_kind, ack_key, idempotency_key)"
            " SELECT id, adapter, ack_kind, ack_key, idempotency_key FROM inbox WHERE id = %(id)s",
            {"id": inbox_id},
        )
    return inbox_id


def add_todo(url: str, queue: str, status: str, *, age_days: float, log_rows: int = 2) -> int:
    todo_id = int(
        db.scalar(
            url,
            "INSERT INTO todos (queue, idempotency_key, payload, status, created_at, updated_at)"
            " VALUES (%(q)s, gen_random_uuid()::text, '{}', %(s)s,"
            " now() - make_interval(secs => %(age)s), now() - make_interval(secs => %(age)s)) RETURNING id",
            {"q": queue, "s": status, "age": age_days * 86_400},
        )
    )
    for _ in range(log_rows):
        db.query(
            url,
            "INSERT INTO todo_events (todo_id, to_status) VALUES (%(id)s, %(s)s)",
            {"id": todo_id, "s": status},
        )
    return todo_id


def ids(url: str, table: str) -> set[int]:
    assert table in ("inbox", "events", "todos")
    return {row[0] for row in db.query(url, f"SELECT id FROM {table}")}


def todo_event_owners(url: str) -> set[int]:
    return {row[0] for row in db.query(url, "SELECT DISTINCT todo_id FROM todo_events")}


def event_of(url: str, inbox_id: int) -> int:
    return int(db.scalar(url, "SELECT event_id FROM inbox WHERE id = %(id)s", {"id": inbox_id}))


def pruner(engine: AsyncEngine, found: list[Walk], batch_size: int = 1000) -> Pruner:
    return Pruner(engine, found, batch_size=batch_size, pause_ms=0, deadline_ms=30_000)


def settings(url: str, **sections: Any) -> Settings:
    raw: dict[str, Any] = {"database": {"url": url}, **sections}
    return from_mapping(raw, {})


async def test_inbox_rows_past_retention_and_their_events_go_nothing_else(
    db_url: str, engine: AsyncEngine
) -> None:
    # Written oldest first, as ids follow time in the inbox.
    old_rejected = add_inbox(db_url, "orders", age_days=40, status="rejected", with_event=False)
    pending = add_inbox(db_url, "orders", age_days=30, ack_state="pending", queued=True)
    # Inconsistent on purpose: marked acked but its intent still queued. The
    # queue is where the intent lives, so the row stays.
    still_queued = add_inbox(db_url, "orders", age_days=30, ack_state="acked", queued=True)
    pending_unqueued = add_inbox(db_url, "orders", age_days=30, ack_state="pending")
    young_rejected = add_inbox(db_url, "orders", age_days=20, status="rejected", with_event=False)
    billing = [add_inbox(db_url, "billing", age_days=10) for _ in range(3)]
    old = [add_inbox(db_url, "orders", age_days=8, ack_state=s) for s in ("acked", "acked", "none")]
    recent = add_inbox(db_url, "orders", age_days=6)
    newest = add_inbox(db_url, "billing", age_days=0)
    keep_events = {
        event_of(db_url, i) for i in (pending, still_queued, pending_unqueued, recent, *billing, newest)
    }
    cfg = settings(
        db_url,
        adapters=[
            {"name": "orders", "source": "orders", "retain_acked_days": 7, "retain_rejected_days": 30},
            {"name": "billing", "source": "billing", "retain_acked_days": 14},
        ],
    )

    results = await pruner(engine, walks(cfg)).run()

    kept = {pending, still_queued, pending_unqueued, recent, young_rejected, *billing, newest}
    assert ids(db_url, "inbox") == kept
    assert ids(db_url, "events") == keep_events
    by_walk = {(r.walk.name, r.walk.kind): r.deleted for r in results}
    assert by_walk[("orders", "acked")] == {"inbox": len(old), "events": len(old)}
    assert by_walk[("orders", "rejected")] == {"inbox": 1, "events": 0}
    assert by_walk[("billing", "acked")] == {"inbox": 0, "events": 0}
    assert old_rejected not in ids(db_url, "inbox")


async def test_only_terminal_todos_past_retention_go_with_their_todo_events(
    db_url: str, engine: AsyncEngine
) -> None:
    # Oldest first, as ids follow time.
    old_failed = add_todo(db_url, "orders", "failed", age_days=100)
    active = [add_todo(db_url, "orders", s, age_days=50) for s in ("pending", "dispatched", "running")]
    done = add_todo(db_url, "orders", "done", age_days=8)
    cancelled = add_todo(db_url, "orders", "cancelled", age_days=8)
    failed = add_todo(db_url, "orders", "failed", age_days=8)
    recent = add_todo(db_url, "orders", "done", age_days=1)
    awaited = add_todo(db_url, "orders", "done", age_days=8)
    # An ack_after = "complete" intent still waiting for a done todo: kept.
    inbox_id = add_inbox(db_url, "orders", age_days=8, ack_state="pending", queued=True)
    db.query(
        db_url,
        "UPDATE ack_queue SET waiting_for = %(t)s WHERE inbox_id = %(i)s",
        {"t": awaited, "i": inbox_id},
    )
    other = add_todo(db_url, "billing", "done", age_days=8)
    cfg = settings(
        db_url,
        queues={
            "orders": {"handler": "m:f", "retain_done_days": 7, "retain_failed_days": 90},
            "billing": {"handler": "m:f"},
        },
    )

    results = await pruner(engine, walks(cfg)).run()

    kept = {failed, *active, recent, awaited, other}
    assert ids(db_url, "todos") == kept
    assert todo_event_owners(db_url) == kept
    by_kind = {r.walk.kind: r.deleted for r in results}
    assert by_kind == {"done": {"todos": 2, "todo_events": 4}, "failed": {"todos": 1, "todo_events": 2}}
    assert {done, cancelled, old_failed}.isdisjoint(ids(db_url, "todos"))


async def test_batches_are_bounded_by_rows_examined(db_url: str, engine: AsyncEngine) -> None:
    for _ in range(35):
        add_inbox(db_url, "orders", age_days=10)
    counts = []
    cursor = 0
    while True:
        async with engine.begin() as conn:
            batch = await retention.prune_inbox(
                conn, adapter="orders", status="stored", age=7 * DAY, cursor=cursor, limit=10
            )
        counts.append((batch.scanned, batch.deleted["inbox"]))
        if batch.scanned < 10:
            break
        assert batch.last_id is not None
        cursor = batch.last_id
    assert counts == [(10, 10), (10, 10), (10, 10), (5, 5)]
    assert ids(db_url, "inbox") == set()

    for _ in range(35):
        add_inbox(db_url, "orders", age_days=10)
    [result] = await pruner(engine, [Walk("acked", "orders", 7 * DAY)], batch_size=10).run()
    assert (result.batches, result.scanned, result.deleted) == (4, 35, {"inbox": 35, "events": 35})


async def test_a_dry_run_counts_and_deletes_nothing(db_url: str, engine: AsyncEngine) -> None:
    for _ in range(12):
        add_inbox(db_url, "orders", age_days=10)
    add_inbox(db_url, "orders", age_days=10, ack_state="pending", queued=True)
    add_todo(db_url, "orders", "done", age_days=10, log_rows=3)
    before = (ids(db_url, "inbox"), ids(db_url, "events"), ids(db_url, "todos"), todo_event_owners(db_url))
    found = [Walk("acked", "orders", 7 * DAY), Walk("done", "orders", 7 * DAY)]

    results = await pruner(engine, found, batch_size=5).run(dry_run=True)

    assert [r.deleted for r in results] == [{"inbox": 12, "events": 12}, {"todos": 1, "todo_events": 3}]
    after = (ids(db_url, "inbox"), ids(db_url, "events"), ids(db_url, "todos"), todo_event_owners(db_url))
    assert after == before


async def test_a_walk_starts_again_at_the_first_row_it_had_to_keep(db_url: str, engine: AsyncEngine) -> None:
    add_inbox(db_url, "orders", age_days=10)
    pending = add_inbox(db_url, "orders", age_days=10, ack_state="pending", queued=True)
    for _ in range(3):
        add_inbox(db_url, "orders", age_days=10)
    walk = Walk("acked", "orders", 7 * DAY)
    acker_pruner = pruner(engine, [walk], batch_size=2)

    [result] = await acker_pruner.run()
    assert result.deleted["inbox"] == 4
    assert ids(db_url, "inbox") == {pending}

    # Its ack done (as the acker does it), the next run of the same pruner
    # finds it: the walk starts again just before it, not past the rows it read.
    db.query(db_url, "DELETE FROM ack_queue WHERE inbox_id = %(id)s", {"id": pending})
    db.query(db_url, "UPDATE inbox SET ack_state = 'acked' WHERE id = %(id)s", {"id": pending})
    [again] = await acker_pruner.run()
    assert again.deleted["inbox"] == 1
    assert ids(db_url, "inbox") == set()


async def test_stale_delivery_attempts_go_recent_ones_stay(db_url: str, engine: AsyncEngine) -> None:
    db.query(
        db_url,
        "INSERT INTO delivery_attempts (adapter, idempotency_key, attempts, last_attempt_at) VALUES"
        " ('orders', 'old', 3, now() - interval '8 days'), ('orders', 'new', 2, now()),"
        " ('billing', 'old', 1, now() - interval '8 days')",
    )
    [result] = await pruner(engine, [Walk("attempts", "orders", 7 * DAY)]).run()
    assert result.deleted == {"delivery_attempts": 1}
    left = db.query(db_url, "SELECT adapter, idempotency_key FROM delivery_attempts ORDER BY 1, 2")
    assert left == [("billing", "old"), ("orders", "new")]


async def wait_until(condition: Any, timeout_s: float = 10.0) -> None:
    """Poll ``condition`` (a query: the loop runs meanwhile) until true; fail past the timeout."""
    for _ in range(int(timeout_s / 0.05)):
        if condition():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"not true within {timeout_s} s")


async def test_the_acker_prune_loop_prunes_and_stops_on_request(db_url: str, engine: AsyncEngine) -> None:
    cfg = settings(
        db_url,
        adapters=[{"name": "orders", "source": "orders", "retain_acked_days": 1}],
        acker={"prune_interval_ms": 50, "prune_batch_size": 10},
    )
    stop = asyncio.Event()
    task = asyncio.create_task(prune_loop(engine, cfg, stop))
    try:
        add_inbox(db_url, "orders", age_days=2)
        await wait_until(lambda: not ids(db_url, "inbox"))
        # Rows aged after the loop started are found by a later run.
        for _ in range(25):
            add_inbox(db_url, "orders", age_days=2)
        await wait_until(lambda: not ids(db_url, "inbox"))
    finally:
        stop.set()
        async with asyncio.timeout(5):
            await task
    assert task.done()
    assert task.exception() is None
