"""More real faults: PostgreSQL backends terminated and the server restarted
in immediate mode; a consumer frozen with SIGSTOP whose entries another
claims; a concurrency stress run with poison in the ledger and a watcher that
must never see a duplicate todo."""

from __future__ import annotations

import json
import random
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest
import redis

from ingest.embedded.processes import wait_for, wait_ready
from ingest.embedded.servers import PostgresServer
from tests.support.config import stream_adapter, write_config
from tests.support.db import acked, libpq, query, scalar
from tests.support.oracle import assert_clean_end, assert_exactly_once, wait_all_acked
from tests.support.processes import Processes, assert_clean_exit, with_secret_db, with_secret_redis
from tests.support.streams import produce, xpending

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
    wait_all_acked(
        db_url, redis_url, 300, timeout_s=60, what="the other consumer to claim and store everything"
    )
    todos_before = query(db_url, "SELECT id, idempotency_key, status FROM todos ORDER BY id")
    events_before = scalar(db_url, "SELECT count(*) FROM events")
    frozen.signal(signal.SIGCONT)
    # The stale batch is stored now: every entry of it is already in the inbox.
    wait_for(lambda: frozen.events("batch_stored")[1:], timeout_s=30, what="the stale batch's store")
    stale = frozen.events("batch_stored")[1]
    assert (stale["new"], stale["todos_created"]) == (0, 0)
    assert stale["redelivered"] == stale["messages"]
    wait_for(lambda: xpending(redis_url, STREAM) == 0, timeout_s=30, what="re-requested acks discharged")
    assert query(db_url, "SELECT id, idempotency_key, status FROM todos ORDER BY id") == todos_before
    assert scalar(db_url, "SELECT count(*) FROM events") == events_before
    for proc in (frozen, other, acker):
        assert_clean_exit(proc, proc.terminate())
    assert_exactly_once(db_url, redis_url, stream=STREAM, group="switchboard", produced_ids=ids)


class DuplicateWatcher(threading.Thread):
    """Polls for two active todos with one key, for as long as the run lasts."""

    def __init__(self, db_url: str) -> None:
        super().__init__(daemon=True)
        self._url = libpq(db_url)
        self._stop_event = threading.Event()
        self.polls = 0
        self.duplicates: list[tuple[object, ...]] = []

    def run(self) -> None:
        with psycopg.connect(self._url, autocommit=True) as conn:
            while not self._stop_event.wait(0.02):
                self.duplicates += conn.execute(
                    "SELECT queue, idempotency_key, count(*) FROM todos"
                    " WHERE status IN ('pending', 'dispatched', 'running')"
                    " GROUP BY 1, 2 HAVING count(*) > 1"
                ).fetchall()
                self.polls += 1

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=10)


def test_three_ingesters_two_ackers_with_poison_under_a_duplicate_watcher(
    procs: Processes, make_config: Callable[..., Path], db_url: str, redis_url: str
) -> None:
    seed = random.randrange(2**32)
    print(f"stress seed: {seed}")
    rng = random.Random(seed)
    config = make_config(stream_adapter(STREAM, batch_size=100, claim_idle_ms=2000, claim_interval_ms=300))
    ledger: list[str] = []
    poison: set[str] = set()
    watcher = DuplicateWatcher(db_url)
    watcher.start()
    workers = [procs.start("ingest", config, name=f"ingester-{i}") for i in (1, 2, 3)]
    workers += [procs.start("ack", config, name=f"acker-{i}") for i in (1, 2)]
    with redis.Redis.from_url(redis_url, socket_timeout=10) as r:
        for _round in range(6):
            pipe = r.pipeline(transaction=False)
            kinds = []
            for i in range(500):
                if rng.random() < 0.02:
                    kinds.append(True)
                    pipe.xadd(STREAM, {"body": rng.choice([b"{nope", b"\xff\xfe", b'{"a": NaN}'])})
                else:
                    kinds.append(False)
                    pipe.xadd(STREAM, {"body": json.dumps({"round": _round, "i": i})})
            for entry_id, is_poison in zip(pipe.execute(), kinds, strict=True):
                ledger.append(entry_id.decode())
                if is_poison:
                    poison.add(entry_id.decode())
            time.sleep(rng.uniform(0.05, 0.3))  # producers arrive in waves, not all at once
        workers[rng.randrange(3)].kill()  # one ingester dies mid-run for good; others claim its PEL
    wait_all_acked(db_url, redis_url, len(ledger), timeout_s=120, what=f"convergence (seed {seed})")
    watcher.stop()
    assert watcher.polls > 10
    assert watcher.duplicates == []
    for proc in workers:
        if proc.alive():
            wait_ready(proc)
            assert_clean_exit(proc, proc.terminate())
    good = [i for i in ledger if i not in poison]
    keys = sorted(k for (k,) in query(db_url, "SELECT idempotency_key FROM todos"))
    assert keys == sorted(f"redis:{STREAM}:{i}" for i in good)
    rejected = {m for (m,) in query(db_url, "SELECT source_message_id FROM inbox WHERE status = 'rejected'")}
    assert rejected == poison
    assert scalar(db_url, "SELECT count(*) FROM inbox WHERE ack_state <> 'acked'") == 0
    procs.assert_no_secret_logged()
