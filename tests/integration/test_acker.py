"""The acker against real PostgreSQL and Redis: only committed intents are
acked, concurrent ackers split the work, broker failures leave rows pending."""

from __future__ import annotations

import asyncio

import psycopg
import pytest
import redis
from sqlalchemy.ext.asyncio import AsyncEngine

from backhalf import queries, registry
from backhalf.records import AckTarget, InboxRecord, Provenance, StoreBatch
from backhalf.store import store
from ingest.acker import drain_loop, drain_once
from ingest.adapters.redis.streams import StreamAcknowledger, StreamAdapter
from ingest.config import Settings, from_mapping
from ingest.errors import AckError
from ingest.poll import to_record
from tests.support.db import libpq, query, scalar

STREAM, GROUP = "orders", "switchboard"


def settings(db_url: str, redis_url: str) -> Settings:
    raw = {
        "database": {"url": db_url},
        "redis": {"url": redis_url},
        "adapters": [{"name": "orders", "source": STREAM, "group": GROUP, "consumer": "c1", "block_ms": 50}],
    }
    return from_mapping(raw, {})


async def consume_into_open_transaction(engine: AsyncEngine, s: Settings, n: int):  # type: ignore[no-untyped-def]
    """Read n entries and store them, returning the still-open transaction."""
    cfg = s.adapters[0]
    adapter = StreamAdapter(cfg)
    try:
        deliveries = await adapter.read(n)
        b = StoreBatch("orders", cfg.queue, cfg.consumer, "store", adapter.ack_target,
                       Provenance("queue", "queue", False, adapter.identity),
                       [to_record(d, cfg) for d in deliveries])  # fmt: skip
    finally:
        await adapter.close()
    conn = await engine.connect()
    tx = await conn.begin()
    await store(conn, b)
    return conn, tx


async def consume_and_commit(engine: AsyncEngine, s: Settings, n: int) -> None:
    conn, tx = await consume_into_open_transaction(engine, s, n)
    await tx.commit()
    await conn.close()


async def test_xack_only_after_the_todo_is_committed(
    engine: AsyncEngine, db_url: str, redis_url: str
) -> None:
    s = settings(db_url, redis_url)
    r = redis.Redis.from_url(redis_url, socket_timeout=10)
    for i in range(3):
        r.xadd(STREAM, {"body": f'{{"n": {i}}}'})
    acknowledgers = {"orders": StreamAcknowledger(s.adapters[0])}
    try:
        conn, tx = await consume_into_open_transaction(engine, s, 10)
        # Stored but not committed: the acker sees nothing, the PEL keeps all three.
        assert await drain_once(engine, acknowledgers, 100) == 0
        assert r.xpending(STREAM, GROUP)["pending"] == 3
        await tx.commit()
        await conn.close()
        assert await drain_once(engine, acknowledgers, 100) == 3
    finally:
        for a in acknowledgers.values():
            await a.close()
    assert r.xpending(STREAM, GROUP)["pending"] == 0
    assert query(db_url, "SELECT count(*) FROM inbox WHERE ack_state = 'acked' AND acked_at IS NOT NULL") == [
        (3,)
    ]


async def test_concurrent_ackers_split_the_work_without_overlap(
    engine: AsyncEngine, db_url: str, redis_url: str
) -> None:
    s = settings(db_url, redis_url)
    r = redis.Redis.from_url(redis_url, socket_timeout=10)
    for i in range(300):
        r.xadd(STREAM, {"body": f'{{"n": {i}}}'})
    await consume_and_commit(engine, s, 300)
    ackers = [{"orders": StreamAcknowledger(s.adapters[0])} for _ in range(3)]
    try:
        counts = await asyncio.gather(*(drain_once(engine, a, 100) for a in ackers))
        while sum(counts) < 300:
            counts.append(await drain_once(engine, ackers[0], 100))
    finally:
        for a in ackers:
            await a["orders"].close()
    assert sum(counts) == 300  # every intent claimed exactly once
    assert r.xpending(STREAM, GROUP)["pending"] == 0


