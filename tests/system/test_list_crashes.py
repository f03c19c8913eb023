"""Reliable lists under kill -9: with items on the processing list, the same
consumer restarted, or never restarted and reaped by another consumer."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from ingest.adapters.redis.lists import processing_key
from ingest.embedded.processes import wait_for
from tests.support.db import scalar, unacked
from tests.support.oracle import assert_list_exactly_once
from tests.support.processes import Processes, stop_settled

pytestmark = pytest.mark.system
JOBS = "jobs"
N = 400
BATCH = 50


def list_adapter(**kw: Any) -> dict[str, Any]:
    return {"name": JOBS, "transport": "redis", "mode": "list", "source": JOBS, "queue": JOBS,
            "batch_size": BATCH, "block_ms": 200, **kw}  # fmt: skip


def push(redis_url: str, n: int) -> list[bytes]:
    bodies = [json.dumps({"job": i}).encode() for i in range(n)]
    with redis.Redis.from_url(redis_url, socket_timeout=10) as r:
        r.lpush(JOBS, *bodies)
    return bodies


def processing_len(redis_url: str, consumer: str) -> int:
    with redis.Redis.from_url(redis_url, socket_timeout=10) as r:
        return int(r.llen(processing_key(JOBS, consumer)))


def acked(db_url: str) -> int:
    return int(scalar(db_url, "SELECT coalesce(sum(ack_copies), 0) FROM inbox WHERE ack_state = 'acked'"))


@pytest.mark.parametrize("point", ["after_read", "before_commit"])
def test_killed_with_items_on_processing_list_then_restarted(
    point: str, procs: Processes, make_config: Callable[..., Path], db_url: str, redis_url: str
) -> None:
    config = make_config(list_adapter())
    bodies = push(redis_url, N)
    ingester = procs.start("ingest", config, name="ingester-1", failpoints=f"{point}=kill@3")
    assert ingester.wait(30) == -9
    # Two batches stored, none acked (no acker yet); the third moved, not stored.
    assert scalar(db_url, "SELECT count(*) FROM inbox") == 2 * BATCH
    # The third batch moved and not stored, and the fourth if it was prefetched.
    assert processing_len(redis_url, "ingester-1") in (3 * BATCH, 4 * BATCH)
    acker = procs.start("ack", config, name="acker-1")
    restarted = procs.start("ingest", config, name="ingester-1")
    wait_for(lambda: acked(db_url) == N, timeout_s=60, what="every item stored and removed")
    wait_for(
        lambda: processing_len(redis_url, "ingester-1") == 0, timeout_s=30, what="an empty processing list"
    )
    stop_settled(
        (restarted, acker),
        lambda: unacked(db_url) == 0 and processing_len(redis_url, "ingester-1") == 0,
        what="every item stored and removed",
    )
    assert_list_exactly_once(db_url, redis_url, source=JOBS, bodies=bodies)


def test_dead_consumer_not_restarted_is_reaped_by_another(
    procs: Processes, make_config: Callable[..., Path], db_url: str, redis_url: str
) -> None:
    config = make_config(list_adapter(heartbeat_ttl_ms=1000, reap_interval_ms=200))
    bodies = push(redis_url, N)
    doomed = procs.start("ingest", config, name="ingester-1", failpoints="after_read=kill@3")
    assert doomed.wait(30) == -9
    stranded = processing_len(redis_url, "ingester-1")
    assert stranded in (3 * BATCH, 4 * BATCH)
    acker = procs.start("ack", config, name="acker-1")
    survivor = procs.start("ingest", config, name="ingester-2")
    wait_for(lambda: acked(db_url) == N, timeout_s=60, what="every item stored and removed")
    wait_for(lambda: processing_len(redis_url, "ingester-1") == 0, timeout_s=30, what="the dead list drained")
    assert survivor.events("processing_list_recovered")
    stop_settled(
        (survivor, acker),
        lambda: unacked(db_url) == 0 and processing_len(redis_url, "ingester-2") == 0,
        what="every item stored and removed",
    )
    assert_list_exactly_once(db_url, redis_url, source=JOBS, bodies=bodies)
    procs.assert_no_secret_logged()
