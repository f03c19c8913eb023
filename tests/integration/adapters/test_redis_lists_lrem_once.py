"""LREM runs once per intent: an acker that died between its LREM and its
commit must not, on retry, remove a later copy that is not stored yet."""

from __future__ import annotations

import redis

from backhalf.records import AckClaim
from ingest.adapters.redis.lists import ListAcknowledger, processing_key, removed_marker
from ingest.config import AdapterConfig, from_mapping

P = processing_key("jobs", "c1")


def list_adapter(redis_url: str) -> AdapterConfig:
    raw = {
        "database": {"url": "postgresql://x@y/z"},
        "redis": {"url": redis_url},
        "adapters": [{"name": "jobs", "mode": "list", "source": "jobs"}],
    }
    return from_mapping(raw, {}).adapters[0]


async def test_a_retried_lrem_removes_nothing_more(redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url, socket_timeout=10)
    body = b'{"job": 1}'
    r.lpush(P, body)
    cfg = list_adapter(redis_url)
    claim = AckClaim(7, "jobs", "lrem", P, None, None, 1, body)
    acker = ListAcknowledger(cfg)
    try:
        await acker.ack([claim])  # removed; then the acker dies before its commit
        assert r.llen(P) == 0
        assert r.exists(removed_marker(P, 7))
        r.lpush(P, body)  # the same body consumed again, not stored yet
        await acker.ack([claim])  # the retry of the same intent
        assert r.lrange(P, 0, -1) == [body]  # the new copy survives
        await acker.acked([claim])  # after a commit, the marker is cleaned up
        assert not r.exists(removed_marker(P, 7))
    finally:
        await acker.close()


async def test_a_retry_after_a_merge_removes_only_the_merged_copies(redis_url: str) -> None:
    """The acker removed the row's copies and died before its commit; a store
    then merged another stored copy into the row (ack_copies 1 -> 2). The
    retry must remove that copy too, and only it."""
    r = redis.Redis.from_url(redis_url, socket_timeout=10)
    body = b'{"job": 2}'
    r.lpush(P, body)
    cfg = list_adapter(redis_url)
    acker = ListAcknowledger(cfg)
    try:
        await acker.ack([AckClaim(8, "jobs", "lrem", P, None, None, 1, body)])
        assert r.llen(P) == 0
        r.lpush(P, body, body)  # one copy stored (merged into row 8), one consumed and not stored
        await acker.ack([AckClaim(8, "jobs", "lrem", P, None, None, 2, body)])  # the retry, after the merge
        assert r.lrange(P, 0, -1) == [body]  # the merged copy went; the unstored one stays
        assert r.get(removed_marker(P, 8)) == b"2"
    finally:
        await acker.close()