async def test_broker_down_leaves_intents_pending(engine: AsyncEngine, db_url: str, redis_url: str) -> None:
    s = settings(db_url, redis_url)
    r = redis.Redis.from_url(redis_url, socket_timeout=10)
    r.xadd(STREAM, {"body": "{}"})
    await consume_and_commit(engine, s, 10)
    dead = from_mapping(
        {
            "database": {"url": db_url},
            "adapters": [{"name": "orders", "source": STREAM, "url": "redis://127.0.0.1:1/0"}],
        },
        {},
    ).adapters[0]
    acknowledgers = {"orders": StreamAcknowledger(dead)}
    try:
        with pytest.raises(AckError, match="XACK orders switchboard"):
            await drain_once(engine, acknowledgers, 100)
    finally:
        await acknowledgers["orders"].close()
    assert scalar(db_url, "SELECT ack_state FROM inbox") == "pending"
    assert r.xpending(STREAM, GROUP)["pending"] == 1


async def test_one_broker_down_does_not_stall_another_adapter(
    engine: AsyncEngine, db_url: str, redis_url: str
) -> None:
    s = settings(db_url, redis_url)
    r = redis.Redis.from_url(redis_url, socket_timeout=10)
    r.xadd(STREAM, {"body": "{}"})
    await consume_and_commit(engine, s, 10)
    async with engine.begin() as c:
        await registry.register(
            c, name="broken", family="queue", transport="redis", mode="stream", settings={}
        )
    query(
        db_url,
        """INSERT INTO inbox (adapter, idempotency_key, source_message_id, body, ack_kind, ack_key,
                              ack_group, ack_entry_id, ack_state, status)
           VALUES ('broken', 'redis:x:1-0', '1-0', '', 'xack', 'x', 'g', '1-0', 'pending', 'stored')""",
    )
    dead = StreamAcknowledger(
        from_mapping(
            {
                "database": {"url": db_url},
                "adapters": [{"name": "broken", "source": "x", "url": "redis://127.0.0.1:1/0"}],
            },
            {},
        ).adapters[0]
    )
    live = StreamAcknowledger(s.adapters[0])
    stop = asyncio.Event()
    acker_settings = s.acker.__class__(poll_interval_ms=50, backoff_initial_ms=10, backoff_max_ms=100)
    wake = asyncio.Event()
    task = asyncio.create_task(
        drain_loop(engine, {"broken": dead, "orders": live}, acker_settings, wake, stop)
    )
    try:
        async with asyncio.timeout(10):
            while r.xpending(STREAM, GROUP)["pending"]:  # noqa: ASYNC110 - polling Redis
                await asyncio.sleep(0.05)
    finally:
        stop.set()
        await task
        await dead.close()
        await live.close()
    assert query(db_url, "SELECT adapter, ack_state FROM inbox ORDER BY adapter") == [
        ("broken", "pending"),
        ("orders", "acked"),
    ]


