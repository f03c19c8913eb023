"""Races of reliable-list recovery, each reproduced step by step against real
servers (found in review): copies must never be counted twice or dropped."""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

import pytest
import redis
from sqlalchemy.ext.asyncio import AsyncEngine

from backhalf.records import AckClaim, AckTarget, InboxRecord, Provenance, StoreBatch
from backhalf.writes import acks
from backhalf.writes.store import store
from ingest.adapters.base import Delivery, OpenLedger
from ingest.adapters.redis.lists import ListAcknowledger, ListAdapter, processing_key
from ingest.config import AdapterConfig, from_mapping
from ingest.processes.intake import to_record
from ingest.processes.pull.poll import ledger_for
from tests.support.db import query, scalar

JOBS = "jobs"
P1 = processing_key(JOBS, "c1")


def cfg(db_url: str, redis_url: str, **kw: Any) -> AdapterConfig:
    raw = {"name": JOBS, "mode": "list", "source": JOBS, "consumer": "c1", "block_ms": 50, **kw}
    return from_mapping(
        {"database": {"url": db_url}, "redis": {"url": redis_url}, "adapters": [raw]}, {}
    ).adapters[0]


def record(body: bytes, ack_key: str) -> InboxRecord:
    key = f"redis:{JOBS}:{hashlib.sha256(body).hexdigest()}"
    return InboxRecord(key, None, body, body.decode(), ack_key=ack_key)


def batch(records: list[InboxRecord], ack_key: str) -> StoreBatch:
    return StoreBatch(
        JOBS,
        JOBS,
        "c1",
        "store",
        AckTarget("lrem", ack_key, by_body=True),
        Provenance("queue", "queue", False, "redis acl: x"),
        records,
    )


@pytest.fixture
def registered() -> tuple[tuple[str, str], ...]:
    return (("jobs", "list"),)


@pytest.fixture
def ledger(engine: AsyncEngine) -> OpenLedger:
    return ledger_for(engine, JOBS)


async def store_deliveries(
    engine: AsyncEngine, adapter_cfg: AdapterConfig, deliveries: list[Delivery]
) -> None:
    async with engine.begin() as conn:
        await store(conn, batch([to_record(d, adapter_cfg) for d in deliveries], P1))


def pending_matches_list(db_url: str, r: redis.Redis) -> None:
    """The invariant: pending copies per body equal copies stored but not removed."""
    pending: dict[bytes, int] = {}
    for body, copies in query(db_url, "SELECT body, ack_copies FROM inbox WHERE ack_state = 'pending'"):
        pending[bytes(body)] = pending.get(bytes(body), 0) + copies
    on_list: dict[bytes | str, int] = {}  # bytes: the client does not decode
    for body in r.lrange(P1, 0, -1):
        on_list[body] = on_list.get(body, 0) + 1
    assert pending == on_list


async def test_copy_merging_into_a_row_being_acked_gets_its_own_todo(
    engine: AsyncEngine, db_url: str
) -> None:
    body = b'{"job": 1}'
    async with engine.begin() as conn:
        await store(conn, batch([record(body, P1)], P1))
    query(db_url, "UPDATE todos SET status = 'done'")  # a worker finished it
    async with engine.begin() as acker_tx:
        assert len(await acks.claim(acker_tx, [JOBS], 10)) == 1  # marked acked, not committed

        async def second_copy() -> None:
            async with engine.begin() as conn:
                await store(conn, batch([record(body, P1)], P1))

        task = asyncio.create_task(second_copy())
        async with asyncio.timeout(10):  # the second store waits on the acker's row lock
            while not scalar(db_url, "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"):  # noqa: ASYNC110
                await asyncio.sleep(0.02)
    await task  # the acker committed: the old row is no longer pending
    rows = query(
        db_url, "SELECT ack_state, status, todo_id IS NOT NULL, event_id IS NOT NULL FROM inbox ORDER BY id"
    )
    assert rows == [("acked", "stored", True, True), ("pending", "stored", True, True)]
    assert query(db_url, "SELECT status FROM todos ORDER BY id") == [("done",), ("pending",)]


async def test_restarted_consumer_does_not_read_until_its_own_list_is_counted(
    engine: AsyncEngine, db_url: str, redis_url: str, ledger: Any
) -> None:
    r = redis.Redis.from_url(redis_url, socket_timeout=10)
    r.lpush(P1, b'{"x": 1}')  # c1 died holding X; its heartbeat has expired
    r.sadd(f"{JOBS}:consumers", "c1")
    reaper_cfg, c1_cfg = cfg(db_url, redis_url, consumer="c2", reap_interval_ms=1), cfg(db_url, redis_url)
    reaper, c1 = ListAdapter(reaper_cfg), ListAdapter(c1_cfg)
    try:
        await reaper.start()
        recovered = await reaper.recover(ledger)  # holds P1's lock until stored
        assert [d.body for d in recovered] == [b'{"x": 1}']
        assert await c1.recover(ledger) == []  # c1 restarted: its list is locked...
        r.lpush(JOBS, b'{"y": 1}')
        assert await c1.read(10) == []  # ...so it must not move more onto it
        await store_deliveries(engine, reaper_cfg, recovered)
        reaper.stored()
        await reaper.recover(ledger)  # releases the lock
        assert await c1.recover(ledger) == []  # counted: X stored, nothing owed
        moved = await c1.read(10)
        assert [d.body for d in moved] == [b'{"y": 1}']
        await store_deliveries(engine, c1_cfg, moved)
        c1.stored()
    finally:
        await reaper.close()
        await c1.close()
    pending_matches_list(db_url, r)


async def test_a_list_whose_recovered_batch_is_in_flight_is_not_counted_again(
    engine: AsyncEngine, db_url: str, redis_url: str, ledger: Any
) -> None:
    r = redis.Redis.from_url(redis_url, socket_timeout=10)
    r.lpush(P1, b'{"x": 1}')
    r.sadd(f"{JOBS}:consumers", "c1")
    reaper_cfg = cfg(db_url, redis_url, consumer="c2", reap_interval_ms=1)
    reaper = ListAdapter(reaper_cfg)
    try:
        await reaper.start()
        first = await reaper.recover(ledger)
        second = await reaper.recover(ledger)  # the prefetch, while the first commits
        assert [d.body for d in first] == [b'{"x": 1}']
        assert second == []
        await store_deliveries(engine, reaper_cfg, first)
        reaper.stored()
    finally:
        await reaper.close()
    pending_matches_list(db_url, r)


async def test_recovery_ignores_an_intent_whose_lrem_already_ran(
    engine: AsyncEngine, db_url: str, redis_url: str, ledger: Any
) -> None:
    r = redis.Redis.from_url(redis_url, socket_timeout=10)
    body = b'{"job": "again"}'
    c1_cfg = cfg(db_url, redis_url)
    async with engine.begin() as conn:
        await store(conn, batch([record(body, P1)], P1))  # stored, ack pending
    (inbox_id,) = query(db_url, "SELECT id FROM inbox")[0]
    acknowledger = ListAcknowledger(c1_cfg)
    c1 = ListAdapter(c1_cfg)
    try:
        r.lpush(P1, body)
        await acknowledger.ack([AckClaim(inbox_id, JOBS, "lrem", P1, None, None, 1, body)])
        # ...and the acker died before its commit: the row is still pending.
        r.lpush(P1, body)  # the same body consumed again; the consumer dies before storing
        recovered = await c1.recover(ledger)
        assert [(d.body, d.ack_copies) for d in recovered] == [(body, 1)]  # owed, not lost
    finally:
        await acknowledger.close()
        await c1.close()
