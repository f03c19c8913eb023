"""Pub/sub against real Redis and PostgreSQL: what is published while running
becomes todos, what is published while stopped is lost."""

from __future__ import annotations

import json

import redis

from tests.support.db import query, scalar
from tests.support.in_process import pipeline, settings, wait_until


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
