"""kill -9 of a real ingester or acker at each named failpoint, then restart:
every entry ends as exactly one todo, acked, with an empty PEL."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from ingest.embedded.processes import SwitchboardProcess, wait_for
from tests.support.config import stream_adapter
from tests.support.db import query, scalar
from tests.support.oracle import assert_clean_end, wait_all_acked
from tests.support.processes import Processes, assert_clean_exit
from tests.support.streams import entries_read, produce, xpending

pytestmark = pytest.mark.system
STREAM = "orders"
N = 300
BATCH = 50


def _finish(
    procs: Processes,
    config: Path,
    db_url: str,
    redis_url: str,
    ids: list[str],
    ingester: SwitchboardProcess | None = None,
) -> None:
    if ingester is None:
        ingester = procs.start("ingest", config, name="ingester-1")  # same consumer: re-reads its PEL
    acker = next((p for p in procs.all if p.verb == "ack" and p.alive()), None) or procs.start(
        "ack", config, name="acker-2"
    )
    wait_all_acked(db_url, redis_url, N, timeout_s=60, what="every entry stored and acked")
    assert_clean_end(db_url, redis_url, ids, ingester, acker)
    procs.assert_no_secret_logged()


@pytest.mark.parametrize("point", ["after_read", "after_inbox_insert", "before_commit"])
def test_ingester_killed_before_commit_redelivers_and_dedups(
    point: str, procs: Processes, make_config: Callable[..., Path], db_url: str, redis_url: str
) -> None:
    # One commit at a time, so "two batches committed" is exact; kills with
    # commits overlapping are test_overlapping_commits_killed_mid_flight's.
    config = make_config(stream_adapter(STREAM, batch_size=BATCH), ingest={"commits_in_flight": 1})
    ids = produce(redis_url, STREAM, N)
    procs.start("ack", config, name="acker-1")
    # Fire on the 3rd batch: two batches committed, the third read and lost.
    ingester = procs.start("ingest", config, name="ingester-1", failpoints=f"{point}=kill@3")
    assert ingester.wait(30) == -9
    assert scalar(db_url, "SELECT count(*) FROM inbox") == 2 * BATCH
    # Every entry read but not stored (the killed batch, and the next one if it
    # was already prefetched) is in the PEL: nothing acked it.
    read = entries_read(redis_url, STREAM)
    assert read in (3 * BATCH, 4 * BATCH)
    wait_for(
        lambda: xpending(redis_url, STREAM) == read - 2 * BATCH,
        timeout_s=30,
        what="the acker to drain exactly the committed rows",
    )
    _finish(procs, config, db_url, redis_url, ids)


def test_ingester_killed_after_commit_before_ack(
    procs: Processes, make_config: Callable[..., Path], db_url: str, redis_url: str
) -> None:
    # One commit at a time, so "three batches committed" is exact.
    config = make_config(stream_adapter(STREAM, batch_size=BATCH), ingest={"commits_in_flight": 1})
    ids = produce(redis_url, STREAM, N)
    ingester = procs.start("ingest", config, name="ingester-1", failpoints="after_commit=kill@3")
    assert ingester.wait(30) == -9
    # Three batches committed, none acked (no acker yet): all still in the PEL,
    # with the batch prefetched beside the third, if any.
    assert scalar(db_url, "SELECT count(*) FROM todos") == 3 * BATCH
    assert xpending(redis_url, STREAM) == entries_read(redis_url, STREAM) >= 3 * BATCH
    # The restart (no acker yet) re-reads its PEL first: the stored ones are
    # redelivered and deduped.
    stored_before = [i for (i,) in query(db_url, "SELECT id FROM inbox")]
    restarted = procs.start("ingest", config, name="ingester-1")
    wait_for(
        lambda: (
            scalar(
                db_url,
                "SELECT count(*) FROM inbox WHERE id = ANY(%(ids)s) AND deliveries = 2",
                {"ids": stored_before},
            )
            == 3 * BATCH
        ),
        timeout_s=30,
        what="the PEL re-read",
    )
    _finish(procs, config, db_url, redis_url, ids, ingester=restarted)


@pytest.mark.parametrize("point", ["acker_after_select", "acker_after_ack"])
def test_acker_killed_mid_drain(
    point: str, procs: Processes, make_config: Callable[..., Path], db_url: str, redis_url: str
) -> None:
    config = make_config(stream_adapter(STREAM, batch_size=BATCH), acker={"batch_size": 100})
    ids = produce(redis_url, STREAM, N)
    ingester = procs.start("ingest", config, name="ingester-1")
    wait_for(lambda: scalar(db_url, "SELECT count(*) FROM todos") == N, timeout_s=30, what="all stored")
    acker = procs.start("ack", config, name="acker-1", failpoints=f"{point}=kill@1")
    assert acker.wait(30) == -9
    # Nothing was marked acked by the dead acker's transaction.
    assert scalar(db_url, "SELECT count(*) FROM inbox WHERE ack_state = 'acked'") == 0
    expected_pel = N - 100 if point == "acker_after_ack" else N
    assert xpending(redis_url, STREAM) == expected_pel
    assert_clean_exit(ingester, ingester.terminate())
    _finish(procs, config, db_url, redis_url, ids)
