"""Transient failures are never poison (issue 4): each one named here is
produced for real in a real server while real ``switchboard ingest`` and
``switchboard ack`` processes run, and must end in a failure that is logged,
backed off and retried, with nothing rejected and the exactly-once oracle
holding afterwards.

Redis: CLIENT PAUSE longer than the socket timeout, MISCONF (an RDB save
that fails, with stop-writes-on-bgsave-error), LOADING (a restart that
loads its dataset slowly). PostgreSQL: lock timeout, a real deadlock, and a
serialization failure raised at COMMIT by a deferred trigger.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis

from ingest.embedded.processes import SwitchboardProcess, wait_for
from ingest.embedded.servers import RedisServer
from tests.support.config import stream_adapter
from tests.support.db import acked, libpq, query, scalar
from tests.support.oracle import assert_clean_end, wait_all_acked
from tests.support.processes import Processes
from tests.support.streams import produce

pytestmark = pytest.mark.system
STREAM = "orders"
# Test configs back off from 50 ms up to 1 s; a tight retry loop would log
# thousands of failures in the seconds a fault lasts here.
MAX_FAILURES_LOGGED = 60


def failures(proc: SwitchboardProcess, marker: str) -> list[dict[str, Any]]:
    """The process's logged, retried failures whose error mentions ``marker``."""
    events = proc.events("broker_error") + proc.events("store_failed") + proc.events("ack_failed")
    return [e for e in events if marker.lower() in e["error"].lower()]


def assert_retried_not_poison(db_url: str, *procs: SwitchboardProcess) -> None:
    assert scalar(db_url, "SELECT count(*) FROM inbox WHERE status = 'rejected'") == 0
    for proc in procs:
        assert not proc.events("poll_step_crashed"), proc.raw_log()[-3000:]
        retried = proc.events("broker_error") + proc.events("store_failed") + proc.events("ack_failed")
        assert len(retried) < MAX_FAILURES_LOGGED, f"{proc.log_path.name}: {len(retried)} retries logged"
        # (A commit that failed beside the one that set off the backoff has none of its own.)
        assert all(e.get("retry_in_s", 0) <= 1.0 for e in retried), "backoff must stay capped"


def finish(
    db_url: str, redis_url: str, procs: Processes, ids: list[str], *running: SwitchboardProcess
) -> None:
    wait_all_acked(db_url, redis_url, len(ids), timeout_s=90, what="all acked after the fault")
    assert_retried_not_poison(db_url, *running)
    assert_clean_end(db_url, redis_url, ids, *running)
    procs.assert_no_secret_logged()


def start_pair(procs: Processes, config: Path) -> tuple[SwitchboardProcess, SwitchboardProcess]:
    return procs.start("ingest", config, name="ingester-1"), procs.start("ack", config, name="acker-1")


# -- Redis ---------------------------------------------------------------------


def test_redis_client_pause_longer_than_the_socket_timeout(
    procs: Processes, make_config: Callable[..., Path], db_url: str, own_redis: RedisServer
) -> None:
    """Every command, the ingester's blocked XREADGROUP included, waits out the
    pause; the client gives up first (block + 5 s margin) while the server
    still runs the abandoned read afterwards. Entries it delivers to the
    abandoned connection sit in the PEL and come back with the re-read."""
    config = make_config(stream_adapter(STREAM, batch_size=50, block_ms=200), redis=own_redis.url)
    ids = produce(own_redis.url, STREAM, 500)
    ingester, acker = start_pair(procs, config)
    wait_all_acked(db_url, own_redis.url, 500, timeout_s=60, what="the first entries")
    with redis.Redis.from_url(own_redis.url, socket_timeout=10) as r:
        r.client_pause(7000, all=True)
    # Written while paused: the XADDs complete when the pause ends.
    more: list[str] = []
    producer = threading.Thread(target=lambda: more.extend(produce(own_redis.url, STREAM, 500, start=500)))
    producer.start()
    producer.join(timeout=30)
    assert not producer.is_alive()
    ids += more
    wait_for(lambda: failures(ingester, "timeout"), timeout_s=30, what="the ingester's read to time out")
    finish(db_url, own_redis.url, procs, ids, ingester, acker)


