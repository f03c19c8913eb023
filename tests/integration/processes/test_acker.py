"""The acker against real PostgreSQL and Redis: only committed intents are
acked, concurrent ackers split the work, broker failures leave rows pending."""

from __future__ import annotations

import asyncio
import uuid
from contextlib import AbstractContextManager
from typing import TypeAlias, cast

import psycopg
import pytest
import redis
from psycopg import conninfo, sql
from sqlalchemy.ext.asyncio import AsyncEngine

from backhalf import queries
from backhalf.reads import audit
from backhalf.records import AckTarget, InboxRecord, Provenance, StoreBatch
from backhalf.writes import acks, registry
from backhalf.writes.store import store
from ingest.adapters.redis.streams import StreamAcknowledger, StreamAdapter
from ingest.config import Settings, from_mapping
from ingest.errors import AckError
from ingest.processes.ack.acker import drain_loop, drain_once
from ingest.processes.intake import to_record
from tests.support.db import libpq, query, scalar
from tests.support.plans import scans_of, scans_of_partitions

STREAM, GROUP = "orders", "switchboard"
STREAM_ACK = AckTarget("xack", STREAM, GROUP, by_cursor=True)

# conn.transaction() as what it is: a block that swallows psycopg.Rollback.
# Typed as a generator context manager, whose exit returns "bool | None", it
# reads to mypy as swallowing nothing, and what follows "raise
# psycopg.Rollback()" in it as unreachable.
RollbackSwallowed: TypeAlias = "AbstractContextManager[psycopg.Transaction, bool]"


