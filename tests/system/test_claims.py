"""Claims on PostgreSQL (DESIGN.md section 7b), with real `switchboard
ingest`, `ack` (its rescuer) and `worker` processes, PostgreSQL and Redis:

- a worker process killed -9 while it holds claims, some running and some
  prefetched (claimed, waiting for a thread), under the default time limit
  (ten minutes): the claims lapse with their lease and the rescuer puts them
  back within one sweep; after a restart every todo is done exactly once;
- a worker stopped with SIGTERM while long handlers run and more todos are
  claimed: the running handlers finish, the claims it never started are
  given back (pending, attempt uncounted), nothing is left running, and the
  next worker does the rest without waiting for a lease;
- a running todo cancelled by an operator: it stays cancelled, the run's
  late end is discarded, and the worker reports the claim lost.

A worker process prefetches a queue's todos only while that queue's recent
runs are quick (worker_broker.PREFETCH_WAIT_S): each test that needs
prefetched claims first runs quick todos of ``orders`` (then deletes them
and their runs, the worker keeping its pace), then long todos that hold
every thread, then quick ones, which the process claims and cannot start.
The handler of ``orders`` (tests/support/handlers.py) records every run but
the warm-up's in ``handler_runs``.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from backhalf.lifecycle.todos import GIVEN_BACK, RESCUED_LEASE
from ingest.embedded.processes import SwitchboardProcess, wait_for
from tests.support.config import stream_adapter
from tests.support.db import query, scalar
from tests.support.downstream import FAST_RESCUE, QUEUE, SHORT_LEASE, assert_one_path, stop_all, trail
from tests.support.processes import Processes, switchboard

pytestmark = pytest.mark.system
STREAM = "orders"
WARMUP_N = 200  # quick todos first, so the worker prefetches the queue's next ones
THREADS = 4
LONG = THREADS  # long todos, one per thread
QUICK = 16  # quick todos behind them: some claimed and waiting, the others still pending


def make(make_config: Callable[..., Path], **kw: Any) -> Path:
    """The queue at the default time limit (ten minutes)."""
    return make_config(stream_adapter(STREAM, batch_size=100), queues={STREAM: QUEUE}, **kw)


def produce(redis_url: str, stream: str, payloads: list[dict[str, Any]]) -> None:
    """In one MULTI/EXEC: a blocked XREADGROUP is served once the whole
    transaction ran, so the ingester stores them in one batch, and one claim
    sees them all."""
    with redis.Redis.from_url(redis_url, socket_timeout=10) as r:
        pipe = r.pipeline(transaction=True)
        for p in payloads:
            pipe.xadd(stream, {"body": json.dumps(p)})
        pipe.execute()


def statuses_of(db_url: str, queue: str) -> dict[str, int]:
    return dict(
        query(db_url, "SELECT status, count(*) FROM todos WHERE queue = %(q)s GROUP BY 1", {"q": queue})
    )


def ids_of(db_url: str, where: str) -> set[int]:
    return {int(i) for (i,) in query(db_url, f"SELECT id FROM todos WHERE queue = 'orders' AND {where}")}


def claims_held(db_url: str) -> tuple[set[int], set[int]]:
    """The ``orders`` todos claimed now: those whose run (this attempt's)
    started its handler, and those waiting for a thread."""
    rows = query(
        db_url,
        "SELECT t.id, EXISTS (SELECT 1 FROM handler_runs r WHERE r.todo_id = t.id AND r.attempt = t.attempts)"
        " FROM todos t WHERE t.queue = %(q)s AND t.status = 'running'",
        {"q": STREAM},
    )
    return {int(i) for i, ran in rows if ran}, {int(i) for i, ran in rows if not ran}


def start_warm(
    procs: Processes, config: Path, db_url: str, redis_url: str
) -> tuple[SwitchboardProcess, SwitchboardProcess, SwitchboardProcess]:
    """The ingester, the acker and one worker process of THREADS threads
    whose recent runs were quick (WARMUP_N no-op todos done)."""
    ingester = procs.start("ingest", config, name="ingester-1")
    acker = procs.start("ack", config, name="acker-1")
    worker = procs.start(
        "worker", config, name="worker-1", args=["--processes", "1", "--threads", str(THREADS)]
    )
    produce(redis_url, STREAM, [{"w": i} for i in range(WARMUP_N)])
    wait_for(
        lambda: statuses_of(db_url, STREAM) == {"done": WARMUP_N}, timeout_s=90, what="the warm-up todos done"
    )
    # Gone from the record; the worker keeps the pace they gave it.
    query(db_url, "DELETE FROM handler_runs")
    query(db_url, "DELETE FROM todo_events WHERE todo_id IN (SELECT id FROM todos WHERE payload ? 'w')")
    query(
        db_url, "UPDATE inbox SET todo_id = NULL WHERE todo_id IN (SELECT id FROM todos WHERE payload ? 'w')"
    )
    query(
        db_url, "UPDATE events SET todo_id = NULL WHERE todo_id IN (SELECT id FROM todos WHERE payload ? 'w')"
    )
    query(db_url, "DELETE FROM todos WHERE payload ? 'w'")
    return ingester, acker, worker


def hold_every_thread_and_prefetch(db_url: str, redis_url: str, sleep_s: float) -> tuple[set[int], set[int]]:
    """LONG todos that sleep ``sleep_s`` (one per thread), then QUICK ones:
    once the long ones run, the process claims quick ones it cannot start.
    The state is stable (no thread frees up, no claim is due): returned as
    (running, waiting)."""
    produce(redis_url, STREAM, [{"n": i, "sleep_s": sleep_s} for i in range(LONG)])
    wait_for(lambda: len(claims_held(db_url)[0]) == LONG, timeout_s=60, what="every thread on a long todo")
    # Produced after: the store orders a batch's todos by key, not by entry.
    produce(redis_url, STREAM, [{"n": i} for i in range(LONG, LONG + QUICK)])

    def held() -> tuple[set[int], set[int]] | None:
        running, waiting = claims_held(db_url)
        return (running, waiting) if waiting else None

    found: tuple[set[int], set[int]] = wait_for(held, timeout_s=60, what="claims waiting for a thread")
    assert found[0] == ids_of(db_url, "payload ? 'sleep_s'")
    return found


def test_a_worker_killed_with_claims_running_and_prefetched_loses_them_to_the_rescuer(
    procs: Processes, make_config: Callable[..., Path], db_url: str, redis_url: str, runs_db: str
) -> None:
    """kill -9 of the worker process while it runs LONG todos (under the
    default ten-minute time limit) and holds prefetched ones it has not
    started: every claim it held lapses with its 3 s lease and is rescued
    (running -> pending, within the 30 s wait, far below the time limit),
    whether its handler had started or not; nothing else is touched. After
    a restart every todo is done exactly once."""
    config = make(make_config, acker=FAST_RESCUE, worker=SHORT_LEASE)
    ingester, acker, worker = start_warm(procs, config, db_url, redis_url)
    running, waiting = hold_every_thread_and_prefetch(db_url, redis_url, sleep_s=60)
    held = running | waiting
    # The runs cut off must not sleep again: changed before the kill.
    query(db_url, "UPDATE todos SET payload = payload - 'sleep_s' WHERE queue = 'orders'")
    (pid,) = {int(p) for (p,) in query(db_url, "SELECT DISTINCT pid FROM handler_runs")}
    os.kill(pid, signal.SIGKILL)
    worker.wait(30)  # dramatiq's main process stops when one of its worker processes dies

    wait_for(lambda: not ids_of(db_url, "status = 'running'"), timeout_s=30, what="every claim rescued")
    rescued = {
        int(t)
        for (t,) in query(
            db_url, "SELECT todo_id FROM todo_events WHERE detail = %(d)s", {"d": RESCUED_LEASE}
        )
    }
    assert rescued == held
    # Nothing of theirs ended before the kill: every todo is pending now.
    assert ids_of(db_url, "status = 'pending'") == ids_of(db_url, "true")

    second = procs.start("worker", config, name="worker-2")
    wait_for(
        lambda: statuses_of(db_url, STREAM) == {"done": LONG + QUICK}, timeout_s=60, what="every todo done"
    )
    stop_all([ingester, acker, second])
    done = dict(
        query(db_url, "SELECT todo_id, count(*) FROM handler_runs WHERE outcome = 'done' GROUP BY todo_id")
    )
    assert done == dict.fromkeys(ids_of(db_url, "true"), 1)  # each todo done exactly once
    runs = dict(
        query(db_url, "SELECT todo_id, count(*) FROM handler_runs WHERE outcome = 'started' GROUP BY todo_id")
    )
    assert {t: runs[t] for t in running} == dict.fromkeys(running, 2)  # cut off, then run again
    assert {t: runs[t] for t in waiting} == dict.fromkeys(waiting, 1)  # never started before the kill
    attempts = dict(query(db_url, "SELECT id, attempts FROM todos WHERE queue = 'orders'"))
    # A lapsed claim counted its attempt, started or not; the others, one.
    assert attempts == {t: 2 if t in held else 1 for t in attempts}
    for todo_id in attempts:
        steps = trail(db_url, todo_id)
        assert_one_path(steps)
        if todo_id in held:
            assert steps == [(None, "pending"), ("pending", "running"), ("running", "pending"),
                             ("pending", "running"), ("running", "done")]  # fmt: skip
    assert scalar(db_url, "SELECT count(*) FROM todo_events WHERE detail LIKE 'given back%%'") == 0


def test_sigterm_finishes_the_running_handlers_and_gives_back_the_claims_it_never_started(
    procs: Processes, make_config: Callable[..., Path], db_url: str, redis_url: str, runs_db: str
) -> None:
    """SIGTERM while LONG handlers run and prefetched claims wait: the
    handlers finish (their todos done by this worker), the waiting claims
    go back to pending with their attempt uncounted ('given back unrun'),
    nothing is left running once the worker exits, and no claim is left to
    lapse: the default 30 s lease, and no rescue. The next worker does the
    rest."""
    config = make(make_config)  # the default lease (30 s) and rescue interval
    ingester, acker, worker = start_warm(procs, config, db_url, redis_url)
    running, waiting = hold_every_thread_and_prefetch(db_url, redis_url, sleep_s=8)
    code = worker.terminate()
    assert code == 0, worker.raw_log()[-3000:]

    assert ids_of(db_url, "status = 'running'") == set()
    assert ids_of(db_url, "status = 'done'") == running  # the handlers in flight finished
    (pid,) = {int(p) for (p,) in query(db_url, "SELECT DISTINCT pid FROM handler_runs")}
    assert {int(t) for (t,) in query(db_url, "SELECT todo_id FROM handler_runs WHERE outcome = 'done'"
                                             " AND pid = %(p)s", {"p": pid})} == running  # fmt: skip
    given_back = {
        int(t)
        for (t,) in query(db_url, "SELECT todo_id FROM todo_events WHERE detail = %(d)s", {"d": GIVEN_BACK})
    }
    assert given_back == waiting
    # Pending again, due now, no attempt counted, never run.
    assert ids_of(db_url, "status = 'pending' AND attempts = 0 AND run_after <= now()") == ids_of(
        db_url, "status = 'pending'"
    )
    assert ids_of(db_url, "status = 'pending'") == ids_of(db_url, "true") - running
    assert (
        scalar(db_url, "SELECT count(*) FROM handler_runs WHERE todo_id = ANY(%(t)s)", {"t": list(waiting)})
        == 0
    )

    second = procs.start("worker", config, name="worker-2")
    wait_for(
        lambda: statuses_of(db_url, STREAM) == {"done": LONG + QUICK}, timeout_s=60, what="the rest done"
    )
    stop_all([ingester, acker, second])
    assert scalar(db_url, "SELECT count(*) FROM todo_events WHERE detail LIKE 'rescued%%'") == 0
    assert query(db_url, "SELECT DISTINCT attempts FROM todos WHERE queue = 'orders'") == [(1,)]
    done = dict(
        query(db_url, "SELECT todo_id, count(*) FROM handler_runs WHERE outcome = 'done' GROUP BY todo_id")
    )
    assert done == dict.fromkeys(ids_of(db_url, "true"), 1)
    for todo_id in ids_of(db_url, "true"):
        steps = trail(db_url, todo_id)
        assert_one_path(steps)
        if todo_id in waiting:
            assert steps == [(None, "pending"), ("pending", "running"), ("running", "pending"),
                             ("pending", "running"), ("running", "done")]  # fmt: skip


def test_a_running_todo_cancelled_stays_cancelled_and_its_claim_is_reported_lost(
    procs: Processes, make_config: Callable[..., Path], db_url: str, redis_url: str, runs_db: str
) -> None:
    """`switchboard todos cancel` of a todo whose handler runs: the todo is
    cancelled at once; the worker's next lease extension finds the claim
    lost and says so; the handler runs to its end, which is discarded (the
    todo stays cancelled, not run again, not rescued); the thread goes on
    to the next todo."""
    config = make(make_config, acker=FAST_RESCUE, worker=SHORT_LEASE)  # leases extended every second
    running = [
        procs.start("ingest", config, name="ingester-1"),
        procs.start("ack", config, name="acker-1"),
        procs.start("worker", config, name="worker-1", args=["--processes", "1", "--threads", "1"]),
    ]
    worker = running[2]
    produce(redis_url, STREAM, [{"n": 0, "sleep_s": 10}])
    wait_for(lambda: scalar(db_url, "SELECT count(*) FROM handler_runs") == 1, timeout_s=60, what="the run")
    (todo_id,) = ids_of(db_url, "true")
    cancelled = switchboard("--config", str(config), "todos", "cancel", str(todo_id))
    assert cancelled.returncode == 0, cancelled.stdout + cancelled.stderr
    assert cancelled.stdout.startswith(f"todo {todo_id}: cancelled (was running")
    assert scalar(db_url, "SELECT status FROM todos") == "cancelled"

    def said(event: str) -> list[dict[str, Any]]:
        return [e for e in worker.events(event) if e.get("todo_id") == todo_id]

    (lost,) = wait_for(lambda: said("todo_claim_lost"), timeout_s=30, what="the claim reported lost")
    assert (lost["queue"], lost["level"]) == (STREAM, "warning")
    assert scalar(db_url, "SELECT count(*) FROM handler_runs WHERE outcome = 'done'") == 0  # reported mid-run
    (discarded,) = wait_for(
        lambda: said("todo_result_discarded"), timeout_s=30, what="the late end discarded"
    )
    assert discarded["level"] == "warning"
    assert scalar(db_url, "SELECT count(*) FROM handler_runs WHERE outcome = 'done'") == 1
    # The one thread is free again: the next todo runs.
    produce(redis_url, STREAM, [{"n": 1}])
    wait_for(
        lambda: statuses_of(db_url, STREAM) == {"cancelled": 1, "done": 1}, timeout_s=60, what="the next"
    )
    stop_all(running)
    assert query(
        db_url, "SELECT status, attempts, lease_until FROM todos WHERE id = %(t)s", {"t": todo_id}
    ) == [("cancelled", 1, None)]
    assert trail(db_url, todo_id) == [(None, "pending"), ("pending", "running"), ("running", "cancelled")]
    runs = "SELECT count(*) FROM handler_runs WHERE todo_id = %(t)s AND outcome = 'started'"
    assert scalar(db_url, runs, {"t": todo_id}) == 1
    assert scalar(db_url, "SELECT count(*) FROM todo_events WHERE detail LIKE 'rescued%%'") == 0
