"""What the downstream tests (workers, chaos) share: the queue settings of
their todo queue, quick leases and rescues, and the todo state machine that
every ``todo_events`` trail must follow."""

from __future__ import annotations

from itertools import pairwise

from ingest.embedded.processes import SwitchboardProcess
from tests.support.db import query
from tests.support.processes import assert_clean_exit

HANDLER = "tests.support.handlers:scripted"
# Small limits so rescues happen within the test's bounded waits.
QUEUE = {"handler": HANDLER, "max_attempts": 3, "min_backoff_ms": 50, "max_backoff_ms": 200}
FAST_RESCUE = {"rescue_interval_ms": 200}
# A short lease (extended every second), so a killed worker's claims lapse
# within the tests' bounded waits.
SHORT_LEASE = {"lease_ms": 3000, "poll_interval_ms": 200}


def statuses(db_url: str) -> dict[str, int]:
    return dict(query(db_url, "SELECT status, count(*) FROM todos GROUP BY status"))


def trail(db_url: str, todo_id: int) -> list[tuple[str | None, str]]:
    return [
        (f, t)
        for f, t in query(
            db_url,
            "SELECT from_status, to_status FROM todo_events WHERE todo_id = %(id)s ORDER BY id",
            {"id": todo_id},
        )
    ]


# The todo state machine: every todo_events row is one of these steps.
ALLOWED = {
    (None, "pending"),
    ("pending", "running"), ("pending", "cancelled"),
    ("dispatched", "running"), ("dispatched", "cancelled"),  # rows an older version left dispatched
    ("running", "pending"),  # a retry after its backoff, a claim given back, or rescued
    ("running", "done"), ("running", "failed"), ("running", "cancelled"),
    ("failed", "pending"), ("cancelled", "pending"),
}  # fmt: skip


def assert_one_path(steps: list[tuple[str | None, str]]) -> None:
    """Allowed steps, each from where the one before it ended."""
    assert steps, "no todo_events at all"
    assert all(step in ALLOWED for step in steps), steps
    assert all(prev[1] == step[0] for prev, step in pairwise(steps)), steps


def stop_one(proc: SwitchboardProcess) -> None:
    code = proc.terminate()
    if proc.verb != "worker":  # dramatiq's own exit and log lines
        assert_clean_exit(proc, code)
    else:
        assert code == 0, proc.raw_log()[-3000:]


def stop_all(running: list[SwitchboardProcess]) -> None:
    for proc in running:
        stop_one(proc)
