"""Inbox replay against real PostgreSQL: a rejected row becomes a todo and an
event once, through the same todo definition as the store."""

from __future__ import annotations

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from backhalf.records import AckTarget, InboxRecord, Provenance, StoreBatch
from backhalf.writes import replay
from backhalf.writes.store import store
from tests.support.db import query, scalar

PULLED = Provenance("queue", "queue", False, "redis acl: deploy-bot")


@pytest.fixture
def registered() -> tuple[tuple[str, str], ...]:
    return (("orders", "stream"), ("orders-mirror", "stream"))


def rec(entry_id: str, *, rejected: bool = False) -> InboxRecord:
    body = b'{"n": 1}'
    error = "invalid_json: x" if rejected else None
    return InboxRecord(f"redis:orders:{entry_id}", entry_id, body, None if rejected else body.decode(), error)


async def store_one(engine: AsyncEngine, adapter: str, record: InboxRecord) -> None:
    ack = AckTarget("xack", "orders", "switchboard", by_cursor=True)
    async with engine.begin() as conn:
        await store(conn, StoreBatch(adapter, "orders", "c1", "store", ack, PULLED, [record]))


async def replay_row(engine: AsyncEngine, inbox_id: int) -> int:
    async with engine.begin() as conn:
        return await replay.replay(
            conn,
            inbox_id,
            queue_for=lambda _: "orders",
            normalize_for=lambda _: lambda body: body.decode(),
            trust_for=lambda _: ("queue", "queue"),
        )


async def test_a_replayed_row_gets_its_todo_its_log_row_and_an_unverified_event(
    engine: AsyncEngine, db_url: str
) -> None:
    await store_one(engine, "orders", rec("1-0", rejected=True))
    (inbox_id,) = query(db_url, "SELECT id FROM inbox")[0]
    todo_id = await replay_row(engine, inbox_id)
    assert query(db_url, "SELECT status, error, todo_id, event_id IS NOT NULL FROM inbox") == [
        ("stored", None, todo_id, True)
    ]
    assert query(db_url, "SELECT queue, idempotency_key, payload, status FROM todos") == [
        ("orders", "redis:orders:1-0", {"n": 1}, "pending")
    ]
    assert query(db_url, "SELECT todo_id, from_status, to_status, detail FROM todo_events") == [
        (todo_id, None, "pending", "created by replay")
    ]
    assert query(
        db_url,
        "SELECT family, adapter, trust_mode, verified, verify_detail, idempotency_key, source_message_id,"
        " payload, todo_id FROM events",
    ) == [
        ("queue", "orders", "queue", False, f"replayed by operator from inbox row {inbox_id}",
         "redis:orders:1-0", "1-0", {"n": 1}, todo_id),
    ]  # fmt: skip


async def test_a_replay_dedups_to_the_active_todo_with_its_key(engine: AsyncEngine, db_url: str) -> None:
    await store_one(engine, "orders", rec("1-0", rejected=True))
    await store_one(engine, "orders-mirror", rec("1-0"))  # the same message, stored by a fan-out adapter
    inbox_id = scalar(db_url, "SELECT id FROM inbox WHERE adapter = 'orders'")
    existing = scalar(db_url, "SELECT id FROM todos")
    assert await replay_row(engine, inbox_id) == existing
    assert scalar(db_url, "SELECT count(*) FROM todos") == 1
    assert query(db_url, "SELECT detail FROM todo_events") == [("created",)]  # the store's, none of ours
    assert scalar(db_url, "SELECT count(*) FROM events WHERE todo_id = %(t)s", {"t": existing}) == 2


async def test_a_row_that_is_not_rejected_is_refused(engine: AsyncEngine, db_url: str) -> None:
    await store_one(engine, "orders", rec("1-0"))
    inbox_id = scalar(db_url, "SELECT id FROM inbox")
    with pytest.raises(replay.ReplayError, match="is stored, not rejected"):
        await replay_row(engine, inbox_id)


async def test_a_row_that_keeps_only_a_prefix_is_refused(engine: AsyncEngine, db_url: str) -> None:
    """An oversize message keeps its first bytes only (issue 11, item 9): a
    replay of them would make a todo of a message that never was."""
    prefix = rec("1-0", rejected=True)._replace(
        body=b'{"n": 1', body_size=9_000_000, body_sha256=b"\x00" * 32
    )
    await store_one(engine, "orders", prefix)
    inbox_id = scalar(db_url, "SELECT id FROM inbox")
    with pytest.raises(replay.ReplayError, match="keeps only the first 7 of its 9000000 bytes"):
        await replay_row(engine, inbox_id)
    assert scalar(db_url, "SELECT count(*) FROM todos") == 0
