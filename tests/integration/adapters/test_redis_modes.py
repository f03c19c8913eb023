"""Every Redis mode (stream, list, pub/sub) against real servers: one payload
gives the same todo through each, and each adapter class takes its config."""

from __future__ import annotations

import json

import redis

from ingest.adapters.redis.lists import ListAdapter
from ingest.adapters.redis.pubsub import PubSubAdapter
from ingest.config import AdapterConfig
from tests.support.db import query, scalar
from tests.support.in_process import list_adapter, pipeline, settings, wait_until


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
