"""Claimed at fetch, finished in the background (issue 25), with real
`switchboard ingest`, `ack` and `worker` processes, PostgreSQL and Redis:

- a worker killed -9 after its handlers ran but before their ends were
  committed loses only those ends: dramatiq still holds those messages
  (their acks wait for the commit), and the todos are rescued and run again
  (at least once, counted in ``handler_runs``);
- a worker stopped gracefully with messages fetched and claimed but not
  run gives their claims back: dispatched again at once, their attempts not
  counted, run by the next worker without waiting for a lease to expire.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from ingest.embedded.processes import wait_for, wait_ready
from ingest.processes.worker_claims import GIVEN_BACK
from tests.support.config import stream_adapter
from tests.support.db import query, scalar
from tests.support.downstream import (
    FAST_RESCUE,
    QUEUE,
    assert_one_path,
    dramatiq_url,
    statuses,
    stop_all,
    trail,
)
from tests.support.processes import Processes

pytestmark = pytest.mark.system
STREAM = "orders"


def produce(redis_url: str, payloads: list[dict[str, Any]]) -> None:
    with redis.Redis.from_url(redis_url, socket_timeout=10) as r:
        pipe = r.pipeline(transaction=False)
        for p in payloads:
            pipe.xadd(STREAM, {"body": json.dumps(p)})
        pipe.execute()


def todos_of_unacked_messages(dramatiq_redis: str) -> set[int]:
    """The todo ids of the messages some dramatiq worker fetched and never
    acked (its ``__acks__`` sets), from the messages' bodies."""
    ids: set[int] = set()
    with redis.Redis.from_url(dramatiq_redis, socket_timeout=10) as r:
        for key in r.scan_iter(match="dramatiq:__acks__.*"):
            queue = key.decode().rsplit(".", 1)[1]
            for message_id in r.smembers(key):
                body = r.hget(f"dramatiq:{queue}.msgs", message_id)
                if body is not None:
                    ids.add(int(json.loads(body)["args"][0]))
    return ids


def test_a_worker_killed_before_its_ends_commit_is_run_again_and_its_messages_were_held(
    procs: Processes, make_config: Callable[..., Path], db_url: str, redis_url: str, runs_db: str
) -> None:
    n = 40
    config = make_config(
        stream_adapter(STREAM, batch_size=50),
        queues={STREAM: {**QUEUE, "max_attempts": 5, "time_limit_ms": 3000, "lease_margin_ms": 2000}},
        acker=FAST_RESCUE,
        dramatiq_url=dramatiq_url(redis_url),
    )
    ingester = procs.start("ingest", config, name="ingester-1")
    acker = procs.start("ack", config, name="acker-1")
    wait_ready(ingester)
    wait_ready(acker)
    # The first batch of ends a worker process writes kills it, before the commit.
    worker = procs.start("worker", config, name="worker-1", failpoints="worker_before_end_commit=kill@1")
    produce(redis_url, [{"n": i} for i in range(n)])
    worker.wait(60)  # dramatiq's main process ends when one of its workers dies
    ran_once = {
        int(t) for (t,) in query(db_url, "SELECT DISTINCT todo_id FROM handler_runs WHERE outcome = 'done'")
    }
    assert ran_once, "no handler ran before the kill"
    undone = {int(t) for (t,) in query(db_url, "SELECT id FROM todos WHERE status <> 'done'")}
    lost_ends = ran_once & undone
    assert lost_ends, "every end of the killed batch was committed: the failpoint fired after the commit"
    # Their messages were not acked: dramatiq acks only once the end is committed.
    assert lost_ends <= todos_of_unacked_messages(dramatiq_url(redis_url))

    second = procs.start("worker", config, name="worker-2")
    wait_for(lambda: statuses(db_url) == {"done": n}, timeout_s=120, what=f"{n} todos done after the kill")
    stop_all([ingester, acker, second])
    runs = dict(
        query(db_url, "SELECT todo_id, count(*) FROM handler_runs WHERE outcome = 'done' GROUP BY todo_id")
    )
    assert set(runs) == {int(t) for (t,) in query(db_url, "SELECT id FROM todos")}
    # Run again: exactly the todos whose end the kill lost (or another run
    # the kill cut off); nothing ran more than twice.
    assert {t for t, c in runs.items() if c == 2} >= lost_ends
    assert max(runs.values()) <= 2
    rescued = {
        int(t)
        for (t,) in query(
            db_url, "SELECT todo_id FROM todo_events WHERE detail = 'rescued: its lease expired'"
        )
    }
    assert lost_ends <= rescued
    for todo_id in runs:
        assert_one_path(trail(db_url, todo_id))


def test_a_graceful_stop_gives_back_the_claims_of_messages_it_fetched_and_never_ran(
    procs: Processes, make_config: Callable[..., Path], db_url: str, redis_url: str, runs_db: str
) -> None:
    """A long lease (60 s + 30 s) and the default dispatch timeout (5 min):
    a claim not given back would sit out its lease before the next worker
    ran it; given back, it runs at once."""
    n = 60
    config = make_config(
        stream_adapter(STREAM, batch_size=100),
        queues={STREAM: {**QUEUE, "time_limit_ms": 60_000, "lease_margin_ms": 30_000}},
        dramatiq_url=dramatiq_url(redis_url),
    )
    produce(redis_url, [{"n": i, "sleep_s": 1.0} for i in range(n)])
    ingester = procs.start("ingest", config, name="ingester-1")
    acker = procs.start("ack", config, name="acker-1")
    wait_for(lambda: statuses(db_url).get("dispatched", 0) + statuses(db_url).get("running", 0) == n,
             timeout_s=60, what="every todo dispatched")  # fmt: skip
    worker = procs.start("worker", config, name="worker-1")
    wait_ready(worker)
    # 2 processes x 8 threads run 16 at once; more running means fetched and claimed, waiting.
    wait_for(
        lambda: statuses(db_url).get("running", 0) > 20,
        timeout_s=60,
        what="claims beyond the running handlers",
    )
    code = worker.terminate()
    assert code == 0, worker.raw_log()[-3000:]
    given_back = {
        int(t)
        for (t,) in query(db_url, "SELECT todo_id FROM todo_events WHERE detail = %(d)s", {"d": GIVEN_BACK})
    }
    assert given_back, "no claim was given back"
    # None of them ran, and none holds an attempt now.
    assert (
        scalar(
            db_url, "SELECT count(*) FROM handler_runs WHERE todo_id = ANY(%(t)s)", {"t": list(given_back)}
        )
        == 0
    )
    not_back = (
        "SELECT count(*) FROM todos WHERE id = ANY(%(t)s) AND (status <> 'dispatched' OR attempts <> 0)"
    )
    assert scalar(db_url, not_back, {"t": list(given_back)}) == 0
    assert scalar(db_url, "SELECT count(*) FROM todos WHERE status = 'running'") == 0

    second = procs.start("worker", config, name="worker-2")
    wait_for(lambda: statuses(db_url) == {"done": n}, timeout_s=60, what=f"{n} todos done, within the lease")
    stop_all([ingester, acker, second])
    assert scalar(db_url, "SELECT count(*) FROM todo_events WHERE detail LIKE 'rescued:%%'") == 0
    assert query(db_url, "SELECT DISTINCT attempts FROM todos") == [(1,)]
    assert scalar(db_url, "SELECT count(*) FROM handler_runs WHERE outcome = 'done'") == n
    for (todo_id,) in query(db_url, "SELECT id FROM todos"):
        assert_one_path(trail(db_url, todo_id))
