"""Downstream (issue 12): real `switchboard ingest`, `ack` (its dispatch
relay and rescuer) and `worker` (dramatiq worker processes) against real
PostgreSQL and Redis. The handlers (tests/support/handlers.py) record every
run in ``handler_runs``, so each test asserts on what ran, not on logs."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from backhalf.dispatch import Enqueuer
from backhalf.queues import QueueConfig
from ingest.embedded.processes import SwitchboardProcess, wait_for
from tests.support.config import stream_adapter
from tests.support.db import query, scalar
from tests.support.downstream import (
    FAST_RESCUE,
    HANDLER,
    QUEUE,
    assert_one_path,
    dramatiq_url,
    statuses,
    stop_all,
    trail,
)
from tests.support.processes import Processes, assert_clean_exit

pytestmark = pytest.mark.system
STREAM = "orders"


def produce_payloads(redis_url: str, payloads: list[dict[str, Any]]) -> list[str]:
    with redis.Redis.from_url(redis_url, socket_timeout=10) as r:
        return [r.xadd(STREAM, {"body": json.dumps(p)}).decode() for p in payloads]


def start_all(procs: Processes, config: Path, *, worker_name: str = "worker-1") -> list[SwitchboardProcess]:
    return [
        procs.start("ingest", config, name="ingester-1"),
        procs.start("ack", config, name="acker-1"),
        procs.start("worker", config, name=worker_name),
    ]


def test_an_entry_becomes_a_todo_that_a_worker_does(
    procs: Processes, make_config: Callable[..., Path], db_url: str, redis_url: str, runs_db: str
) -> None:
    config = make_config(
        stream_adapter(STREAM, batch_size=50),
        queues={STREAM: QUEUE},
        dramatiq_url=dramatiq_url(redis_url),
    )
    ids = produce_payloads(redis_url, [{"n": i} for i in range(30)])
    running = start_all(procs, config)
    wait_for(lambda: statuses(db_url) == {"done": 30}, timeout_s=90, what="30 todos done")
    stop_all(running)
    assert scalar(db_url, "SELECT count(*) FROM handler_runs WHERE outcome = 'done'") == 30
    assert scalar(db_url, "SELECT count(DISTINCT todo_id) FROM handler_runs") == 30
    for (todo_id,) in query(db_url, "SELECT id FROM todos"):
        assert_one_path(trail(db_url, todo_id))
        assert trail(db_url, todo_id) == [
            (None, "pending"), ("pending", "dispatched"), ("dispatched", "running"), ("running", "done"),
        ]  # fmt: skip
    assert scalar(db_url, "SELECT count(*) FROM todos WHERE attempts <> 1") == 0
    assert scalar(db_url, "SELECT count(*) FROM inbox WHERE ack_state = 'acked'") == len(ids)


def test_failures_are_retried_then_failed_without_blocking_the_others(
    procs: Processes, make_config: Callable[..., Path], db_url: str, redis_url: str, runs_db: str
) -> None:
    config = make_config(
        stream_adapter(STREAM, batch_size=50),
        queues={STREAM: {**QUEUE, "handler": "tests.support.handlers:scripted_async"}},
        dramatiq_url=dramatiq_url(redis_url),
    )
    produce_payloads(
        redis_url,
        [{"n": 0, "fail_times": 2}, {"n": 1, "always_fail": True}, *({"n": i} for i in range(2, 12))],
    )
    running = start_all(procs, config)
    wait_for(lambda: statuses(db_url) == {"done": 11, "failed": 1}, timeout_s=90, what="11 done, 1 failed")
    stop_all(running)
    rows = {
        p["n"]: (status, attempts, error)
        for p, status, attempts, error in query(
            db_url, "SELECT payload, status, attempts, last_error FROM todos"
        )
    }
    assert rows[0][:2] == ("done", 3)
    assert rows[1] == ("failed", 3, "Planned: planned failure of run 3")
    assert all(rows[n][:2] == ("done", 1) for n in range(2, 12))
    (failed_id,) = query(db_url, "SELECT id FROM todos WHERE status = 'failed'")[0]
    assert trail(db_url, failed_id) == [
        (None, "pending"), ("pending", "dispatched"),
        ("dispatched", "running"), ("running", "dispatched"),
        ("dispatched", "running"), ("running", "dispatched"),
        ("dispatched", "running"), ("running", "failed"),
    ]  # fmt: skip
    assert scalar(db_url, "SELECT count(*) FROM handler_runs WHERE outcome = 'started'") == 3 + 3 + 10


def test_a_worker_killed_mid_handler_is_rescued_and_the_todo_done_once(
    procs: Processes, make_config: Callable[..., Path], db_url: str, redis_url: str, runs_db: str
) -> None:
    """kill -9 of the worker process running the handler: the todo stays
    running until its lease (time limit + margin) expires, then the rescuer
    dispatches it again and a new worker does it. One 'done', two runs."""
    config = make_config(
        stream_adapter(STREAM, batch_size=50),
        queues={STREAM: {**QUEUE, "time_limit_ms": 4000, "lease_margin_ms": 2000}},
        acker=FAST_RESCUE,
        dramatiq_url=dramatiq_url(redis_url),
    )
    produce_payloads(redis_url, [{"n": 0, "sleep_s": 30}])
    ingester, acker, worker = start_all(procs, config)
    wait_for(lambda: scalar(db_url, "SELECT count(*) FROM handler_runs") == 1, timeout_s=60, what="the run")
    # The next run must not sleep: changed before the kill, so whichever run
    # comes next (rescued, or redelivered) finishes.
    query(db_url, "UPDATE todos SET payload = '{\"n\": 0}'")
    (pid,) = query(db_url, "SELECT pid FROM handler_runs")[0]
    os.kill(pid, signal.SIGKILL)
    worker.wait(30)  # dramatiq's main process stops the others and ends when one of its workers dies
    second = procs.start("worker", config, name="worker-2")
    wait_for(lambda: statuses(db_url) == {"done": 1}, timeout_s=60, what="the todo rescued and done")
    stop_all([ingester, acker, second])
    assert scalar(db_url, "SELECT count(*) FROM handler_runs WHERE outcome = 'done'") == 1
    (todo_id,) = query(db_url, "SELECT id FROM todos")[0]
    steps = trail(db_url, todo_id)
    # The killed run's lease expired and the rescuer took it back (while no
    # worker ran, the dispatched todo may also have been dispatched again).
    assert_one_path(steps)
    runs = [i for i, step in enumerate(steps) if step == ("dispatched", "running")]
    assert len(runs) == 2
    assert steps[runs[0] + 1] == ("running", "dispatched")
    assert steps[-1] == ("running", "done")
    assert scalar(db_url, "SELECT count(*) FROM todo_events WHERE detail = 'rescued: its lease expired'") == 1
    assert scalar(db_url, "SELECT attempts FROM todos") == 2


def test_a_flushed_dramatiq_queue_is_dispatched_again(
    procs: Processes, make_config: Callable[..., Path], db_url: str, redis_url: str, runs_db: str
) -> None:
    """dramatiq's Redis loses its messages (restarted without persistence,
    flushed) while the todos are dispatched: the rescuer dispatches them again."""
    config = make_config(
        stream_adapter(STREAM, batch_size=50),
        queues={STREAM: QUEUE},
        acker=FAST_RESCUE,
        dramatiq_url=dramatiq_url(redis_url),
    )
    produce_payloads(redis_url, [{"n": i} for i in range(10)])
    ingester = procs.start("ingest", config, name="ingester-1")
    acker = procs.start("ack", config, name="acker-1")
    wait_for(lambda: statuses(db_url) == {"dispatched": 10}, timeout_s=60, what="10 todos dispatched")
    with redis.Redis.from_url(dramatiq_url(redis_url), socket_timeout=10) as r:
        assert r.dbsize() > 0
        r.flushdb()
    worker = procs.start("worker", config, name="worker-1")
    wait_for(lambda: statuses(db_url) == {"done": 10}, timeout_s=60, what="10 todos rescued and done")
    stop_all([ingester, acker, worker])
    assert scalar(db_url, "SELECT count(*) FROM handler_runs WHERE outcome = 'done'") == 10
    # Each was dispatched again at least once (again while no worker ran).
    rescued = "SELECT count(DISTINCT todo_id) FROM todo_events WHERE detail LIKE 'rescued: dispatched%%'"
    assert scalar(db_url, rescued) == 10


def test_a_message_for_a_done_todo_does_not_run_it_again(
    procs: Processes, make_config: Callable[..., Path], db_url: str, redis_url: str, runs_db: str
) -> None:
    config = make_config(
        stream_adapter(STREAM, batch_size=50), queues={STREAM: QUEUE}, dramatiq_url=dramatiq_url(redis_url)
    )
    produce_payloads(redis_url, [{"n": 1}])
    running = start_all(procs, config)
    wait_for(lambda: statuses(db_url) == {"done": 1}, timeout_s=60, what="the todo done")
    (todo_id,) = query(db_url, "SELECT id FROM todos")[0]
    enqueuer = Enqueuer(dramatiq_url(redis_url))
    try:
        enqueuer.enqueue([(QueueConfig(name=STREAM, handler=HANDLER), todo_id)] * 2)  # a redelivery, twice
    finally:
        enqueuer.close()
    worker = running[2]
    wait_for(
        lambda: len([e for e in worker.events("todo_skipped") if e.get("todo_id") == todo_id]) == 2,
        timeout_s=30,
        what="both redeliveries skipped",
    )
    stop_all(running)
    assert scalar(db_url, "SELECT count(*) FROM handler_runs") == 2  # started, done: once
    assert {e["status"] for e in worker.events("todo_skipped")} == {"done"}


def children_of(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.parametrize("handler", ["existing_sync_actor", "existing_async_actor"])
def test_an_existing_dramatiq_actor_is_a_handler(
    procs: Processes,
    make_config: Callable[..., Path],
    db_url: str,
    redis_url: str,
    runs_db: str,
    handler: str,
) -> None:
    """An app's own @dramatiq.actor, sync or async: its function does the todos."""
    queue = {**QUEUE, "handler": f"tests.support.handlers:{handler}"}
    config = make_config(
        stream_adapter(STREAM, batch_size=50), queues={STREAM: queue}, dramatiq_url=dramatiq_url(redis_url)
    )
    produce_payloads(redis_url, [{"n": 0, "fail_times": 1}, {"n": 1}, {"n": 2}])
    running = start_all(procs, config)
    wait_for(lambda: statuses(db_url) == {"done": 3}, timeout_s=60, what="3 todos done")
    stop_all(running)
    assert scalar(db_url, "SELECT count(*) FROM handler_runs WHERE outcome = 'done'") == 3
    assert scalar(db_url, "SELECT sum(attempts) FROM todos") == 4


