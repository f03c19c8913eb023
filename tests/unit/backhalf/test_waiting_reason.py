"""Why a pending todo waits (issue 44): `trace` and `todos show` say it,
read from the todo's run_after and the workers' heartbeats."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

from backhalf.housekeeping.heartbeats import ProcessRow
from backhalf.reads.todo_views import TodoDetail, waiting_reason

NOW = datetime(2026, 12, 6, 12, 0, tzinfo=UTC)


def todo(status: str = "pending", run_after: datetime = NOW, queue: str = "orders") -> TodoDetail:
    return TodoDetail(1, queue, status, 1, "k", NOW, NOW, run_after, None, None, {})


def worker(queues: list[str], state: str = "alive", **detail: Any) -> ProcessRow:
    detail = {"queues": queues, **detail}
    return ProcessRow(uuid.uuid4(), "worker", "h", 1, detail, NOW, NOW, None, state, 1.0)


def test_a_retry_waiting_for_its_backoff_says_when() -> None:
    reason = waiting_reason(todo(run_after=NOW + timedelta(seconds=42)), [worker(["orders"])], NOW)
    assert reason == "waits for its retry's backoff: claimable in 42 s"


def test_no_live_worker_for_the_queue_is_named() -> None:
    procs = [
        worker(["billing"]),
        worker(["orders"], state="dead"),
        worker(["orders"], state="stopped"),
        worker(["orders"], state="stuck"),  # does not claim: as the console judges it
    ]
    reason = waiting_reason(todo(), procs, NOW)
    assert reason is not None
    assert reason.startswith("no live worker serves queue orders")


def test_a_served_queue_is_claimable() -> None:
    reason = waiting_reason(todo(status="dispatched"), [worker(["orders", "billing"])], NOW)
    assert reason is not None
    assert reason.startswith("claimable now: 1 live worker process(es) serve queue orders")


def test_a_todo_not_pending_does_not_wait() -> None:
    for status in ("running", "done", "failed", "cancelled"):
        assert waiting_reason(todo(status=status), [], NOW) is None
