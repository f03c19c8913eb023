"""XGROUP DESTROY under a running ingester: the group is recreated from 0 and the
stream read again, every entry a first delivery of something already stored,
without a duplicate todo or event."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from ingest.embedded.processes import wait_for
from tests.support.config import stream_adapter
from tests.support.db import acked, scalar
from tests.support.oracle import assert_clean_end, wait_all_acked
from tests.support.processes import Processes
from tests.support.streams import produce, xpending

pytestmark = pytest.mark.system
STREAM = "orders"


def test_group_destroyed_after_everything_was_stored_is_recreated_and_reread_without_duplicates(
    procs: Processes, make_config: Callable[..., Path], db_url: str, redis_url: str
) -> None:
    # XGROUP DESTROY under a running ingester: it recreates the group from 0
    # and reads the whole stream again, every entry a first delivery (count 1)
    # of something already stored. One todo and one event each, still; and
    # only the batches read before a store found that out are written and
    # undone, the rest ask first (events' ids are not reused, so the
    # sequence tells how many event rows were written in all).
    batch = 50
    config = make_config(stream_adapter(STREAM, batch_size=batch))
    ids = produce(redis_url, STREAM, 500)
    ingester = procs.start("ingest", config, name="ingester-1")
    acker = procs.start("ack", config, name="acker-1")
    wait_all_acked(db_url, redis_url, 500, timeout_s=60, what="the first pass")
    with redis.Redis.from_url(redis_url, socket_timeout=10) as r:
        assert r.xgroup_destroy(STREAM, "switchboard") == 1
    wait_for(
        lambda: (
            scalar(db_url, "SELECT count(*) FROM inbox WHERE deliveries = 2") == 500
            and acked(db_url) == 500
            and xpending(redis_url, STREAM) == 0
        ),
        timeout_s=60,
        what="the stream read again, and its acks discharged",
    )
    assert len(ingester.events("group_created")) == 2  # at start, and after the destroy
    reread = ingester.events("batch_stored")[-(500 // batch) :]
    assert sum(e["redelivered"] for e in reread) == 500
    assert sum(e["todos_created"] for e in reread) == 0
    # Two commits in flight: at most two batches go out before one reports back.
    written = scalar(db_url, "SELECT last_value FROM events_id_seq")
    assert 500 <= written <= 500 + 2 * batch, f"{written} event rows written for 500 entries"
    assert_clean_end(db_url, redis_url, ids, ingester, acker)
