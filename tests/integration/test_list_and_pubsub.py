"""Reliable lists and pub/sub against real Redis and PostgreSQL."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import redis

from backhalf.db import DatabaseSettings, create_engine
from ingest.acker import run_acker
from ingest.adapters.redis.lists import ListAdapter, processing_key
from ingest.adapters.redis.pubsub import PubSubAdapter
from ingest.config import AdapterConfig, Settings, from_mapping
from ingest.ingester import run_ingester
from ingest.lifecycle import leftover_tasks
from ingest.poll import ledger_for
from tests.support.acl import acl_rules
from tests.support.db import query, scalar

JOBS = "jobs"


def settings(db_url: str, redis_url: str, *adapters: dict[str, Any]) -> Settings:
    return from_mapping(
        {
            "database": {"url": db_url},
            "redis": {"url": redis_url},
            "adapters": list(adapters),
            "acker": {"poll_interval_ms": 100},
            "ingest": {"backoff_initial_ms": 20, "backoff_max_ms": 200},
        },
        {},
    )


def list_adapter(**kw: Any) -> dict[str, Any]:
    return {"name": JOBS, "mode": "list", "source": JOBS, "consumer": "c1", "block_ms": 100, **kw}


@contextlib.asynccontextmanager
async def pipeline(s: Settings, *, acker: bool = True) -> AsyncIterator[None]:
    stop = asyncio.Event()
    async with asyncio.TaskGroup() as tg:
        tg.create_task(run_ingester(s, stop))
        if acker:
            tg.create_task(run_acker(s, stop))
        try:
            yield
        finally:
            stop.set()
    assert leftover_tasks() == []


async def wait_until(predicate: Callable[[], Any], timeout_s: float = 20) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():  # noqa: ASYNC110 - polling PostgreSQL and Redis
            await asyncio.sleep(0.05)


@pytest.fixture
def r(redis_url: str) -> redis.Redis:
    return redis.Redis.from_url(redis_url, socket_timeout=10)


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


async def test_pubsub_messages_published_while_running_become_todos(
    db_url: str, redis_url: str, r: redis.Redis
) -> None:
    s = settings(
        db_url,
        redis_url,
        {"name": "news", "mode": "pubsub", "source": "news", "delivery": "at-most-once", "block_ms": 100},
    )
    async with pipeline(s):
        await wait_until(lambda: r.pubsub_numsub("news")[0][1] == 1)
        for i in range(20):
            r.publish("news", json.dumps({"n": i}))
        r.publish("news", json.dumps({"n": 0}))  # a repeat while its todo is active
        # Two copies in one batch merge into one inbox row: count deliveries.
        await wait_until(lambda: scalar(db_url, "SELECT coalesce(sum(deliveries), 0) FROM inbox") == 21)
    assert scalar(db_url, "SELECT count(*) FROM todos") == 20
    assert query(db_url, "SELECT DISTINCT ack_kind, ack_state FROM inbox") == [("none", "none")]


async def test_pubsub_loses_what_is_published_while_stopped(
    db_url: str, redis_url: str, r: redis.Redis
) -> None:
    s = settings(
        db_url,
        redis_url,
        {"name": "news", "mode": "pubsub", "source": "news", "delivery": "at-most-once", "block_ms": 100},
    )
    assert r.publish("news", b'{"while": "stopped"}') == 0  # no subscriber: Redis keeps nothing
    async with pipeline(s):
        await wait_until(lambda: r.pubsub_numsub("news")[0][1] == 1)
        r.publish("news", b'{"while": "running"}')
        await wait_until(lambda: scalar(db_url, "SELECT count(*) FROM todos") == 1)
    assert query(db_url, "SELECT payload FROM todos") == [({"while": "running"},)]


async def test_same_payload_through_every_mode_gives_the_same_todo(
    db_url: str, redis_url: str, r: redis.Redis
) -> None:
    payload = {"order": 42, "items": [{"sku": "A", "qty": 2}], "note": "héllo"}
    body = json.dumps(payload).encode()
    s = settings(
        db_url,
        redis_url,
        {"name": "via-stream", "mode": "stream", "source": "s", "queue": "orders", "block_ms": 100},
        {"name": "via-list", "mode": "list", "source": "l", "queue": "orders", "block_ms": 100},
        {"name": "via-pubsub", "mode": "pubsub", "source": "p", "queue": "orders", "block_ms": 100,
         "delivery": "at-most-once"},
    )  # fmt: skip
    r.xadd("s", {"body": body})
    r.lpush("l", body)
    async with pipeline(s):
        await wait_until(lambda: r.pubsub_numsub("p")[0][1] == 1)
        r.publish("p", body)
        await wait_until(lambda: scalar(db_url, "SELECT count(*) FROM todos") == 3)
    rows = query(
        db_url,
        "SELECT queue, payload, status, attempts, last_error FROM todos ORDER BY id",
    )
    assert len(rows) == 3
    assert rows[0] == rows[1] == rows[2] == ("orders", payload, "pending", 0, None)
    prefixes = sorted(k.rsplit(":", 1)[0] for (k,) in query(db_url, "SELECT idempotency_key FROM todos"))
    assert prefixes == ["redis:l", "redis:p", "redis:s"]  # only the source fields differ


def test_adapter_classes_take_their_config(db_url: str, redis_url: str) -> None:
    s = settings(
        db_url,
        redis_url,
        list_adapter(),
        {"name": "n", "mode": "pubsub", "source": "n", "delivery": "at-most-once"},
    )
    cfgs: list[AdapterConfig] = list(s.adapters)
    assert isinstance(ListAdapter(cfgs[0]).ack_target.key, str)
    assert PubSubAdapter(cfgs[1]).ack_target.kind == "none"


@pytest.mark.parametrize("mode", ["list", "pubsub"])
async def test_least_privilege_acl_users_suffice(
    mode: str, db_url: str, redis_url: str, r: redis.Redis
) -> None:
    source = "jobs" if mode == "list" else "news"  # the names ops/redis-acl.example grants
    r.execute_command("ACL", "SETUSER", "least", *acl_rules(f"switchboard-{mode}", "pw"))
    try:
        url = redis_url.replace("redis://", "redis://least:pw@", 1)
        adapter = {"name": source, "mode": mode, "source": source, "url": url, "block_ms": 100,
                   "consumer": "c1", "reap_interval_ms": 100}  # fmt: skip
        if mode == "pubsub":
            adapter["delivery"] = "at-most-once"
            adapter.pop("reap_interval_ms")
        else:
            r.lpush(source, b'{"job": 1}')
        async with pipeline(settings(db_url, redis_url, adapter)):
            if mode == "pubsub":
                await wait_until(lambda: r.pubsub_numsub(source)[0][1] == 1)
                r.publish(source, b'{"job": 1}')
            await wait_until(lambda: scalar(db_url, "SELECT count(*) FROM todos") == 1)
            if mode == "list":
                await wait_until(lambda: r.llen(processing_key(source, "c1")) == 0)
        assert scalar(db_url, "SELECT verify_detail FROM events") == "redis acl: least"
    finally:
        r.acl_deluser("least")
