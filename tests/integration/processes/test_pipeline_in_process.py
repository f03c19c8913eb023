"""Ingester and acker in one event loop against real servers: the stream end to
end, the events' trust metadata under a real ACL user, and nothing left running."""

from __future__ import annotations

import asyncio
import threading
from typing import cast

import redis

from backhalf.db import DatabaseSettings, create_engine, create_sync_engine
from ingest.config import from_mapping
from ingest.lifecycle import leftover_tasks
from ingest.processes.ack.acker import run_acker
from ingest.processes.pull.ingester import run_ingester
from tests.support.acl import acl_rules
from tests.support.db import query, scalar
from tests.support.servers import as_redis_user

STREAM = "orders"  # the key ops/redis-users.acl grants


async def test_stream_to_acked_todos_with_acl_identity_and_no_leaks(db_url: str, redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url, socket_timeout=10)
    # The least-privilege user of ops/redis-users.acl, renamed: proof it suffices.
    r.execute_command("ACL", "SETUSER", "deploy-bot", *acl_rules("switchboard-stream", "bot-pw"))  # type: ignore[no-untyped-call]
    try:
        bot_url = as_redis_user(redis_url, "deploy-bot", "bot-pw")
        ids = [cast(bytes, r.xadd(STREAM, {"body": f'{{"n": {i}}}'})).decode() for i in range(250)]
        settings = from_mapping(
            {
                "database": {"url": db_url},
                "adapters": [
                    {"name": "orders", "source": STREAM, "url": bot_url, "batch_size": 40, "block_ms": 100}
                ],
                "acker": {"poll_interval_ms": 100},
            },
            {},
        )
        threads_before = set(threading.enumerate())
        stop = asyncio.Event()
        async with asyncio.TaskGroup() as tg:
            tg.create_task(run_ingester(settings, stop))
            tg.create_task(run_acker(settings, stop))
            async with asyncio.timeout(30):
                while scalar(db_url, "SELECT count(*) FROM inbox WHERE ack_state = 'acked'") < 250:  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
            stop.set()
        assert leftover_tasks() == []
        assert set(threading.enumerate()) <= threads_before
    finally:
        r.acl_deluser("deploy-bot")
    assert r.xpending(STREAM, "switchboard")["pending"] == 0
    assert query(db_url, "SELECT DISTINCT family, trust_mode, verified, verify_detail FROM events") == [
        ("queue", "queue", False, "redis acl: deploy-bot")
    ]
    keys = {k for (k,) in query(db_url, "SELECT idempotency_key FROM todos")}
    assert keys == {f"redis:{STREAM}:{i}" for i in ids}
    (row,) = query(db_url, "SELECT family, transport, mode, enabled, settings FROM adapters")
    assert row[:4] == ("queue", "redis", "stream", True)
    assert "bot-pw" not in str(row[4])  # no secrets in adapters.settings


async def test_engine_sessions_carry_statement_and_lock_timeouts(db_url: str) -> None:
    engine = create_engine(DatabaseSettings(url=db_url, statement_timeout_ms=1234, lock_timeout_ms=567))
    try:
        async with engine.connect() as conn:
            pg = await conn.exec_driver_sql("SHOW statement_timeout")
            assert pg.scalar() == "1234ms"
            lock = await conn.exec_driver_sql("SHOW lock_timeout")
            assert lock.scalar() == "567ms"
    finally:
        await engine.dispose()


async def test_every_session_of_ours_compiles_no_statement_with_jit(db_url: str) -> None:
    """A packaged PostgreSQL has jit = on, and the store's estimates pass its
    threshold (1.3 s of compiling a 2,000-message batch): every engine of
    ours, async and sync (the workers'), turns it off for its own sessions
    (docs/decisions/0002-jit-off-for-switchboard-sessions.md)."""
    engine = create_engine(DatabaseSettings(url=db_url))
    try:
        async with engine.connect() as conn:
            assert (await conn.exec_driver_sql("SHOW jit")).scalar() == "off"
    finally:
        await engine.dispose()
    sync_engine = create_sync_engine(DatabaseSettings(url=db_url), pool_size=1)
    try:
        with sync_engine.connect() as sync_conn:
            assert sync_conn.exec_driver_sql("SHOW jit").scalar() == "off"
    finally:
        sync_engine.dispose()
