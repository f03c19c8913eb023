"""The acker's one loop for the relay and the rescue: a full batch goes on at
once, a short one waits (for the wake, if it has one), a failure is backed
off and logged under the loop's own event."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import structlog

from backhalf.errors import StoreError
from ingest.config import AckerSettings
from ingest.processes.acker import dispatch_loop

SETTINGS = AckerSettings(dispatch_batch_size=10, backoff_initial_ms=1, backoff_max_ms=2)


def _steps(
    results: list[int | Exception], stop: asyncio.Event
) -> tuple[Callable[[], Awaitable[int]], list[float]]:
    """A step that answers ``results`` in turn, noting when each call came, and sets stop after the last."""
    calls: list[float] = []

    async def step() -> int:
        calls.append(asyncio.get_running_loop().time())
        answer = results[len(calls) - 1]
        if len(calls) == len(results):
            stop.set()
        if isinstance(answer, Exception):
            raise answer
        return answer

    return step, calls


async def test_a_full_batch_goes_on_at_once_and_a_short_one_waits_for_the_wake() -> None:
    stop, wake = asyncio.Event(), asyncio.Event()
    step, calls = _steps([10, 3, 0], stop)
    loop = asyncio.get_running_loop()
    loop.call_later(1.0, wake.set)
    ticks: list[None] = []
    await asyncio.wait_for(
        dispatch_loop(
            step,
            SETTINGS,
            stop,
            failed_event="dispatch_failed",
            interval_s=60,
            wake=wake,
            tick=lambda: ticks.append(None),
        ),
        timeout=10,
    )
    assert len(calls) == len(ticks) == 3
    assert calls[1] - calls[0] < 0.5, "a full batch: the next at once"
    assert calls[2] - calls[1] >= 0.5, "a short batch: until the wake, not the 60 s interval"


async def test_without_a_wake_a_short_batch_waits_its_interval_and_a_failure_is_backed_off() -> None:
    stop = asyncio.Event()
    step, calls = _steps([StoreError("database away"), 0, 0], stop)
    with structlog.testing.capture_logs() as logged:
        await asyncio.wait_for(
            dispatch_loop(step, SETTINGS, stop, failed_event="rescue_failed", interval_s=1.0), timeout=10
        )
    assert len(calls) == 3
    assert calls[1] - calls[0] < 0.5, "backed off by backoff_initial_ms, not the interval"
    assert calls[2] - calls[1] >= 0.99
    [failed] = [e for e in logged if e["event"] == "rescue_failed"]
    assert (failed["attempt"], failed["error_type"]) == (1, "StoreError")