async def test_claim_skips_a_row_a_redelivery_is_requeueing_instead_of_deadlocking(
    engine: AsyncEngine, db_url: str
) -> None:
    """A store re-requesting the ack of a redelivered entry first updates its
    inbox row, then queues it again. A claim arriving in between must skip
    the row (it is taken), not lock the queue row and then wait for the inbox
    row while the store waits for that queue row: a deadlock. The store's two
    steps run here as two statements of one transaction, so the claim lands
    between them every time."""
    record = InboxRecord("redis:orders:1-0", "1-0", b"{}", "{}", ack_entry_id="1-0")
    async with engine.begin() as conn:
        await store(
            conn,
            StoreBatch(
                "orders",
                "orders",
                "c1",
                "store",
                AckTarget("xack", STREAM, GROUP),
                Provenance("queue", "queue", False, "x"),
                [record],
            ),
        )
    url = libpq(db_url)
    async with (
        await psycopg.AsyncConnection.connect(url, connect_timeout=10) as storer,
        await psycopg.AsyncConnection.connect(url, connect_timeout=10) as acker,
    ):
        for conn in (storer, acker):
            await conn.execute("SET statement_timeout = '10s'")
        await storer.execute("UPDATE inbox SET deliveries = deliveries + 1, ack_state = 'pending'")
        async with acker.cursor() as cur:
            await cur.execute(queries.CLAIM_ACKS, {"adapters": ["orders"], "limit": 10})
            assert await cur.fetchall() == []  # taken by the store: skipped
        await storer.execute(
            "INSERT INTO ack_queue (inbox_id, adapter, ack_kind, ack_key, idempotency_key)"
            " SELECT id, adapter, ack_kind, ack_key, idempotency_key FROM inbox"
            " ON CONFLICT (inbox_id) DO NOTHING"
        )
        await storer.commit()
        await acker.commit()
        async with acker.cursor() as cur:
            await cur.execute(queries.CLAIM_ACKS, {"adapters": ["orders"], "limit": 10})
            assert [row[5] for row in await cur.fetchall()] == ["1-0"]
        await acker.commit()
    assert scalar(db_url, "SELECT count(*) FROM ack_queue") == 0
    assert scalar(db_url, "SELECT ack_state FROM inbox") == "acked"


def _scans_of(plan: dict[str, object], relation: str) -> list[dict[str, object]]:
    """Every node of an EXPLAIN (FORMAT JSON) plan that reads ``relation``."""
    found = [plan] if plan.get("Relation Name") == relation and "Scan" in str(plan["Node Type"]) else []
    for child in plan.get("Plans", []):  # type: ignore[attr-defined]
        found += _scans_of(child, relation)
    return found


async def test_the_claim_walks_the_queue_in_order_and_stops_at_its_limit(
    engine: AsyncEngine, db_url: str
) -> None:
    # A new database, never analyzed, 3,000 intents queued and 1,000 more
    # already claimed (deleted, still in heap and index until VACUUM): the
    # claim must read about ``limit`` queue rows, not all of them. Planned
    # from default estimates, it used to scan every row, deleted ones too,
    # join each to inbox and sort them all, on every claim.
    records = [
        InboxRecord(f"redis:orders:{i}-0", f"{i}-0", b"{}", "{}", ack_entry_id=f"{i}-0") for i in range(4000)
    ]
    async with engine.begin() as conn:
        await store(conn, StoreBatch("orders", "orders", "c1", "store", AckTarget("xack", STREAM, GROUP),
                                     Provenance("queue", "queue", False, "redis acl: default"),
                                     records))  # fmt: skip
    with psycopg.connect(libpq(db_url)) as conn:
        with conn.transaction():
            conn.execute(queries.CLAIM_PLAN)
            claimed = conn.execute(queries.CLAIM_ACKS, {"adapters": ["orders"], "limit": 1000}).fetchall()
        assert len(claimed) == 1000
        assert scalar(db_url, "SELECT count(*) FROM ack_queue") == 3000
        with conn.transaction():
            conn.execute(queries.CLAIM_PLAN)
            (plan,) = conn.execute(
                "EXPLAIN (ANALYZE, FORMAT JSON) " + queries.CLAIM_ACKS, {"adapters": ["orders"], "limit": 100}
            ).fetchone()  # type: ignore[misc]
            raise psycopg.Rollback()
    scans = _scans_of(plan[0]["Plan"], "ack_queue")
    assert scans, plan
    assert {s["Node Type"] for s in scans} <= {"Index Scan", "Index Only Scan"}, scans
    rows_read = sum(int(s["Actual Rows"]) * int(s["Actual Loops"]) for s in scans)  # type: ignore[call-overload]
    # The walk (100) plus the DELETE's probe of each picked row (100).
    assert rows_read <= 2 * 100, scans
    assert scalar(db_url, "SELECT count(*) FROM ack_queue") == 3000  # the EXPLAIN's claim rolled back
