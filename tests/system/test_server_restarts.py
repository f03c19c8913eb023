"""Servers killed or restarted under real processes: Redis killed -9 and started
again; PostgreSQL backends terminated and the server restarted in immediate mode."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from ingest.embedded.processes import wait_for
from ingest.embedded.servers import PostgresServer, RedisServer
from tests.support.config import stream_adapter, write_config
from tests.support.db import acked, scalar
from tests.support.oracle import assert_clean_end, assert_exactly_once, wait_all_acked
from tests.support.processes import Processes, assert_clean_exit, with_secret_db, with_secret_redis
from tests.support.streams import produce

pytestmark = pytest.mark.system
STREAM = "orders"


def test_redis_killed_and_restarted_ingester_backs_off_and_resumes(
    procs: Processes, make_config: Callable[..., Path], db_url: str, own_redis: RedisServer
) -> None:
    config = make_config(stream_adapter(STREAM, batch_size=50), redis=own_redis.url)
    ids = produce(own_redis.url, STREAM, 1000)
    ingester = procs.start("ingest", config, name="ingester-1")
    acker = procs.start("ack", config, name="acker-1")
    wait_for(lambda: scalar(db_url, "SELECT count(*) FROM todos") > 0, timeout_s=30, what="first todos")
    own_redis.kill()
    wait_for(lambda: ingester.events("broker_error"), timeout_s=30, what="the ingester to notice")
    assert ingester.alive()
    assert acker.alive()
    own_redis.start()  # appendfsync always: every acknowledged XADD survived
    ids += produce(own_redis.url, STREAM, 500, start=1000)
    wait_all_acked(db_url, own_redis.url, 1500, timeout_s=90, what="recovery after the Redis restart")
    errors = ingester.events("broker_error")
    assert all(e["adapter"] == "orders" and e["retry_in_s"] > 0 and "broker" in e for e in errors)
    # Backed off, not a tight loop: capped at 1 s in this config, so few attempts.
    assert len(errors) < 200
    assert_clean_exit(ingester, ingester.terminate())
    assert_clean_exit(acker, acker.terminate())
    assert_exactly_once(db_url, own_redis.url, stream=STREAM, group="switchboard", produced_ids=ids)
    procs.assert_no_secret_logged()


def test_postgres_backends_terminated_and_server_restarted(
    procs: Processes, tmp_path: Path, own_postgres: tuple[PostgresServer, str], redis_url: str
) -> None:
    pg, db_url = own_postgres
    config = write_config(
        tmp_path / "switchboard.toml",
        database_url=with_secret_db(db_url),
        redis_url=with_secret_redis(redis_url),
        adapters=[stream_adapter(STREAM, batch_size=50)],
        ingest={"backoff_initial_ms": 50, "backoff_max_ms": 500},
        acker={"backoff_initial_ms": 50, "backoff_max_ms": 500},
    )
    ids = produce(redis_url, STREAM, 1500)
    ingester = procs.start("ingest", config, name="ingester-1")
    acker = procs.start("ack", config, name="acker-1")
    wait_for(lambda: acked(db_url) > 0, timeout_s=30, what="first acks")
    terminated = scalar(
        db_url,
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
        " WHERE application_name LIKE 'switchboard%%' AND pid <> pg_backend_pid()",
    )
    assert terminated >= 2
    ids += produce(redis_url, STREAM, 500, start=1500)
    pg.stop(mode="immediate")  # no shutdown checkpoint: crash recovery on start
    time.sleep(0.5)  # the database stays down a moment, long enough to be noticed
    pg.start()
    wait_all_acked(
        db_url,
        redis_url,
        2000,
        timeout_s=90,
        what="recovery after terminated backends and an immediate restart",
    )
    assert ingester.events("store_failed") or acker.events("ack_failed")
    assert_clean_end(db_url, redis_url, ids, ingester, acker)
    procs.assert_no_secret_logged()
