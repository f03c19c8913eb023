"""The acker's rescue loop (ingest.processes.ack.acker.rescue_loop): a full batch
goes on at once, a short one waits ``rescue_interval_ms``, a failure is
backed off (not the interval) and logged as ``rescue_failed``; the loop
ends on stop."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import structlog

from backhalf.errors import StoreError
from ingest.config import AckerSettings
from ingest.processes.ack.acker import rescue_loop

SETTINGS = AckerSettings(batch_size=10, rescue_interval_ms=1000, backoff_initial_ms=1, backoff_max_ms=2)


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


async def test_a_full_batch_goes_on_at_once_and_a_short_one_waits_its_interval() -> None:
    stop = asyncio.Event()
    step, calls = _steps([10, 3, 0], stop)
    ticks: list[None] = []
    await asyncio.wait_for(rescue_loop(step, SETTINGS, stop, tick=lambda: ticks.append(None)), timeout=10)
    assert len(calls) == len(ticks) == 3
    assert calls[1] - calls[0] < 0.5, "a full batch: the next at once"
    assert calls[2] - calls[1] >= 0.99, "a short batch: rescue_interval_ms later"


async def test_a_failure_is_backed_off_and_logged_and_the_loop_goes_on() -> None:
    stop = asyncio.Event()
    step, calls = _steps([StoreError("database away"), 0, 0], stop)
    with structlog.testing.capture_logs() as logged:
        await asyncio.wait_for(rescue_loop(step, SETTINGS, stop), timeout=10)
    assert len(calls) == 3
    assert calls[1] - calls[0] < 0.5, "backed off by backoff_initial_ms, not the interval"
    assert calls[2] - calls[1] >= 0.99
    [failed] = [e for e in logged if e["event"] == "rescue_failed"]
    assert (failed["attempt"], failed["error_type"]) == (1, "StoreError")


async def test_a_stop_during_the_interval_ends_the_loop_at_once() -> None:
    stop = asyncio.Event()
    calls: list[float] = []

    async def step() -> int:
        calls.append(asyncio.get_running_loop().time())
        return 0

    loop = asyncio.get_running_loop()
    long_interval = AckerSettings(batch_size=10, rescue_interval_ms=60_000)
    loop.call_later(0.2, stop.set)
    began = loop.time()
    await asyncio.wait_for(rescue_loop(step, long_interval, stop), timeout=10)
    assert len(calls) == 1
    assert loop.time() - began < 5, "stopped within its 60 s wait"
