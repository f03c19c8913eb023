"""A consumer frozen with SIGSTOP: another claims its entries and stores them;
resumed, its stale batch changes nothing."""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path

import pytest

from ingest.embedded.processes import wait_for
from tests.support.config import stream_adapter
from tests.support.db import query, scalar, unacked
from tests.support.oracle import assert_exactly_once, wait_all_acked
from tests.support.processes import Processes, assert_clean_exit, stop_settled
from tests.support.streams import produce, xpending

pytestmark = pytest.mark.system
STREAM = "orders"


def test_frozen_consumer_entries_claimed_then_its_stale_batch_changes_nothing(
    procs: Processes, make_config: Callable[..., Path], db_url: str, redis_url: str
) -> None:
    # One commit at a time: the freeze must find the first batch committed, not
    # its transaction open (which would hold the other consumer's inserts of
    # the same keys until idle_in_transaction_session_timeout).
    config = make_config(
        stream_adapter(STREAM, batch_size=50, claim_idle_ms=1000, claim_interval_ms=200),
        ingest={"commits_in_flight": 1},
    )
    ids = produce(redis_url, STREAM, 300)
    # Frozen after reading its second batch, before storing it.
    frozen = procs.start("ingest", config, name="ingester-1", failpoints="after_read=stop@2")
    wait_for(lambda: scalar(db_url, "SELECT count(*) FROM inbox") >= 50, timeout_s=30, what="first batch")
    wait_for(
        lambda: Path(f"/proc/{frozen.pid}/stat").read_text().split()[2] == "T", timeout_s=30, what="SIGSTOP"
    )
    acker = procs.start("ack", config, name="acker-1")
    other = procs.start("ingest", config, name="ingester-2")
    settled = "the other consumer to claim and store everything"
    wait_all_acked(db_url, redis_url, 300, timeout_s=60, what=settled)
    # Stopped, and settled again, so that nothing but the stale batch asks an ack again.
    stop_settled([other], lambda: unacked(db_url) == 0 and xpending(redis_url, STREAM) == 0, what=settled)
    todos_before = query(db_url, "SELECT id, idempotency_key, status FROM todos ORDER BY id")
    events_before = scalar(db_url, "SELECT count(*) FROM events")
    last_ack = scalar(db_url, "SELECT max(acked_at) FROM inbox")
    frozen.signal(signal.SIGCONT)
    # The stale batch is stored now: every entry of it is already in the inbox.
    wait_for(lambda: frozen.events("batch_stored")[1:], timeout_s=30, what="the stale batch's store")
    stale = frozen.events("batch_stored")[1]
    assert (stale["new"], stale["todos_created"]) == (0, 0)
    assert stale["redelivered"] == stale["messages"]
    # Its entries were acked already, so the PEL is empty before and after:
    # the re-requested acks are discharged when the inbox says so.
    wait_for(
        lambda: unacked(db_url) == 0 and xpending(redis_url, STREAM) == 0,
        timeout_s=30,
        what="re-requested acks discharged",
    )
    # Each was asked and acked again (a redelivery may be in the PEL again): a
    # run that looks settled while such a batch is in hand is not yet.
    again = scalar(db_url, "SELECT count(*) FROM inbox WHERE acked_at > %(t)s", {"t": last_ack})
    assert again == stale["messages"]
    assert query(db_url, "SELECT id, idempotency_key, status FROM todos ORDER BY id") == todos_before
    assert scalar(db_url, "SELECT count(*) FROM events") == events_before
    for proc in (frozen, acker):
        assert_clean_exit(proc, proc.terminate())
    assert_exactly_once(db_url, redis_url, stream=STREAM, group="switchboard", produced_ids=ids)
