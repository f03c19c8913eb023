"""Retention against real PostgreSQL: the pruner deletes exactly the rows
past their retention, never a pending ack, a queued intent or an active
todo, in bounded batches; the acker's prune loop runs and stops. Rows are
written and aged with SQL."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from backhalf.db import libpq_url
from backhalf.housekeeping import retention
from backhalf.writes import registry
from ingest.config import Settings, from_mapping
from ingest.processes.ack.prune import Pruner, Walk, prune_loop, walks
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
    if with_event:  # received with its row, as the store writes both
        event_id = db.scalar(
            url,
            "INSERT INTO events (family, adapter, trust_mode, verified, idempotency_key, payload,"
            " received_at) VALUES ('queue', %(a)s, 'queue', false, 'k', '{}',"
            " now() - make_interval(secs => %(age)s))"
            " RETURNING id",
            {"a": adapter, "age": age_days * 86_400},
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
    for _ in range(log_rows):  # written with the todo's last change, as the lifecycle writes them
        db.query(
            url,
            "INSERT INTO todo_events (todo_id, to_status, created_at)"
            " VALUES (%(id)s, %(s)s, now() - make_interval(secs => %(age)s))",
            {"id": todo_id, "s": status, "age": age_days * 86_400},
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
                conn,
                adapters=["orders"],
                status="stored",
                window=retention.Window(age=7 * DAY, cursor=cursor, limit=10),
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


async def test_a_long_held_row_does_not_make_each_run_read_what_follows_it(
    db_url: str, engine: AsyncEngine
) -> None:
    pending = add_inbox(db_url, "orders", age_days=10, ack_state="pending", queued=True)
    # Rows the orders walk reads but never deletes (another adapter's).
    for _ in range(30):
        add_inbox(db_url, "billing", age_days=10)
    acker_pruner = pruner(engine, [Walk("acked", "orders", 7 * DAY)], batch_size=10)

    [first] = await acker_pruner.run()
    assert (first.full_sweep, first.scanned, first.held) == (True, 31, 1)

    # The next run re-checks the held row by id and reads nothing after it
    # again (before: it started just before the held row, 31 rows a run).
    [second] = await acker_pruner.run()
    assert (second.full_sweep, second.scanned, second.held) == (False, 1, 1)
    assert pending in ids(db_url, "inbox")

    # Its ack done (as the acker does it), the re-check deletes it.
    db.query(db_url, "DELETE FROM ack_queue WHERE inbox_id = %(id)s", {"id": pending})
    db.query(db_url, "UPDATE inbox SET ack_state = 'acked' WHERE id = %(id)s", {"id": pending})
    [third] = await acker_pruner.run()
    assert (third.scanned, third.held, third.deleted) == (1, 0, {"inbox": 1, "events": 1})
    assert pending not in ids(db_url, "inbox")
    assert len(ids(db_url, "inbox")) == 30


async def test_rows_that_change_status_behind_the_cursor_go_at_the_next_full_sweep(
    db_url: str, engine: AsyncEngine
) -> None:
    retried = add_todo(db_url, "orders", "failed", age_days=30)
    replayed = add_inbox(db_url, "orders", age_days=30, status="rejected", with_event=False)
    add_todo(db_url, "orders", "done", age_days=1)
    add_inbox(db_url, "orders", age_days=1)
    cfg = settings(
        db_url,
        adapters=[{"name": "orders", "source": "orders", "retain_acked_days": 7, "retain_rejected_days": 90}],
        queues={"orders": {"handler": "m:f", "retain_done_days": 7, "retain_failed_days": 90}},
    )
    clock = [0.0]
    acker_pruner = Pruner(
        engine, walks(cfg), batch_size=10, pause_ms=0, deadline_ms=30_000, clock=lambda: clock[0]
    )
    await acker_pruner.run()
    assert retried in ids(db_url, "todos")
    assert replayed in ids(db_url, "inbox")

    # An operator retries the failed todo and it ends done; the rejected row
    # is replayed and stored. Both are long past the 7 days now, but behind
    # the done and acked walks' cursors.
    db.query(
        db_url,
        "UPDATE todos SET status = 'done', updated_at = now() - interval '8 days' WHERE id = %(id)s",
        {"id": retried},
    )
    db.query(db_url, "UPDATE inbox SET status = 'stored', error = NULL WHERE id = %(id)s", {"id": replayed})
    results = [r for r in await acker_pruner.run() if r.walk.kind != "attempts"]
    assert not any(r.full_sweep for r in results)
    assert retried in ids(db_url, "todos")
    assert replayed in ids(db_url, "inbox")

    clock[0] += acker_pruner.full_sweep_interval_s
    results = [r for r in await acker_pruner.run() if r.walk.kind != "attempts"]
    assert len(results) == 4
    assert all(r.full_sweep for r in results)
    by_kind = {r.walk.kind: r.deleted for r in results}
    assert by_kind["done"] == {"todos": 1, "todo_events": 2}
    assert by_kind["acked"] == {"inbox": 1, "events": 0}
    assert retried not in ids(db_url, "todos")
    assert retried not in todo_event_owners(db_url)
    assert replayed not in ids(db_url, "inbox")


async def test_an_ack_waiting_for_its_todo_keeps_the_row_and_the_todo(
    db_url: str, engine: AsyncEngine
) -> None:
    # ack_after = "complete": the row's ack waits in ack_queue for its todo.
    # Both are long past retention, and the todo even reads done.
    todo = add_todo(db_url, "orders", "done", age_days=30)
    row = add_inbox(db_url, "orders", age_days=30, ack_state="pending", queued=True)
    db.query(db_url, "UPDATE ack_queue SET waiting_for = %(t)s WHERE inbox_id = %(i)s", {"t": todo, "i": row})
    db.query(db_url, "UPDATE inbox SET todo_id = %(t)s WHERE id = %(i)s", {"t": todo, "i": row})
    cfg = settings(
        db_url,
        adapters=[{"name": "orders", "source": "orders", "retain_acked_days": 1, "retain_rejected_days": 1}],
        queues={"orders": {"handler": "m:f", "retain_done_days": 1, "retain_failed_days": 1}},
    )
    acker_pruner = pruner(engine, walks(cfg))

    for _ in range(2):  # a full sweep, then the re-check of held rows by id
        results = await acker_pruner.run()
        assert all(not any(r.deleted.values()) for r in results)
        assert {r.walk.kind: r.held for r in results if r.walk.kind in ("acked", "done")} == {
            "acked": 1,
            "done": 1,
        }
        assert ids(db_url, "inbox") == {row}
        assert ids(db_url, "todos") == {todo}
        assert todo_event_owners(db_url) == {todo}
        assert db.query(db_url, "SELECT inbox_id, waiting_for FROM ack_queue") == [(row, todo)]


async def test_a_row_another_transaction_holds_is_skipped_not_waited_for_and_kept(
    db_url: str, engine: AsyncEngine
) -> None:
    held = add_inbox(db_url, "orders", age_days=10)
    others = [add_inbox(db_url, "orders", age_days=10) for _ in range(3)]
    acker_pruner = pruner(engine, [Walk("acked", "orders", 7 * DAY)])
    # A redelivery of the acked row, mid-run: its transaction locks the row
    # and makes its ack owed again, and has not committed yet.
    with psycopg.connect(libpq_url(db_url), connect_timeout=10) as redelivery:
        redelivery.execute("SELECT id FROM inbox WHERE id = %(id)s FOR UPDATE", {"id": held})
        redelivery.execute("UPDATE inbox SET ack_state = 'pending' WHERE id = %(id)s", {"id": held})
        redelivery.execute(
            "INSERT INTO ack_queue (inbox_id, adapter, ack_kind, ack_key, idempotency_key)"
            " SELECT id, adapter, ack_kind, ack_key, idempotency_key FROM inbox WHERE id = %(id)s",
            {"id": held},
        )
        async with asyncio.timeout(10):  # SKIP LOCKED: no wait for the lock
            [result] = await acker_pruner.run()
        assert (result.deleted["inbox"], result.held) == (3, 1)
        assert ids(db_url, "inbox") == {held}
        redelivery.commit()
    assert not set(others) & ids(db_url, "inbox")

    # Re-checked on its newest version: pending now, so kept.
    [again] = await acker_pruner.run()
    assert (again.deleted["inbox"], again.held) == (0, 1)
    assert db.query(db_url, "SELECT id, ack_state FROM inbox") == [(held, "pending")]
    assert db.query(db_url, "SELECT inbox_id FROM ack_queue") == [(held,)]


async def test_a_dry_run_counts_every_stale_delivery_attempt(db_url: str, engine: AsyncEngine) -> None:
    db.query(
        db_url,
        "INSERT INTO delivery_attempts (adapter, idempotency_key, attempts, last_attempt_at)"
        " SELECT 'orders', 'old' || n, 1, now() - interval '8 days' FROM generate_series(1, 7) AS n"
        " UNION ALL SELECT 'orders', 'new' || n, 1, now() FROM generate_series(1, 2) AS n"
        " UNION ALL SELECT 'billing', 'old' || n, 1, now() - interval '8 days'"
        " FROM generate_series(1, 4) AS n",
    )
    walk = Walk("attempts", "orders", 7 * DAY)

    # More than one batch's worth: all counted, not capped at batch_size.
    [dry] = await pruner(engine, [walk], batch_size=3).run(dry_run=True)
    assert (dry.deleted, dry.scanned, dry.finished) == ({"delivery_attempts": 7}, 9, True)
    assert db.scalar(db_url, "SELECT count(*) FROM delivery_attempts") == 13

    [real] = await pruner(engine, [walk], batch_size=3).run()
    assert real.deleted == {"delivery_attempts": 7}
    left = db.query(db_url, "SELECT adapter, count(*) FROM delivery_attempts GROUP BY 1 ORDER BY 1")
    assert left == [("billing", 4), ("orders", 2)]


async def test_adapters_with_the_same_retention_share_one_read_of_the_inbox(
    db_url: str, engine: AsyncEngine
) -> None:
    rows = {name: [add_inbox(db_url, name, age_days=10) for _ in range(4)] for name in ("orders", "billing")}
    kept = add_inbox(db_url, "billing", age_days=10, ack_state="pending", queued=True)
    cfg = settings(
        db_url,
        adapters=[
            {"name": "orders", "source": "orders", "retain_acked_days": 7},
            {"name": "billing", "source": "billing", "retain_acked_days": 7},
        ],
    )
    acker_pruner = pruner(engine, walks(cfg), batch_size=4)
    assert [tuple(w.name for w in unit) for unit in acker_pruner.units() if unit[0].kind == "acked"] == [
        ("orders", "billing")
    ]

    results = [r for r in await acker_pruner.run() if r.walk.kind == "acked"]

    # One read of the 9 rows for both adapters (before: 9 rows each), the
    # deletions counted by adapter.
    assert [(r.walk.name, r.scanned, r.deleted) for r in results] == [
        ("orders", 9, {"inbox": 4, "events": 4}),
        ("billing", 9, {"inbox": 4, "events": 4}),
    ]
    assert ids(db_url, "inbox") == {kept}
    assert not set(rows["orders"] + rows["billing"]) & ids(db_url, "inbox")
    assert results[1].held == 1


async def test_held_rows_past_the_bound_are_found_by_the_next_full_sweep(
    db_url: str, engine: AsyncEngine
) -> None:
    first, second = (add_inbox(db_url, "orders", age_days=10, ack_state="pending", queued=True) for _ in "ab")
    clock = [0.0]
    acker_pruner = Pruner(
        engine,
        [Walk("acked", "orders", 7 * DAY)],
        batch_size=10,
        pause_ms=0,
        deadline_ms=30_000,
        held_limit=1,
        clock=lambda: clock[0],
    )
    [result] = await acker_pruner.run()
    assert result.held == 1  # the bound: the second is not remembered
    db.query(db_url, "DELETE FROM ack_queue")
    db.query(db_url, "UPDATE inbox SET ack_state = 'acked'")

    [result] = await acker_pruner.run()
    assert (result.full_sweep, result.deleted["inbox"]) == (False, 1)
    assert ids(db_url, "inbox") == {second}

    clock[0] += acker_pruner.full_sweep_interval_s
    [result] = await acker_pruner.run()
    assert (result.full_sweep, result.deleted["inbox"]) == (True, 1)
    assert ids(db_url, "inbox") == set()
    assert first not in ids(db_url, "inbox")


MINUTE_DAYS = 1 / 1440


async def test_no_walk_deletes_a_row_younger_than_its_floor_whatever_its_age(
    db_url: str, engine: AsyncEngine
) -> None:
    """Issue 43: a retention set below the config's minimums (a walk built
    by hand, a config that skipped its checks) still keeps every row younger
    than its floor: an hour for a queue adapter's rows, a todo and a delivery
    attempt; three days (the senders' retry span) for a webhook adapter's,
    whose inbox row is all that dedups a sender's retry."""
    async with engine.begin() as conn:
        await registry.register(
            conn, name="gh", family="push", transport="webhook", mode="github", settings={}
        )
    # Oldest first, as ids follow time.
    old_push = add_inbox(db_url, "gh", age_days=4)
    young_push = add_inbox(db_url, "gh", age_days=2)
    old_pull = add_inbox(db_url, "orders", age_days=120 * MINUTE_DAYS)
    young_pull = add_inbox(db_url, "orders", age_days=30 * MINUTE_DAYS)
    young = {young_push, young_pull}
    old_todo = add_todo(db_url, "orders", "done", age_days=120 * MINUTE_DAYS)
    young_todo = add_todo(db_url, "orders", "done", age_days=30 * MINUTE_DAYS)
    db.query(
        db_url,
        "INSERT INTO delivery_attempts (adapter, idempotency_key, attempts, last_attempt_at) VALUES"
        " ('orders', 'young', 3, now() - interval '30 minutes'),"
        " ('orders', 'old', 3, now() - interval '2 hours')",
    )
    minute = timedelta(minutes=1)
    found = [
        Walk("acked", "orders", minute),
        Walk("acked", "gh", DAY),
        Walk("done", "orders", minute),
        Walk("attempts", "orders", minute),
    ]

    # A dry run counts what the real run deletes: the old rows only.
    dry = {(r.walk.name, r.walk.kind): r.deleted for r in await pruner(engine, found).run(dry_run=True)}
    results = {(r.walk.name, r.walk.kind): r.deleted for r in await pruner(engine, found).run()}

    assert results == dry
    assert results[("orders", "acked")] == {"inbox": 1, "events": 1}
    assert results[("gh", "acked")] == {"inbox": 1, "events": 1}
    assert results[("orders", "done")] == {"todos": 1, "todo_events": 2}
    assert results[("orders", "attempts")] == {"delivery_attempts": 1}
    assert ids(db_url, "inbox") == young
    assert {old_push, old_pull}.isdisjoint(ids(db_url, "inbox"))
    assert ids(db_url, "events") == {event_of(db_url, i) for i in young}
    assert ids(db_url, "todos") == {young_todo}
    assert todo_event_owners(db_url) == {young_todo}
    assert old_todo not in ids(db_url, "todos")
    assert db.query(db_url, "SELECT idempotency_key FROM delivery_attempts") == [("young",)]


async def test_a_row_waits_for_its_younger_event_so_no_event_is_left_behind(
    db_url: str, engine: AsyncEngine
) -> None:
    """An inbox replay writes a new event for an old row: the row is past its
    retention, its event is not. The event is deleted only with its row and
    only once it is as old (the delete's own floor), so the row waits for it
    rather than leave it behind, with nothing left to find it by."""
    replayed = add_inbox(db_url, "orders", age_days=10)
    db.query(
        db_url,
        "UPDATE events SET received_at = now() - interval '1 day'"
        " WHERE id = (SELECT event_id FROM inbox WHERE id = %(id)s)",
        {"id": replayed},
    )
    other = add_inbox(db_url, "orders", age_days=10)
    acker_pruner = pruner(engine, [Walk("acked", "orders", 7 * DAY)])

    [result] = await acker_pruner.run()
    assert (result.deleted, result.held) == ({"inbox": 1, "events": 1}, 1)
    assert ids(db_url, "inbox") == {replayed}
    assert ids(db_url, "events") == {event_of(db_url, replayed)}
    assert other not in ids(db_url, "inbox")

    db.query(
        db_url,
        "UPDATE events SET received_at = now() - interval '8 days'"
        " WHERE id = (SELECT event_id FROM inbox WHERE id = %(id)s)",
        {"id": replayed},
    )
    [again] = await acker_pruner.run()
    assert again.deleted == {"inbox": 1, "events": 1}
    assert ids(db_url, "inbox") == set()
    assert ids(db_url, "events") == set()
