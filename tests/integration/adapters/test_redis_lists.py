"""Reliable lists against real Redis and PostgreSQL: body-hash keys, copies,
own recovery and the reaper."""

from __future__ import annotations

import hashlib
import json

import redis

from backhalf.db import DatabaseSettings, create_engine
from ingest.adapters.redis.lists import ListAdapter, processing_key
from ingest.processes.poll import ledger_for
from tests.support.db import query, scalar
from tests.support.in_process import JOBS, list_adapter, pipeline, settings, wait_until


async def test_list_items_become_todos_keyed_by_body_hash_and_leave_both_lists(
    db_url: str, redis_url: str, r: redis.Redis
) -> None:
    bodies = [json.dumps({"job": i}).encode() for i in range(120)]
    r.lpush(JOBS, *bodies)
    async with pipeline(settings(db_url, redis_url, list_adapter(batch_size=25))):
        await wait_until(
            lambda: scalar(db_url, "SELECT count(*) FROM inbox WHERE ack_state = 'acked'") == 120
        )
        await wait_until(lambda: r.llen(processing_key(JOBS, "c1")) == 0)
    assert r.llen(JOBS) == 0
    keys = {k for (k,) in query(db_url, "SELECT idempotency_key FROM todos")}
    assert keys == {f"redis:{JOBS}:{hashlib.sha256(b).hexdigest()}" for b in bodies}
    assert query(db_url, "SELECT DISTINCT source_message_id, ack_kind FROM inbox") == [(None, "lrem")]


async def test_three_copies_before_the_acker_runs_make_one_todo_and_all_leave(
    db_url: str, redis_url: str, r: redis.Redis
) -> None:
    body = b'{"job": "same"}'
    r.lpush(JOBS, body, body, body)
    s = settings(db_url, redis_url, list_adapter(batch_size=10))
    async with pipeline(s, acker=False):
        await wait_until(lambda: scalar(db_url, "SELECT coalesce(sum(ack_copies), 0) FROM inbox") == 3)
    assert r.llen(processing_key(JOBS, "c1")) == 3  # nothing removed before the acker
    assert query(db_url, "SELECT ack_copies, ack_state FROM inbox") == [(3, "pending")]
    assert scalar(db_url, "SELECT count(*) FROM todos") == 1
    async with pipeline(s):
        await wait_until(lambda: scalar(db_url, "SELECT count(*) FROM inbox WHERE ack_state = 'acked'") == 1)
    assert r.llen(processing_key(JOBS, "c1")) == 0
    assert r.llen(JOBS) == 0


async def test_own_recovery_redelivers_only_unstored_copies(
    db_url: str, redis_url: str, r: redis.Redis
) -> None:
    stored, unstored = b'{"job": "stored"}', b'{"job": "lost-in-flight"}'
    r.lpush(JOBS, stored)
    s = settings(db_url, redis_url, list_adapter())
    async with pipeline(s, acker=False):
        await wait_until(lambda: scalar(db_url, "SELECT count(*) FROM todos") == 1)
    # A consumer that moved an item and died before storing it.
    r.lpush(JOBS, unstored)
    r.lmove(JOBS, processing_key(JOBS, "c1"), "RIGHT", "LEFT")
    engine = create_engine(DatabaseSettings(url=db_url))
    adapter = ListAdapter(s.adapters[0])
    try:
        recovered = await adapter.recover(ledger_for(engine, JOBS))
        assert [(d.body, d.ack_copies, d.ack_key) for d in recovered] == [
            (unstored, 1, processing_key(JOBS, "c1"))
        ]
    finally:
        await adapter.close()
        await engine.dispose()
    async with pipeline(s):
        await wait_until(lambda: scalar(db_url, "SELECT count(*) FROM inbox WHERE ack_state = 'acked'") == 2)
    assert scalar(db_url, "SELECT count(*) FROM todos") == 2
    assert r.llen(processing_key(JOBS, "c1")) == 0


async def test_reaper_takes_a_dead_consumers_list_never_a_live_ones(
    db_url: str, redis_url: str, r: redis.Redis
) -> None:
    for consumer in ("dead", "alive"):
        r.lpush(processing_key(JOBS, consumer), json.dumps({"owner": consumer}))
        r.sadd(f"{JOBS}:consumers", consumer)
    r.set(f"{JOBS}:heartbeat:alive", "x", px=60_000)
    s = settings(db_url, redis_url, list_adapter(reap_interval_ms=100))
    async with pipeline(s):
        await wait_until(lambda: scalar(db_url, "SELECT count(*) FROM inbox WHERE ack_state = 'acked'") == 1)
        await wait_until(lambda: r.llen(processing_key(JOBS, "dead")) == 0)
        # Forgotten at the next reap that finds its list empty.
        await wait_until(lambda: not r.sismember(f"{JOBS}:consumers", "dead"))
        assert r.lrange(processing_key(JOBS, "alive"), 0, -1) == [b'{"owner": "alive"}']
    assert query(db_url, "SELECT payload FROM todos") == [({"owner": "dead"},)]
    assert r.lrange(processing_key(JOBS, "alive"), 0, -1) == [b'{"owner": "alive"}']
    assert r.sismember(f"{JOBS}:consumers", "alive")
