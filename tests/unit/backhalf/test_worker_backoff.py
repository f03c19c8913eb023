"""A failed attempt's wait before the next (backhalf.lifecycle.worker.backoff_ms): the
todo's own retry, pending again with ``run_after`` this far ahead, computed
as dramatiq's Retries middleware did: ``min_backoff_ms`` doubled per
attempt, jittered up to twice that, capped at ``max_backoff_ms`` (where
the jitter keeps it in the cap's upper half)."""

from __future__ import annotations

import pytest

from backhalf.lifecycle.queues import QueueConfig
from backhalf.lifecycle.worker import backoff_ms

QUEUE = QueueConfig(name="q", handler="m:f", min_backoff_ms=1_000, max_backoff_ms=60_000)


@pytest.mark.parametrize(
    ("attempt", "low", "high"),
    [
        (1, 1_000, 2_000),
        (2, 2_000, 4_000),
        (3, 4_000, 8_000),
        (6, 30_000, 60_000),  # 32 s doubled by the jitter passes the cap: its upper half
        (40, 30_000, 60_000),  # never past the cap, however many attempts
    ],
)
def test_the_wait_doubles_per_attempt_within_its_jitter_and_the_cap(
    attempt: int, low: int, high: int
) -> None:
    waits = {backoff_ms(QUEUE, attempt) for _ in range(200)}
    assert low <= min(waits)
    assert max(waits) <= high
    assert len(waits) > 1, "jittered: retries of todos that failed together spread out"


def test_a_queue_whose_backoffs_are_equal_waits_that_long_or_half_of_it() -> None:
    fixed = QueueConfig(name="q", handler="m:f", min_backoff_ms=5_000, max_backoff_ms=5_000)
    assert all(2_500 <= backoff_ms(fixed, a) <= 5_000 for a in (1, 2, 10) for _ in range(50))
