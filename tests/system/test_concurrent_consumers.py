"""A concurrency stress run: three ingesters and two ackers, poison in the
ledger, one ingester killed for good, and a watcher that must never see a
duplicate todo."""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest
import redis

from ingest.embedded.processes import wait_ready
from tests.support.config import stream_adapter
from tests.support.db import acked, libpq, query, unacked
from tests.support.oracle import wait_all_acked
from tests.support.processes import Processes, stop_settled
from tests.support.streams import xpending

pytestmark = pytest.mark.system
STREAM = "orders"


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
                    " WHERE status NOT IN ('done', 'failed', 'cancelled')"  # every active todo
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
    alive = [proc for proc in workers if proc.alive()]
    for proc in alive:
        wait_ready(proc)
    stop_settled(
        alive,
        lambda: acked(db_url) == len(ledger) and xpending(redis_url, STREAM) == 0,
        what=f"convergence (seed {seed})",
    )
    good = [i for i in ledger if i not in poison]
    keys = sorted(k for (k,) in query(db_url, "SELECT idempotency_key FROM todos"))
    assert keys == sorted(f"redis:{STREAM}:{i}" for i in good)
    rejected = {m for (m,) in query(db_url, "SELECT source_message_id FROM inbox WHERE status = 'rejected'")}
    assert rejected == poison
    assert unacked(db_url) == 0
    procs.assert_no_secret_logged()
