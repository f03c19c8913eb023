"""What a handler raises is data (issue 33): real workers, handlers raising
errors built from their input every run (a NUL, an unpaired surrogate, a
megabyte of letters). Each such todo ends `failed` after exactly
`max_attempts` runs with its own error kept; every good todo beside them
runs once; no batch of the state writer fails for them."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from backhalf.lifecycle.worker import MAX_ERROR_CHARS
from ingest.embedded.processes import wait_for
from tests.support.config import stream_adapter
from tests.support.db import query, scalar
from tests.support.downstream import QUEUE, statuses, stop_all
from tests.support.processes import Processes

pytestmark = pytest.mark.system
STREAM = "orders"
GOOD = 12


def test_errors_built_from_input_fail_only_their_own_todo(
    procs: Processes, make_config: Callable[..., Path], db_url: str, redis_url: str, runs_db: str
) -> None:
    config = make_config(stream_adapter(STREAM, batch_size=50), queues={STREAM: QUEUE})
    payloads = [{"raise": kind} for kind in ("nul", "surrogate", "huge")] + [{"n": i} for i in range(GOOD)]
    with redis.Redis.from_url(redis_url, socket_timeout=10) as r:
        for payload in payloads:
            r.xadd(STREAM, {"body": json.dumps(payload)})
    running = [
        procs.start("ingest", config, name="ingester-1"),
        procs.start("ack", config, name="acker-1"),
        procs.start("worker", config, name="worker-1"),
    ]
    wait_for(
        lambda: statuses(db_url) == {"done": GOOD, "failed": 3}, timeout_s=120, what="every todo finished"
    )
    worker = running[2]
    stop_all(running)
    failed = dict(query(db_url, "SELECT payload->>'raise', last_error FROM todos WHERE status = 'failed'"))
    attempts = query(db_url, "SELECT DISTINCT attempts FROM todos WHERE status = 'failed'")
    assert attempts == [(QUEUE["max_attempts"],)]
    assert failed["nul"] == "Planned: bad byte \\x00 in the input"
    assert failed["surrogate"] == "Planned: bad input \\udcff here"
    assert failed["huge"].startswith("Planned: echoed input:")
    assert len(failed["huge"]) <= MAX_ERROR_CHARS
    # Every good todo ran once: no batch failed under it, no lease expired.
    runs = "SELECT todo_id, count(*) FROM handler_runs WHERE outcome = 'started' GROUP BY todo_id"
    ran = dict(query(db_url, runs))
    good = [i for (i,) in query(db_url, "SELECT id FROM todos WHERE status = 'done'")]
    assert {ran[i] for i in good} == {1}
    assert scalar(db_url, "SELECT count(*) FROM todo_events WHERE detail LIKE 'rescued%%'") == 0
    for event in ("todo_states_crashed", "todo_ends_retried", "todo_ends_not_written", "todo_state_refused"):
        assert worker.events(event) == [], event