def test_worker_processes_end_when_their_main_process_is_killed(
    procs: Processes, make_config: Callable[..., Path], db_url: str, redis_url: str, runs_db: str
) -> None:
    """SIGKILL of dramatiq's main process: its worker processes stop too
    (PR_SET_PDEATHSIG), rather than consume on their own, unsupervised."""
    config = make_config(
        stream_adapter(STREAM, batch_size=50), queues={STREAM: QUEUE}, dramatiq_url=dramatiq_url(redis_url)
    )
    worker = procs.start("worker", config, name="worker-1")
    # Two worker processes (the default), ready once they said so.
    wait_for(
        lambda: worker.raw_log().count("Worker process is ready for action") == 2,
        timeout_s=30,
        what="dramatiq's two worker processes ready",
    )
    workers = children_of(worker.pid)
    assert len(workers) == 2
    worker.kill()
    wait_for(lambda: not any(alive(p) for p in workers), timeout_s=30, what="the worker processes gone")


def test_an_adapter_queue_without_a_handler_is_said_at_start(
    procs: Processes, make_config: Callable[..., Path], db_url: str, redis_url: str
) -> None:
    """Its todos would wait as pending forever: `ack` says so when it starts."""
    queues = {"invoices": QUEUE}
    config = make_config(stream_adapter(STREAM), queues=queues, dramatiq_url=dramatiq_url(redis_url))
    acker = procs.start("ack", config, name="acker-1")
    (said,) = wait_for(lambda: acker.events("queue_not_served"), timeout_s=30, what="the warning")
    assert (said["adapter"], said["queue"], said["level"]) == (STREAM, STREAM, "warning")
    assert_clean_exit(acker, acker.terminate())
