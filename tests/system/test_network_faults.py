"""Network faults through an in-repo TCP proxy between real switchboard
processes and real servers: latency, a Redis blackhole (no reset: only
timeouts can tell), and a PostgreSQL connection cut right after COMMIT was
sent, before its reply (the outcome is unknown to the ingester)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest

from ingest.embedded.processes import SwitchboardProcess, wait_for
from ingest.embedded.servers import RedisServer
from tests.support.config import stream_adapter, write_config
from tests.support.db import acked, scalar
from tests.support.oracle import assert_clean_end, assert_exactly_once, wait_all_acked
from tests.support.processes import Processes, assert_clean_exit, with_secret_db
from tests.support.proxy import Proxy, proxy_to
from tests.support.streams import produce

pytestmark = pytest.mark.system
STREAM = "orders"


def db_port(db_url: str) -> int:
    return int(db_url.rsplit(":", 1)[1].split("/", 1)[0])


def ingester_through_proxy(
    procs: Processes, tmp_path: Path, proxy: Proxy, db_url: str, redis_url: str, **database: int
) -> tuple[SwitchboardProcess, SwitchboardProcess]:
    """An acker on PostgreSQL directly and an ingester through the proxy,
    started in that order."""
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
    acker = procs.start("ack", ack_config, name="acker-1")
    return acker, procs.start("ingest", ingest_config, name="ingester-1")


def test_commit_reply_lost_outcome_unknown_redelivery_resolves_it(
    procs: Processes, tmp_path: Path, db_url: str, redis_url: str
) -> None:
    with proxy_to(db_port(db_url)) as proxy:
        acker, ingester = ingester_through_proxy(procs, tmp_path, proxy, db_url, redis_url)
        wait_for(lambda: ingester.events("group_created"), timeout_s=30, what="the consumer group")
        # A store's COMMIT, not a heartbeat's or another transaction's that
        # may come first on a loaded machine (seen in CI).
        proxy.cut_only_after = b"INSERT INTO inbox"
        proxy.cut_after = b"COMMIT"
        ids = produce(redis_url, STREAM, 300)
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
        assert_clean_exit(ingester, ingester.terminate())
        assert_clean_exit(acker, acker.terminate())
    assert_exactly_once(db_url, own_redis.url, stream=STREAM, group="switchboard", produced_ids=ids)


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
