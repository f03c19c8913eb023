"""Network faults through an in-repo TCP proxy between real switchboard
processes and real servers: latency, a Redis blackhole (no reset: only
timeouts can tell), and a PostgreSQL connection cut right after COMMIT was
sent, before its reply (the outcome is unknown to the ingester), or right
after a worker's batch of ends was sent (unknown to its state writer)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest

from ingest.embedded.processes import SwitchboardProcess, wait_for
from ingest.embedded.servers import RedisServer
from tests.support.config import stream_adapter, write_config
from tests.support.db import acked, query, scalar
from tests.support.downstream import QUEUE, statuses, stop_all, trail
from tests.support.oracle import assert_clean_end, wait_all_acked
from tests.support.processes import Processes, with_secret_db
from tests.support.proxy import Proxy, proxy_to
from tests.support.streams import produce

pytestmark = pytest.mark.system
STREAM = "orders"


def db_port(db_url: str) -> int:
    return int(db_url.rsplit(":", 1)[1].split("/", 1)[0])


def ingester_through_proxy(
    procs: Processes,
    tmp_path: Path,
    proxy: Proxy,
    db_url: str,
    redis_url: str,
    *,
    hold_acker: Callable[[], object] = lambda: True,
    **database: int,
) -> tuple[SwitchboardProcess, SwitchboardProcess]:
    """An acker on PostgreSQL directly and an ingester through the proxy:
    the acker starts once ``hold_acker`` holds (at once by default)."""
    adapters: list[Mapping[str, Any]] = [stream_adapter(STREAM, batch_size=50)]
    ingest_config = write_config(
        tmp_path / "ingest.toml",
        database_url=with_secret_db(proxy.url_for(db_url)),
        redis_url=redis_url,
        adapters=adapters,
        database=database,
    )
    ack_config = write_config(
        tmp_path / "ack.toml", database_url=with_secret_db(db_url), redis_url=redis_url, adapters=adapters
    )
    ingester = procs.start("ingest", ingest_config, name="ingester-1")
    wait_for(hold_acker, timeout_s=60, what="the moment to start the acker")
    return procs.start("ack", ack_config, name="acker-1"), ingester


def test_commit_reply_lost_outcome_unknown_redelivery_resolves_it(
    procs: Processes, tmp_path: Path, db_url: str, redis_url: str
) -> None:
    with proxy_to(db_port(db_url)) as proxy:
        # A store's COMMIT, not a heartbeat's or another transaction's that
        # may come first on a loaded machine (seen in CI).
        proxy.cut_only_after = b"INSERT INTO inbox"
        proxy.cut_after = b"COMMIT"
        ids = produce(redis_url, STREAM, 300)

        def all_stored() -> bool:
            return bool(scalar(db_url, "SELECT count(*) FROM inbox") == 300)

        # The acker only once the ingester has stored everything, the batch
        # whose COMMIT reply was lost included: an acker running meanwhile
        # may ack that committed batch before the ingester reads it again
        # from its pending list, and then there is no redelivery to see.
        acker, ingester = ingester_through_proxy(
            procs, tmp_path, proxy, db_url, redis_url, hold_acker=all_stored
        )
        wait_all_acked(db_url, redis_url, 300, timeout_s=60, what="all acked")
        assert proxy.cuts == 1
        failures = ingester.events("store_failed")
        assert failures, "the lost COMMIT reply must surface as a failed store"
        assert failures[0]["cause"] == "OperationalError"
        # The batch committed on the server; its redelivery was deduplicated.
        assert scalar(db_url, "SELECT count(*) FROM inbox WHERE deliveries > 1") > 0
        assert_clean_end(db_url, redis_url, ids, ingester, acker)
    procs.assert_no_secret_logged()


def test_postgres_blackhole_cut_off_by_the_transaction_deadline(
    procs: Processes, tmp_path: Path, db_url: str, redis_url: str
) -> None:
    """The proxy keeps ACKing at the TCP level and never answers, so no TCP
    timeout fires: only the client-side transaction deadline can end the
    store. Without it the ingester hangs in COMMIT forever."""
    gave_up = "no reply from the database within 2000 ms"
    with proxy_to(db_port(db_url)) as proxy:
        ids = produce(redis_url, STREAM, 300)
        acker, ingester = ingester_through_proxy(
            procs, tmp_path, proxy, db_url, redis_url, statement_timeout_ms=1000, transaction_deadline_ms=2000
        )
        wait_all_acked(db_url, redis_url, 300, timeout_s=60, what="the first entries")
        proxy.blackhole = True
        ids += produce(redis_url, STREAM, 200, start=300)
        wait_for(
            # The store, or the enabled-flag read between batches: whichever
            # transaction the blackhole caught gives up at the deadline.
            lambda: any(gave_up in e["error"] for e in ingester.events("store_failed")),
            timeout_s=40,
            what="a transaction to give up at its deadline",
        )
        assert ingester.alive()
        proxy.blackhole = False
        wait_all_acked(db_url, redis_url, 500, timeout_s=90, what="recovery after the blackhole")
        assert_clean_end(db_url, redis_url, ids, ingester, acker)
    procs.assert_no_secret_logged()


def test_redis_blackhole_detected_by_timeouts_then_recovered(
    procs: Processes, make_config: Callable[..., Path], db_url: str, own_redis: RedisServer
) -> None:
    with proxy_to(own_redis.port) as proxy:
        config = make_config(
            stream_adapter(STREAM, batch_size=50, block_ms=200), redis=proxy.url_for(own_redis.url)
        )
        ids = produce(own_redis.url, STREAM, 500)
        ingester = procs.start("ingest", config, name="ingester-1")
        acker = procs.start("ack", config, name="acker-1")
        wait_for(lambda: acked(db_url) > 0, timeout_s=30, what="first acks")
        proxy.blackhole = True
        ids += produce(own_redis.url, STREAM, 200, start=500)
        # Nothing answers and nothing resets: only the socket timeouts notice.
        wait_for(lambda: ingester.events("broker_error"), timeout_s=30, what="the ingester to notice")
        assert ingester.alive()
        proxy.blackhole = False
        wait_all_acked(db_url, own_redis.url, 700, timeout_s=90, what="recovery after the blackhole")
        assert any(
            "Timeout" in (e.get("cause") or "") or "Timeout" in e["error"]
            for e in ingester.events("broker_error")
        )
        assert_clean_end(db_url, own_redis.url, ids, ingester, acker)


def test_added_latency_changes_nothing_but_speed(
    procs: Processes, tmp_path: Path, db_url: str, redis_url: str
) -> None:
    ids = produce(redis_url, STREAM, 300)
    with proxy_to(db_port(db_url)) as proxy:
        proxy.latency_s = 0.02
        config = write_config(
            tmp_path / "switchboard.toml",
            database_url=proxy.url_for(db_url),
            redis_url=redis_url,
            adapters=[stream_adapter(STREAM, batch_size=50)],
        )
        ingester = procs.start("ingest", config, name="ingester-1")
        acker = procs.start("ack", config, name="acker-1")
        wait_all_acked(db_url, redis_url, 300, timeout_s=60, what="all acked")
        assert_clean_end(db_url, redis_url, ids, ingester, acker)


def test_a_workers_end_whose_commit_reply_is_lost_is_written_again_and_found_ended(
    procs: Processes, tmp_path: Path, db_url: str, redis_url: str, runs_db: str
) -> None:
    """Workers on PostgreSQL (issue 42): the worker reaches PostgreSQL through
    the proxy, and its first batch of ends (end_runs, on an autocommit
    connection: its own transaction) is cut right after it was sent, before
    its reply: the state writer cannot tell whether it committed. It writes
    the batch again on a new connection, which finds those runs ended
    already (the first write committed) and leaves them as they are: every
    todo done once, its handler run once, nothing rescued."""
    adapters: list[Mapping[str, Any]] = [stream_adapter(STREAM, batch_size=50)]
    queues = {STREAM: QUEUE}
    config = write_config(
        tmp_path / "switchboard.toml",
        database_url=with_secret_db(db_url),
        redis_url=redis_url,
        adapters=adapters,
        queues=queues,
    )
    with proxy_to(db_port(db_url)) as proxy:
        # end_runs is prepared (its text sent once, alone), then executed: cut
        # after the execution of a batch that ends runs done.
        proxy.cut_only_after = b"AS e(id, token, to_status"
        proxy.cut_after = b"done"
        proxy.cut_in_a_later_chunk = True  # its text names 'done' too
        worker_config = write_config(
            tmp_path / "worker.toml",
            database_url=with_secret_db(proxy.url_for(db_url)),
            redis_url=redis_url,
            adapters=adapters,
            queues=queues,
        )
        ingester = procs.start("ingest", config, name="ingester-1")
        acker = procs.start("ack", config, name="acker-1")
        worker = procs.start("worker", worker_config, name="worker-1", args=["--processes", "1"])
        produce(redis_url, STREAM, 20)
        wait_for(lambda: statuses(db_url) == {"done": 20}, timeout_s=60, what="20 todos done")
        assert proxy.cuts == 1
        assert worker.events("todo_ends_retried")
        # Written again, the ends of the batch whose commit went unanswered
        # find their runs ended: their results are the ones stored already.
        assert worker.events("todo_result_discarded")
        stop_all([ingester, acker, worker])
    ids = [int(i) for (i,) in query(db_url, "SELECT id FROM todos")]
    runs = "SELECT todo_id, count(*) FROM handler_runs WHERE outcome = 'started' GROUP BY todo_id"
    assert dict(query(db_url, runs)) == dict.fromkeys(ids, 1)
    for todo_id in ids:
        assert trail(db_url, todo_id) == [(None, "pending"), ("pending", "running"), ("running", "done")]
    assert scalar(db_url, "SELECT count(*) FROM todos WHERE attempts <> 1") == 0
    assert scalar(db_url, "SELECT count(*) FROM todo_events WHERE detail LIKE 'rescued%%'") == 0
    assert worker.events("todo_ends_not_written") == []
    procs.assert_no_secret_logged()
