"""Downstream: real `switchboard ingest`, `ack` (its rescuer) and `worker`
(dramatiq worker processes whose broker is PostgreSQL itself, DESIGN.md
section 7b) against real PostgreSQL and Redis. The handlers
(tests/support/handlers.py) record every run in ``handler_runs``, so each
test asserts on what ran, not on logs."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from ingest.embedded.processes import SwitchboardProcess, wait_for
from tests.support.config import stream_adapter
from tests.support.db import acked, query, scalar
from tests.support.downstream import (
    FAST_RESCUE,
    QUEUE,
    SHORT_LEASE,
    assert_one_path,
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
    config = make_config(stream_adapter(STREAM, batch_size=50), queues={STREAM: QUEUE})
    ids = produce_payloads(redis_url, [{"n": i} for i in range(30)])
    running = start_all(procs, config)
    wait_for(
        lambda: statuses(db_url) == {"done": 30} and acked(db_url) == len(ids),
        timeout_s=90,
        what="30 todos done and their entries acked",
    )
    stop_all(running)
    assert scalar(db_url, "SELECT count(*) FROM handler_runs WHERE outcome = 'done'") == 30
    assert scalar(db_url, "SELECT count(DISTINCT todo_id) FROM handler_runs") == 30
    for (todo_id,) in query(db_url, "SELECT id FROM todos"):
        assert_one_path(trail(db_url, todo_id))
        assert trail(db_url, todo_id) == [(None, "pending"), ("pending", "running"), ("running", "done")]
    assert scalar(db_url, "SELECT count(*) FROM todos WHERE attempts <> 1") == 0
    assert scalar(db_url, "SELECT count(*) FROM inbox WHERE ack_state = 'acked'") == len(ids)


def test_failures_are_retried_then_failed_without_blocking_the_others(
    procs: Processes, make_config: Callable[..., Path], db_url: str, redis_url: str, runs_db: str
) -> None:
    config = make_config(
        stream_adapter(STREAM, batch_size=50),
        queues={STREAM: {**QUEUE, "handler": "tests.support.handlers:scripted_async"}},
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
        (None, "pending"),
        ("pending", "running"), ("running", "pending"),
        ("pending", "running"), ("running", "pending"),
        ("pending", "running"), ("running", "failed"),
    ]  # fmt: skip
    # Each retry waited out its backoff (min 50 ms) before its next claim.
    waits = query(
        db_url,
        "SELECT extract(epoch FROM c.created_at - r.created_at) FROM todo_events r"
        " JOIN LATERAL (SELECT created_at FROM todo_events c WHERE c.todo_id = r.todo_id AND c.id > r.id"
        "               ORDER BY c.id LIMIT 1) c ON true"
        " WHERE r.todo_id = %(id)s AND r.from_status = 'running' AND r.to_status = 'pending'",
        {"id": failed_id},
    )
    assert len(waits) == 2, waits
    assert all(float(w) >= 0.05 for (w,) in waits), waits
    assert scalar(db_url, "SELECT count(*) FROM handler_runs WHERE outcome = 'started'") == 3 + 3 + 10


def test_a_worker_killed_mid_handler_is_rescued_and_the_todo_done_once(
    procs: Processes, make_config: Callable[..., Path], db_url: str, redis_url: str, runs_db: str
) -> None:
    """kill -9 of the worker process running the handler: the todo stays
    running until its lease (extended by the worker while it lived) lapses,
    whatever the time limit, then the rescuer puts it back and a new worker
    does it. One 'done', two runs."""
    config = make_config(
        stream_adapter(STREAM, batch_size=50),
        queues={STREAM: QUEUE},  # the default time limit: ten minutes
        acker=FAST_RESCUE,
        worker=SHORT_LEASE,
    )
    produce_payloads(redis_url, [{"n": 0, "sleep_s": 30}])
    ingester, acker, worker = start_all(procs, config)
    wait_for(lambda: scalar(db_url, "SELECT count(*) FROM handler_runs") == 1, timeout_s=60, what="the run")
    # The next run must not sleep: changed before the kill, so the rescued
    # run finishes.
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
    assert_one_path(steps)
    assert steps == [(None, "pending"), ("pending", "running"), ("running", "pending"),
                     ("pending", "running"), ("running", "done")]  # fmt: skip
    assert scalar(db_url, "SELECT count(*) FROM todo_events WHERE detail = 'rescued: its lease expired'") == 1
    assert scalar(db_url, "SELECT attempts FROM todos") == 2


def test_a_long_run_keeps_its_claim_past_many_leases(
    procs: Processes, make_config: Callable[..., Path], db_url: str, redis_url: str, runs_db: str
) -> None:
    """A run longer than several leases is not rescued: its worker extends
    the lease for as long as the run goes on. One run, one attempt."""
    config = make_config(
        stream_adapter(STREAM, batch_size=50), queues={STREAM: QUEUE}, acker=FAST_RESCUE, worker=SHORT_LEASE
    )
    produce_payloads(redis_url, [{"n": 0, "sleep_s": 8}])  # past two leases of 3 s
    running = start_all(procs, config)
    wait_for(lambda: statuses(db_url) == {"done": 1}, timeout_s=60, what="the long todo done")
    stop_all(running)
    assert scalar(db_url, "SELECT count(*) FROM handler_runs WHERE outcome = 'started'") == 1
    assert scalar(db_url, "SELECT count(*) FROM todo_events WHERE detail LIKE 'rescued%%'") == 0
    assert scalar(db_url, "SELECT attempts FROM todos") == 1


def test_a_burst_of_long_todos_keeps_every_thread_of_every_process_busy(
    procs: Processes, make_config: Callable[..., Path], db_url: str, redis_url: str, runs_db: str
) -> None:
    """8 two-second todos on 2 processes x 4 threads: a process claims only
    what its free threads can start (no prefetch for slow runs), so each
    process runs 4 at once and none waits behind another's claims."""
    config = make_config(stream_adapter(STREAM, batch_size=50), queues={STREAM: QUEUE}, worker=SHORT_LEASE)
    worker = procs.start("worker", config, name="worker-1", args=["--processes", "2", "--threads", "4"])
    wait_for(
        lambda: worker.raw_log().count("Worker process is ready for action") == 2,
        timeout_s=30,
        what="dramatiq's two worker processes ready",
    )
    ingester = procs.start("ingest", config, name="ingester-1")
    produce_payloads(redis_url, [{"n": i, "sleep_s": 2} for i in range(8)])
    wait_for(lambda: statuses(db_url) == {"done": 8}, timeout_s=60, what="8 todos done")
    stop_all([ingester, worker])
    per_process = dict(
        query(db_url, "SELECT pid, count(*) FROM handler_runs WHERE outcome = 'started' GROUP BY pid")
    )
    assert sorted(per_process.values()) == [4, 4], per_process
    # Each process ran its four at once: every start before any end.
    for pid in per_process:
        (overlap,) = query(
            db_url,
            "SELECT max(s.at) < min(d.at) FROM handler_runs s, handler_runs d"
            " WHERE s.pid = %(pid)s AND d.pid = %(pid)s AND s.outcome = 'started' AND d.outcome = 'done'",
            {"pid": pid},
        )[0]
        assert overlap, pid