def test_redis_misconf_refuses_writes_until_a_save_succeeds(
    procs: Processes, make_config: Callable[..., Path], db_url: str, own_redis: RedisServer
) -> None:
    """A failed RDB save with stop-writes-on-bgsave-error refuses every write
    command, XREADGROUP and XACK included, with MISCONF. The save is made to
    fail for real: its target name is a directory, so the rename fails."""
    own_redis.stop()
    own_redis.config_path.write_text(own_redis.config_path.read_text() + 'dbfilename "blocked.rdb"\n')
    own_redis.start()
    config = make_config(stream_adapter(STREAM, batch_size=50, block_ms=200), redis=own_redis.url)
    ids = produce(own_redis.url, STREAM, 600)
    ingester = procs.start("ingest", config, name="ingester-1")
    stored = "SELECT count(*) FROM inbox WHERE ack_state = 'pending'"
    wait_for(lambda: scalar(db_url, stored) == 600, timeout_s=30, what="all stored, none acked")
    blocker = own_redis.base_dir / "blocked.rdb"
    blocker.mkdir()
    with redis.Redis.from_url(own_redis.url, socket_timeout=10) as r:
        r.config_set("save", "3600 1")
        r.bgsave()
        wait_for(lambda: last_bgsave(r) == "err", timeout_s=30, what="the save to fail")
        wait_for(lambda: failures(ingester, "MISCONF"), timeout_s=30, what="the ingester to meet MISCONF")
        acker = procs.start("ack", config, name="acker-1")  # its XACKs meet MISCONF too
        wait_for(lambda: failures(acker, "MISCONF"), timeout_s=30, what="the acker to meet MISCONF")
        assert ingester.alive()
        assert acker.alive()
        blocker.rmdir()
        r.bgsave()
        wait_for(lambda: last_bgsave(r) == "ok", timeout_s=30, what="a save to succeed")
    finish(db_url, own_redis.url, procs, ids, ingester, acker)


def last_bgsave(r: redis.Redis) -> str:
    info = r.info("persistence")
    return "running" if info["rdb_bgsave_in_progress"] else str(info["rdb_last_bgsave_status"])


def test_redis_loading_after_a_restart(
    procs: Processes, make_config: Callable[..., Path], db_url: str, own_redis: RedisServer
) -> None:
    """Restarted with a dataset that loads slowly (``key-load-delay``, a
    server debugging setting), Redis answers LOADING for seconds."""
    with redis.Redis.from_url(own_redis.url, socket_timeout=10) as r:
        pipe = r.pipeline(transaction=False)
        for i in range(30_000):
            pipe.set(f"filler:{i}", "x")
        pipe.execute()
    config = make_config(stream_adapter(STREAM, batch_size=50, block_ms=200), redis=own_redis.url)
    ids = produce(own_redis.url, STREAM, 600)
    ingester, acker = start_pair(procs, config)
    wait_for(lambda: acked(db_url) > 0, timeout_s=30, what="first acks")
    with redis.Redis.from_url(own_redis.url, socket_timeout=10) as r:
        # The rewrite puts the keys in the AOF's RDB base, where the delay applies.
        r.bgrewriteaof()
        wait_for(lambda: not aof_rewriting(r), timeout_s=30, what="the AOF rewrite")
    own_redis.stop()
    # Events (and so the LOADING replies) are served between chunks of the load.
    slow = "key-load-delay 30\nloading-process-events-interval-bytes 1024\n"
    own_redis.config_path.write_text(own_redis.config_path.read_text() + slow)
    own_redis.start(timeout_s=120)  # returns once PING answers, i.e. loading is over
    assert failures(ingester, "loading"), "the ingester must have met LOADING while the dataset loaded"
    finish(db_url, own_redis.url, procs, ids, ingester, acker)


def aof_rewriting(r: redis.Redis) -> bool:
    info = r.info("persistence")
    return bool(info["aof_rewrite_in_progress"] or info["aof_rewrite_scheduled"])


# -- PostgreSQL ----------------------------------------------------------------


@contextmanager
def session(db_url: str) -> Iterator[psycopg.Connection[Any]]:
    """A test-side session that holds locks for as long as the test needs."""
    with psycopg.connect(libpq(db_url), connect_timeout=10) as conn:
        conn.execute("SET statement_timeout = '60s'")
        yield conn


def test_postgres_lock_timeout(
    procs: Processes, make_config: Callable[..., Path], db_url: str, redis_url: str
) -> None:
    config = make_config(stream_adapter(STREAM, batch_size=50), database={"lock_timeout_ms": 300})
    ids = produce(redis_url, STREAM, 300)
    ingester, acker = start_pair(procs, config)
    wait_all_acked(db_url, redis_url, 300, timeout_s=60, what="the first entries")
    with session(db_url) as conn:
        conn.execute("LOCK TABLE todos IN SHARE ROW EXCLUSIVE MODE")  # blocks every INSERT
        ids += produce(redis_url, STREAM, 300, start=300)
        wait_for(lambda: len(failures(ingester, "lock timeout")) >= 2, timeout_s=30, what="lock timeouts")
        conn.commit()
    finish(db_url, redis_url, procs, ids, ingester, acker)


def head_deliveries(redis_url: str) -> int:
    """How many times Redis has delivered the oldest pending entry (0 before
    the ingester made its group)."""
    with redis.Redis.from_url(redis_url, socket_timeout=10) as r:
        if not any(g["name"] == b"switchboard" for g in r.xinfo_groups(STREAM)):
            return 0
        pending = r.xpending_range(STREAM, "switchboard", min="-", max="+", count=1)
    return int(pending[0]["times_delivered"]) if pending else 0


