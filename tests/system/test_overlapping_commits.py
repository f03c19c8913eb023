"""A stream adapter overlaps commits (``[ingest] commits_in_flight``, 2 by
default): the next batch's transaction runs while the one before it is still
committing. Shown here with both transactions held open for real (a lock on
``todos`` that the test holds), then released, or the ingester killed -9
with both open."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
import pytest

from ingest.embedded.processes import SwitchboardProcess, wait_for
from tests.support.config import stream_adapter
from tests.support.db import libpq, scalar
from tests.support.oracle import assert_clean_end, wait_all_acked
from tests.support.processes import Processes
from tests.support.streams import produce

pytestmark = pytest.mark.system
STREAM = "orders"
WAITING_STORES = (
    "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'switchboard'"
    " AND wait_event_type = 'Lock' AND query LIKE '%%INSERT INTO todos%%'"
)


@contextmanager
def two_stores_open(
    procs: Processes, make_config: Callable[..., Path], db_url: str
) -> Iterator[tuple[Path, SwitchboardProcess]]:
    """An ingester whose first two store transactions are both open, waiting
    on a lock on ``todos`` that this block holds (every todo INSERT waits)."""
    config = make_config(stream_adapter(STREAM, batch_size=50), database={"lock_timeout_ms": 20_000})
    with psycopg.connect(libpq(db_url), connect_timeout=10) as conn:
        conn.execute("LOCK TABLE todos IN SHARE ROW EXCLUSIVE MODE")
        ingester = procs.start("ingest", config, name="ingester-1")
        wait_for(lambda: scalar(db_url, WAITING_STORES) == 2, timeout_s=30, what="two stores open")
        yield config, ingester
        conn.commit()


def entry_order(entry_id: str) -> tuple[int, int]:
    ms, seq = entry_id.split("-")
    return int(ms), int(seq)


def test_two_commits_in_flight_are_confirmed_in_read_order(
    procs: Processes, make_config: Callable[..., Path], db_url: str, redis_url: str
) -> None:
    ids = produce(redis_url, STREAM, 400)
    with two_stores_open(procs, make_config, db_url) as (config, ingester):
        assert scalar(db_url, "SELECT count(*) FROM inbox") == 0
    acker = procs.start("ack", config, name="acker-1")
    wait_all_acked(db_url, redis_url, 400, timeout_s=60, what="all acked")
    firsts = [entry_order(e["first_id"]) for e in ingester.events("batch_stored")]
    assert len(firsts) == 8
    assert firsts == sorted(firsts)
    assert_clean_end(db_url, redis_url, ids, ingester, acker)


def test_overlapping_commits_killed_mid_flight(
    procs: Processes, make_config: Callable[..., Path], db_url: str, redis_url: str
) -> None:
    ids = produce(redis_url, STREAM, 400)
    with two_stores_open(procs, make_config, db_url) as (config, ingester):
        ingester.kill()
        assert ingester.wait(30) == -9
    # Both transactions died with their connections: nothing of them is left.
    wait_for(lambda: scalar(db_url, WAITING_STORES) == 0, timeout_s=30, what="the backends to end")
    assert scalar(db_url, "SELECT count(*) FROM inbox") == 0
    assert scalar(db_url, "SELECT count(*) FROM events") == 0
    ingester = procs.start("ingest", config, name="ingester-1")
    acker = procs.start("ack", config, name="acker-1")
    wait_all_acked(db_url, redis_url, 400, timeout_s=60, what="all acked after the restart")
    assert_clean_end(db_url, redis_url, ids, ingester, acker)
    procs.assert_no_secret_logged()