def test_a_todo_left_dispatched_by_an_older_version_is_claimed(
    procs: Processes, make_config: Callable[..., Path], db_url: str, redis_url: str, runs_db: str
) -> None:
    """Rows the dramatiq relay left `dispatched` (an upgrade with a backlog)
    are claimed like pending ones: no relay, no message needed."""
    config = make_config(stream_adapter(STREAM, batch_size=50), queues={STREAM: QUEUE})
    produce_payloads(redis_url, [{"n": i} for i in range(5)])
    ingester = procs.start("ingest", config, name="ingester-1")
    wait_for(lambda: statuses(db_url) == {"pending": 5}, timeout_s=60, what="5 todos stored")
    query(db_url, "UPDATE todos SET status = 'dispatched'")  # as the relay left them
    worker = procs.start("worker", config, name="worker-1")
    wait_for(lambda: statuses(db_url) == {"done": 5}, timeout_s=60, what="5 todos done")
    stop_all([ingester, worker])
    assert scalar(db_url, "SELECT count(*) FROM todo_events WHERE from_status = 'dispatched'") == 5


def test_a_message_sent_to_a_switchboard_actor_is_refused(tmp_path: Path) -> None:
    """The broker carries todos only: nothing can be enqueued through dramatiq
    (no second copy of a todo, no forged message to guard against)."""
    import dramatiq

    from ingest.config import from_mapping
    from ingest.processes.workers.worker import switchboard_broker
    from ingest.processes.workers.worker_broker import NotAQueue

    settings = from_mapping(
        {"database": {"url": "postgresql+psycopg://nobody@localhost/none"},
         "queues": {STREAM: QUEUE}}, {}
    )  # fmt: skip
    broker = switchboard_broker(settings, threads=1)
    broker.emit_after("process_boot")
    message: dramatiq.Message[None] = dramatiq.Message(
        queue_name="switchboard", actor_name=f"switchboard:{STREAM}", args=(1,), kwargs={}, options={}
    )
    with pytest.raises(NotAQueue, match="take their todos from PostgreSQL"):
        broker.enqueue(message)


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
    config = make_config(stream_adapter(STREAM, batch_size=50), queues={STREAM: queue})
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
    config = make_config(stream_adapter(STREAM, batch_size=50), queues={STREAM: QUEUE})
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
    config = make_config(stream_adapter(STREAM), queues=queues)
    acker = procs.start("ack", config, name="acker-1")
    (said,) = wait_for(lambda: acker.events("queue_not_served"), timeout_s=30, what="the warning")
    assert (said["adapter"], said["queue"], said["level"]) == (STREAM, STREAM, "warning")
    assert_clean_exit(acker, acker.terminate())