def test_a_lock_held_past_max_deliveries_never_makes_the_head_poison(
    procs: Processes, make_config: Callable[..., Path], db_url: str, redis_url: str
) -> None:
    """Issue 11, item 1: while the lock is held, the entries are redelivered
    until they are suspects, and the head's lone attempts all fail on the lock
    timeout, many more times than max_deliveries. None of those attempts may
    count: once the lock goes, every entry has its todo and none is
    rejected. (Before the fix the head was rejected as
    max_deliveries_exceeded and acked without a todo.)"""
    max_deliveries = 3
    config = make_config(
        stream_adapter(STREAM, batch_size=20, max_deliveries=max_deliveries),
        database={"lock_timeout_ms": 300},
    )
    with session(db_url) as conn:
        conn.execute("LOCK TABLE todos IN SHARE ROW EXCLUSIVE MODE")  # blocks every INSERT
        ids = produce(redis_url, STREAM, 40)
        ingester, acker = start_pair(procs, config)
        # Two batched deliveries, then lone attempts: twice the limit of them.
        wanted = 2 + 2 * max_deliveries
        wait_for(lambda: head_deliveries(redis_url) >= wanted, timeout_s=60, what=f"{wanted} deliveries")
        assert ingester.events("lone_attempt_reopened"), "the head's lone attempts must have failed"
        conn.commit()
    finish(db_url, redis_url, procs, ids, ingester, acker)
    assert scalar(db_url, "SELECT count(*) FROM todos") == len(ids)


def test_postgres_deadlock(
    procs: Processes, make_config: Callable[..., Path], db_url: str, redis_url: str
) -> None:
    """A real deadlock: the store (through a trigger) holds advisory lock 2 and
    waits for 1, which this test holds while it then asks for 2. The store's
    backend waited first, so its deadlock check runs first and it is the one
    aborted (this session's own check is put off for good measure)."""
    for statement in (
        "CREATE TABLE fault_flags (name text PRIMARY KEY)",
        "INSERT INTO fault_flags VALUES ('deadlock')",
        """CREATE FUNCTION fault_deadlock() RETURNS trigger LANGUAGE plpgsql AS $$
           BEGIN
             IF EXISTS (SELECT 1 FROM fault_flags WHERE name = 'deadlock') THEN
               PERFORM pg_advisory_xact_lock(2);
               PERFORM pg_advisory_xact_lock(1);
               DELETE FROM fault_flags WHERE name = 'deadlock';
             END IF;
             RETURN NULL;
           END $$""",
        # On todos_live, which the store inserts into (a statement trigger of
        # the partitioned todos fires only for statements naming it).
        "CREATE TRIGGER fault_deadlock BEFORE INSERT ON todos_live"
        " FOR EACH STATEMENT EXECUTE FUNCTION fault_deadlock()",
    ):
        query(db_url, statement)
    config = make_config(stream_adapter(STREAM, batch_size=50))
    ingester, acker = start_pair(procs, config)
    with session(db_url) as conn:
        conn.execute("SET deadlock_timeout = '30s'")
        conn.execute("SELECT pg_advisory_xact_lock(1)")
        ids = produce(redis_url, STREAM, 300)
        wait_for(
            lambda: (
                scalar(
                    db_url,
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objid = 1 AND NOT granted",
                )
                == 1
            ),
            timeout_s=30,
            what="the store to wait for advisory lock 1",
        )
        conn.execute("SELECT pg_advisory_xact_lock(2)")  # closes the cycle; returns once the store is aborted
        conn.commit()
    finish(db_url, redis_url, procs, ids, ingester, acker)
    assert failures(ingester, "deadlock detected")
    assert scalar(db_url, "SELECT count(*) FROM fault_flags") == 0  # the retry went through the trigger


def test_postgres_serialization_failure_at_commit(
    procs: Processes, make_config: Callable[..., Path], db_url: str, redis_url: str
) -> None:
    """SQLSTATE 40001 raised by a deferred constraint trigger, i.e. by COMMIT
    itself, for the first two commits (a sequence counts, as it is not
    rolled back)."""
    for statement in (
        "CREATE SEQUENCE fault_serialization",
        """CREATE FUNCTION fault_serialization() RETURNS trigger LANGUAGE plpgsql AS $$
           BEGIN
             IF nextval('fault_serialization') <= 2 THEN
               RAISE EXCEPTION 'injected serialization failure'
                 USING ERRCODE = 'serialization_failure';
             END IF;
             RETURN NULL;
           END $$""",
        "CREATE CONSTRAINT TRIGGER fault_serialization AFTER INSERT ON todos"
        " DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION fault_serialization()",
    ):
        query(db_url, statement)
    config = make_config(stream_adapter(STREAM, batch_size=50))
    ids = produce(redis_url, STREAM, 300)
    ingester, acker = start_pair(procs, config)
    wait_all_acked(db_url, redis_url, 300, timeout_s=60, what="all acked")
    found = failures(ingester, "SerializationFailure")
    assert len(found) == 2
    assert all("injected serialization failure" in e["error"] for e in found)
    finish(db_url, redis_url, procs, ids, ingester, acker)
