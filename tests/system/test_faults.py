"""Real faults against real processes: SIGTERM mid-stream, Redis killed and
restarted, a todo-creation failure in PostgreSQL, the runtime disable flag."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest

from ingest.embedded.processes import wait_for
from ingest.embedded.servers import RedisServer
from tests.support.config import stream_adapter
from tests.support.db import libpq, query, scalar
from tests.support.oracle import assert_clean_end, assert_exactly_once, wait_all_acked
from tests.support.processes import Processes, assert_clean_exit
from tests.support.streams import produce, xpending

pytestmark = pytest.mark.system
STREAM = "orders"


def test_sigterm_mid_stream_exits_0_and_leaves_in_flight_for_redelivery(
    procs: Processes, make_config: Callable[..., Path], db_url: str, redis_url: str
) -> None:
    config = make_config(stream_adapter(STREAM, batch_size=20))
    ids = produce(redis_url, STREAM, 2000)
    ingester = procs.start("ingest", config, name="ingester-1")
    wait_for(lambda: scalar(db_url, "SELECT count(*) FROM todos") > 0, timeout_s=30, what="first todos")
    assert_clean_exit(ingester, ingester.terminate(timeout_s=15))
    stored = scalar(db_url, "SELECT count(*) FROM inbox")
    assert 0 < stored < 2000, "stopped mid-stream"
    # Nothing was acked (no acker ran); every delivered entry is still pending,
    # including any read whose store was abandoned.
    assert xpending(redis_url, STREAM) >= stored
    assert ingester.events("ingester_stopped")
    acker = procs.start("ack", config, name="acker-1")
    restarted = procs.start("ingest", config, name="ingester-1")
    wait_all_acked(
        db_url, redis_url, 2000, timeout_s=60, what="everything stored and acked after the restart"
    )
    assert_clean_end(db_url, redis_url, ids, restarted, acker)


def test_sigterm_while_blocked_in_xreadgroup_exits_promptly(
    procs: Processes, make_config: Callable[..., Path], db_url: str
) -> None:
    config = make_config(stream_adapter(STREAM, block_ms=30_000))
    ingester = procs.start("ingest", config, name="ingester-1")
    acker = procs.start("ack", config, name="acker-1")
    wait_for(lambda: ingester.events("poll_loop_started"), timeout_s=30, what="the poll loop")
    wait_for(lambda: acker.events("listening"), timeout_s=30, what="the acker's LISTEN")
    for p in (ingester, acker):
        p.signal(signal.SIGTERM)
    # Well inside the 30 s block: the read is abandoned, not waited out.
    assert_clean_exit(ingester, ingester.wait(timeout_s=10))
    assert_clean_exit(acker, acker.wait(timeout_s=10))


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


def test_todo_creation_failure_is_logged_not_acked_and_redelivered(
    procs: Processes, make_config: Callable[..., Path], db_url: str, redis_url: str
) -> None:
    query(
        db_url,
        """CREATE FUNCTION fail_todo() RETURNS trigger LANGUAGE plpgsql AS
           $$ BEGIN RAISE EXCEPTION 'todo insert refused by test'; END $$;
           CREATE TRIGGER fail_todo BEFORE INSERT ON todos FOR EACH ROW EXECUTE FUNCTION fail_todo();""",
    )
    config = make_config(stream_adapter(STREAM))
    ids = produce(redis_url, STREAM, 5)
    ingester = procs.start("ingest", config, name="ingester-1")
    acker = procs.start("ack", config, name="acker-1")
    failures = wait_for(lambda: ingester.events("store_failed"), timeout_s=30, what="a logged store failure")
    f = failures[0]
    assert f["error_type"] == "StoreError"
    assert f["cause"] == "RaiseException"
    assert "adapter orders" in f["error"]
    assert "todo insert refused by test" in f["error"]
    assert f["level"] == "warning"
    assert scalar(db_url, "SELECT count(*) FROM inbox") == 0
    assert xpending(redis_url, STREAM) == 5  # delivered, never acked
    query(db_url, "DROP TRIGGER fail_todo ON todos")
    wait_all_acked(db_url, redis_url, 5, timeout_s=30, what="redelivery after the fault is fixed")
    assert_clean_end(db_url, redis_url, ids, ingester, acker)


def _cli(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-X", "dev", "-W", "error", "-m", "ingest", "--config", str(config), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_disabled_adapter_does_not_consume_until_enabled(
    procs: Processes, make_config: Callable[..., Path], db_url: str, redis_url: str
) -> None:
    config = make_config(stream_adapter(STREAM))
    ingester = procs.start("ingest", config, name="ingester-1")
    acker = procs.start("ack", config, name="acker-1")
    wait_for(lambda: ingester.events("poll_loop_started"), timeout_s=30, what="the poll loop")
    assert _cli(config, "adapters", "disable", "orders").returncode == 0
    wait_for(lambda: ingester.events("adapter_disabled"), timeout_s=30, what="the flag to be seen")
    ids = produce(redis_url, STREAM, 50)
    # An observation window of many refresh periods (200 ms): no read at all.
    with pytest.raises(AssertionError, match="timed out"):
        wait_for(lambda: xpending(redis_url, STREAM) > 0, timeout_s=1.5, what="any consumption")
    assert scalar(db_url, "SELECT count(*) FROM inbox") == 0
    listing = _cli(config, "adapters", "list")
    assert "orders" in listing.stdout
    assert "disabled" in listing.stdout
    assert _cli(config, "adapters", "enable", "orders").returncode == 0
    wait_for(
        lambda: scalar(db_url, "SELECT count(*) FROM inbox WHERE ack_state = 'acked'") == 50,
        timeout_s=30,
        what="consumption after enable",
    )
    assert ingester.events("adapter_enabled")
    assert_clean_end(db_url, redis_url, ids, ingester, acker)


def test_sigterm_while_a_store_transaction_is_open_exits_0_with_nothing_half_done(
    procs: Processes, make_config: Callable[..., Path], db_url: str, redis_url: str
) -> None:
    config = make_config(stream_adapter(STREAM, batch_size=20), ingest={"shutdown_timeout_s": 2})
    ids = produce(redis_url, STREAM, 100)
    with psycopg.connect(libpq(db_url)) as blocker:
        # Another session holds the todos table: the ingester's store starts,
        # writes what it can, and waits inside its open transaction.
        blocker.execute("LOCK TABLE todos IN ACCESS EXCLUSIVE MODE")
        ingester = procs.start("ingest", config, name="ingester-1")
        wait_for(
            lambda: scalar(
                db_url,
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'switchboard'"
                " AND wait_event_type = 'Lock'",
            ),
            timeout_s=30,
            what="the store to block inside its transaction",
        )
        ingester.signal(signal.SIGTERM)
        code = ingester.wait(timeout_s=15)  # the shutdown deadline cancels the blocked store
        blocker.rollback()
    assert_clean_exit(ingester, code)
    assert ingester.events("shutdown_deadline_exceeded")
    for table in ("inbox", "events", "todos"):
        assert scalar(db_url, f"SELECT count(*) FROM {table}") == 0
    assert xpending(redis_url, STREAM) > 0  # read, not stored, not acked: pending for redelivery
    acker = procs.start("ack", config, name="acker-1")
    restarted = procs.start("ingest", config, name="ingester-1")
    wait_all_acked(db_url, redis_url, 100, timeout_s=60, what="redelivery after the restart")
    assert_clean_end(db_url, redis_url, ids, restarted, acker)