def settings(db_url: str, redis_url: str, consumer: str = "c1") -> Settings:
    raw = {
        "database": {"url": db_url},
        "redis": {"url": redis_url},
        "adapters": [
            {"name": "orders", "source": STREAM, "group": GROUP, "consumer": consumer, "block_ms": 50}
        ],
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


async def drain_twice(engine: AsyncEngine, s: Settings) -> tuple[int, int]:
    """Two drains by one stream acker (limit 100): what each discharged."""
    acknowledger = StreamAcknowledger(s.adapters[0])
    try:
        first = await drain_once(engine, {"orders": acknowledger}, 100)
        return first, await drain_once(engine, {"orders": acknowledger}, 100)
    finally:
        await acknowledger.close()


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
    # Its own stream and group (source "x", the default group): an intent
    # naming any other would be discharged without a call to its broker.
    query(
        db_url,
        """INSERT INTO inbox (adapter, idempotency_key, source_message_id, body, ack_kind, ack_key,
                              ack_group, ack_entry_id, ack_state, status)
           VALUES ('broken', 'redis:x:1-0', '1-0', '', 'xack', 'x', 'switchboard', '1-0', 'pending',
                   'stored')""",
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
    record = InboxRecord("redis:orders:1-0", "1-0", b"{}", "{}", ack_ref="1-0")
    async with engine.begin() as conn:
        await store(
            conn,
            StoreBatch(
                "orders",
                "orders",
                "c1",
                "store",
                AckTarget("xack", STREAM, GROUP, by_cursor=True),
                Provenance("queue", "queue", False, "x"),
                [record],
            ),
        )
    url = libpq(db_url)
    async with (
        await psycopg.AsyncConnection.connect(url, connect_timeout=10) as storer,
        await psycopg.AsyncConnection.connect(url, connect_timeout=10) as acker,
    ):
        for pg in (storer, acker):
            await pg.execute("SET statement_timeout = '10s'")
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


async def test_the_claim_walks_the_queue_in_order_and_stops_at_its_limit(
    engine: AsyncEngine, db_url: str
) -> None:
    # A new database, never analyzed, 3,000 intents queued and 1,000 more
    # already claimed (deleted, still in heap and index until VACUUM): the
    # claim must read about ``limit`` queue rows, not all of them. Planned
    # from default estimates, it used to scan every row, deleted ones too,
    # join each to inbox and sort them all, on every claim. (Queued: acks
    # that waited for their todos, released; acks on store take the cursor.)
    records = [
        InboxRecord(f"redis:orders:{i}-0", f"{i}-0", b"{}", "{}", ack_ref=f"{i}-0") for i in range(4000)
    ]
    async with engine.begin() as conn:
        await store(conn, StoreBatch("orders", "orders", "c1", "complete", STREAM_ACK,
                                     Provenance("queue", "queue", False, "redis acl: default"),
                                     records))  # fmt: skip
    query(db_url, "UPDATE ack_queue SET waiting_for = NULL")
    with psycopg.connect(libpq(db_url)) as conn:
        with conn.transaction():
            conn.execute(queries.CLAIM_PLAN)
            claimed = conn.execute(queries.CLAIM_ACKS, {"adapters": ["orders"], "limit": 1000}).fetchall()
        assert len(claimed) == 1000
        assert scalar(db_url, "SELECT count(*) FROM ack_queue") == 3000
        with cast(RollbackSwallowed, conn.transaction()):
            conn.execute(queries.CLAIM_PLAN)
            (plan,) = conn.execute(
                "EXPLAIN (ANALYZE, FORMAT JSON) " + queries.CLAIM_ACKS, {"adapters": ["orders"], "limit": 100}
            ).fetchone()  # type: ignore[misc]
            raise psycopg.Rollback()
    scans = scans_of(plan[0]["Plan"], "ack_queue")
    assert scans, plan
    assert {s["Node Type"] for s in scans} <= {"Index Scan", "Index Only Scan"}, scans
    rows_read = sum(int(s["Actual Rows"]) * int(s["Actual Loops"]) for s in scans)
    # The walk (100) plus the DELETE's probe of each picked row (100).
    assert rows_read <= 2 * 100, scans
    assert scalar(db_url, "SELECT count(*) FROM ack_queue") == 3000  # the EXPLAIN's claim rolled back


async def test_the_cursor_claim_walks_its_index_in_order_and_stops_at_its_limit(
    engine: AsyncEngine, db_url: str
) -> None:
    # The same for acks on store, found by the adapter's cursor: 4,000 stored
    # in one new, never analyzed database, 1,000 of them acked and passed by
    # the cursor; a claim of 100 reads about 100 index entries of
    # ix_inbox_ack_cursor, in order, never a bitmap scan and a sort of every
    # row owed (planned from default estimates without the claim plan, it
    # was that: 32 ms instead of 1 for 20,000 owed).
    records = [
        InboxRecord(f"redis:orders:{i}-0", f"{i}-0", b"{}", "{}", ack_ref=f"{i}-0") for i in range(4000)
    ]
    async with engine.begin() as conn:
        await store(conn, StoreBatch("orders", "orders", "c1", "store", STREAM_ACK,
                                     Provenance("queue", "queue", False, "redis acl: default"),
                                     records))  # fmt: skip
    assert scalar(db_url, "SELECT count(*) FROM ack_queue") == 0  # no queue row for any of them
    async with engine.begin() as conn:
        claimed = await acks.claim_by_cursor(conn, "orders", 1000)
        assert claimed is not None
        assert len(claimed.claims) == 1000
        assert await acks.mark_by_cursor(conn, "orders", claimed) == 1000
    assert scalar(db_url, "SELECT count(*) FROM inbox WHERE ack_state = 'acked'") == 1000
    with psycopg.connect(libpq(db_url)) as pg, cast(RollbackSwallowed, pg.transaction()):
        pg.execute(queries.CLAIM_PLAN)
        (plan,) = pg.execute(
            "EXPLAIN (ANALYZE, FORMAT JSON) " + queries.CURSOR_ACKS, {"adapter": "orders", "limit": 100}
        ).fetchone()  # type: ignore[misc]
        raise psycopg.Rollback()
    # One index scan per partition (the history's: backhalf.housekeeping.partitions),
    # each of ix_inbox_ack_cursor's, merged in order; 100 entries read in all.
    scans = scans_of_partitions(plan[0]["Plan"], "inbox")
    assert scans, plan
    assert {s["Node Type"] for s in scans} == {"Index Scan"}, scans
    assert all("ack_cursor" in s["Index Name"] or "ack_xid" in s["Index Name"] for s in scans), scans
    assert sum(int(s.get("Actual Rows", 0)) * int(s.get("Actual Loops", 0)) for s in scans) == 100, scans


async def test_a_row_committed_late_is_not_skipped_by_the_ack_cursor(
    engine: AsyncEngine, db_url: str, redis_url: str
) -> None:
    # The cursor's one way to lose an ack: a store that began first (its
    # transaction id and inbox ids lower) commits after a later store's rows
    # were acked and the cursor moved past them. Entries 1 and 2 are stored
    # in a transaction left open, entry 3 in one that commits; an acker
    # following ids or commit order would ack 3 and move past 1 and 2.
    s = settings(db_url, redis_url)
    r = redis.Redis.from_url(redis_url, socket_timeout=10)
    for i in range(3):
        r.xadd(STREAM, {"body": f'{{"n": {i}}}'})
    acknowledgers = {"orders": StreamAcknowledger(s.adapters[0])}
    try:
        conn, tx = await consume_into_open_transaction(engine, s, 2)
        # Another consumer: c1 would read its own pending entries 1 and 2 first.
        await consume_and_commit(engine, settings(db_url, redis_url, "c2"), 1)
        assert scalar(db_url, "SELECT count(*) FROM inbox") == 1
        # The open transaction holds the snapshot's xmin: entry 3 waits for it.
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
    assert scalar(db_url, "SELECT count(*) FROM ack_queue") == 0


async def test_a_row_asked_for_again_after_the_claim_read_it_stays_owed(
    engine: AsyncEngine, db_url: str, redis_url: str
) -> None:
    # A redelivery stores the entry again between the cursor's claim and its
    # mark (its upsert takes a new ack_xid): the mark must leave that row
    # pending, and the cursor meet it again, or the redelivery's ack (the
    # entry pending in the group again) would never be sent.
    s = settings(db_url, redis_url)
    r = redis.Redis.from_url(redis_url, socket_timeout=10)
    r.xadd(STREAM, {"body": "{}"})
    await consume_and_commit(engine, s, 1)
    async with engine.begin() as conn:
        claimed = await acks.claim_by_cursor(conn, "orders", 100)
        assert claimed is not None
        assert len(claimed.claims) == 1
        # The store's upsert of the redelivery, committed meanwhile.
        query(db_url, "UPDATE inbox SET ack_state = 'pending', ack_xid = pg_current_xact_id()::text::int8")
        assert await acks.mark_by_cursor(conn, "orders", claimed) == 0
    assert scalar(db_url, "SELECT ack_state FROM inbox") == "pending"
    acknowledgers = {"orders": StreamAcknowledger(s.adapters[0])}
    try:
        assert await drain_once(engine, acknowledgers, 100) == 1
    finally:
        await acknowledgers["orders"].close()
    assert scalar(db_url, "SELECT ack_state FROM inbox") == "acked"
    assert r.xpending(STREAM, GROUP)["pending"] == 0


async def test_a_cursor_ahead_of_the_database_is_reset_and_no_ack_is_lost(
    engine: AsyncEngine, db_url: str, redis_url: str
) -> None:
    # A database restored into a new cluster (pg_dump) counts transaction
    # ids from low again: the cursor, and rows stamped before the dump, are
    # ahead of every new id. Here one entry is stored (a small id), then the
    # cursor and a second, pending row are pushed far ahead, as a restore
    # leaves them. The acker resets the cursor, stamps the row again, and
    # acks both; nothing waits for the new cluster's ids to catch up.
    s = settings(db_url, redis_url)
    r = redis.Redis.from_url(redis_url, socket_timeout=10)
    for i in range(2):
        r.xadd(STREAM, {"body": f'{{"n": {i}}}'})
    await consume_and_commit(engine, s, 2)
    ahead = 10**15
    # fmt: off
    query(db_url, "INSERT INTO ack_cursors (adapter, xid, inbox_id, cluster)"
                  " SELECT 'orders', %(x)s, 0, system_identifier::text FROM pg_control_system()",
          {"x": ahead})
    query(db_url, "UPDATE inbox SET ack_xid = %(x)s + 1 WHERE id = (SELECT max(id) FROM inbox)", {"x": ahead})
    # fmt: on
    acknowledgers = {"orders": StreamAcknowledger(s.adapters[0])}
    try:
        assert await drain_once(engine, acknowledgers, 100) == 0  # the reset
        assert scalar(db_url, "SELECT xid FROM ack_cursors") < ahead
        assert await drain_once(engine, acknowledgers, 100) == 2
    finally:
        await acknowledgers["orders"].close()
    stamped = query(db_url, "SELECT ack_state, ack_xid < %(x)s FROM inbox", {"x": ahead})
    assert stamped == [("acked", True)] * 2
    assert r.xpending(STREAM, GROUP)["pending"] == 0


async def test_a_second_acker_leaves_the_cursor_to_the_first(
    engine: AsyncEngine, db_url: str, redis_url: str
) -> None:
    s = settings(db_url, redis_url)
    r = redis.Redis.from_url(redis_url, socket_timeout=10)
    r.xadd(STREAM, {"body": "{}"})
    await consume_and_commit(engine, s, 1)
    # The cursor made and committed (a claim of nothing): a second acker would
    # wait for the first's uncommitted insert of it, once, on first use.
    query(db_url, "INSERT INTO ack_cursors (adapter, xid, inbox_id, cluster)"
                  " SELECT 'orders', 0, 0, system_identifier::text FROM pg_control_system()")  # fmt: skip
    async with engine.begin() as first, engine.begin() as second:
        held = await acks.claim_by_cursor(first, "orders", 100)
        assert held is not None
        assert len(held.claims) == 1
        assert await acks.claim_by_cursor(second, "orders", 100) is None  # locked: skipped, never waited for


async def test_acks_held_back_by_a_transaction_are_sent_when_it_ends_not_at_the_next_poll(
    engine: AsyncEngine, db_url: str, redis_url: str
) -> None:
    # A transaction below a committed store's holds the cursor's xmin, and
    # its end sends no NOTIFY (not a store: a heartbeat, the relay, a
    # worker's state change). The acker must look again soon by itself. Its
    # poll interval here is 10 minutes: without that, the ack waits for it,
    # and the bounded wait below fails.
    s = settings(db_url, redis_url)
    r = redis.Redis.from_url(redis_url, socket_timeout=10)
    r.xadd(STREAM, {"body": "{}"})
    blocker = await psycopg.AsyncConnection.connect(libpq(db_url), connect_timeout=10)
    live = StreamAcknowledger(s.adapters[0])
    stop, wake = asyncio.Event(), asyncio.Event()
    acker_settings = s.acker.__class__(poll_interval_ms=600_000)
    await blocker.execute("SELECT pg_current_xact_id()")  # an id of its own, below the store's
    await consume_and_commit(engine, s, 1)
    # The loop's first drain finds the row held; it makes the cursor, which
    # says it ran (there was none before).
    task = asyncio.create_task(drain_loop(engine, {"orders": live}, acker_settings, wake, stop))
    try:
        async with asyncio.timeout(30):
            while not scalar(db_url, "SELECT count(*) FROM ack_cursors"):  # noqa: ASYNC110 - polling PostgreSQL
                await asyncio.sleep(0.02)
        assert r.xpending(STREAM, GROUP)["pending"] == 1
        await blocker.commit()
        async with asyncio.timeout(30):
            while r.xpending(STREAM, GROUP)["pending"]:  # noqa: ASYNC110 - polling Redis
                await asyncio.sleep(0.02)
    finally:
        stop.set()
        await task
        await live.close()
        await blocker.close()
    assert scalar(db_url, "SELECT ack_state FROM inbox") == "acked"


async def test_a_cursor_made_by_another_cluster_is_reset_and_no_ack_is_lost(
    engine: AsyncEngine, db_url: str, redis_url: str
) -> None:
    # A restore into a new cluster whose ids have already passed the old
    # cursor: the cursor is not ahead, but rows this cluster stored with
    # smaller ids lie behind it. The cluster's identifier tells.
    s = settings(db_url, redis_url)
    r = redis.Redis.from_url(redis_url, socket_timeout=10)
    r.xadd(STREAM, {"body": "{}"})
    await consume_and_commit(engine, s, 1)
    # fmt: off
    query(db_url, "INSERT INTO ack_cursors (adapter, xid, inbox_id, cluster)"
                  " SELECT 'orders', ack_xid + 1, 0, 'another cluster' FROM inbox")
    # fmt: on
    assert await drain_twice(engine, s) == (0, 1)  # the reset, then the ack
    assert scalar(db_url, "SELECT ack_state FROM inbox") == "acked"
    assert scalar(db_url, "SELECT cluster FROM ack_cursors") != "another cluster"
    assert r.xpending(STREAM, GROUP)["pending"] == 0


async def test_a_claim_with_nothing_owed_takes_no_transaction_id(
    engine: AsyncEngine, db_url: str, redis_url: str
) -> None:
    # The acker looks again every few milliseconds while acks are held back:
    # a look that finds nothing must not lock the cursor (a transaction id,
    # and a WAL flush at its commit, each time).
    s = settings(db_url, redis_url)
    r = redis.Redis.from_url(redis_url, socket_timeout=10)
    r.xadd(STREAM, {"body": "{}"})
    await consume_and_commit(engine, s, 1)
    acknowledgers = {"orders": StreamAcknowledger(s.adapters[0])}
    try:
        assert await drain_once(engine, acknowledgers, 100) == 1
        async with engine.begin() as conn:
            claimed = await acks.claim_by_cursor(conn, "orders", 100)
            assert claimed is not None
            assert claimed.claims == []
            assert (await conn.exec_driver_sql("SELECT pg_current_xact_id_if_assigned()")).scalar() is None
    finally:
        await acknowledgers["orders"].close()


async def test_a_transaction_in_another_database_holds_no_ack_back(
    engine: AsyncEngine, db_url: str, redis_url: str
) -> None:
    """Issue 32: a role with no grant here, idle in a transaction of its own
    in another database of the cluster, holds the snapshot's xmin (ids are
    the cluster's), but can write no row here: the cursor passes it by. Any
    role, however unprivileged, sees its database and id in pg_stat_activity
    (the fact the horizon rests on), so the acker's own role does too."""
    suffix = uuid.uuid4().hex[:8]
    other_db, stranger, onlooker = f"other_{suffix}", f"stranger_{suffix}", f"onlooker_{suffix}"
    admin = libpq(db_url)
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(other_db)))
        for role in (stranger, onlooker):
            conn.execute(sql.SQL("CREATE ROLE {} LOGIN PASSWORD 'pw'").format(sql.Identifier(role)))
    s = settings(db_url, redis_url)
    r = redis.Redis.from_url(redis_url, socket_timeout=10)
    r.xadd(STREAM, {"body": "{}"})
    acknowledgers = {"orders": StreamAcknowledger(s.adapters[0])}
    idle = psycopg.connect(conninfo.make_conninfo(admin, dbname=other_db, user=stranger, password="pw"))
    try:
        xid = int(str(idle.execute("SELECT pg_current_xact_id()").fetchone()[0]))  # type: ignore[index]
        await consume_and_commit(engine, s, 1)
        with psycopg.connect(conninfo.make_conninfo(admin, user=onlooker, password="pw")) as look:
            seen = look.execute(
                "SELECT datname, backend_xid::text FROM pg_stat_activity WHERE usename = %(u)s",
                {"u": stranger},
            ).fetchall()
        assert seen == [(other_db, str(xid % 2**32))]
        assert await drain_once(engine, acknowledgers, 100) == 1
        assert r.xpending(STREAM, GROUP)["pending"] == 0
        assert scalar(db_url, "SELECT ack_state FROM inbox") == "acked"
    finally:
        idle.close()
        for a in acknowledgers.values():
            await a.close()
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(other_db)))
            for role in (stranger, onlooker):
                conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


async def test_status_names_the_transaction_holding_acks_back(engine: AsyncEngine, db_url: str) -> None:
    """A transaction of this database with an id of its own holds the stream
    acks stored after it: `status` names it (its pid, user and age)."""
    async with engine.connect() as conn:
        assert await audit.ack_horizon_holder(conn) is None
    with psycopg.connect(libpq(db_url)) as blocker:
        blocker.execute("SELECT pg_current_xact_id()")
        pid = blocker.info.backend_pid
        async with engine.connect() as conn:
            holder = await audit.ack_horizon_holder(conn)
        assert holder is not None
        assert (holder.kind, holder.name) == ("session", str(pid))
        assert holder.describe().startswith(f"pid {pid} (user ")
        assert "idle in transaction" in holder.describe()
