"""PostgreSQL under real processes: its backends terminated and the server
restarted in immediate mode. A broker killed and started again is every
transport's test (test_transport_faults.py)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from ingest.embedded.processes import wait_for
from ingest.embedded.servers import PostgresServer
from tests.support.config import stream_adapter, write_config
from tests.support.db import acked, scalar
from tests.support.oracle import assert_clean_end, wait_all_acked
from tests.support.processes import Processes, with_secret_db, with_secret_redis
from tests.support.streams import produce

pytestmark = pytest.mark.system
STREAM = "orders"


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
