"""Process lifecycle in one place: signals become a stop request, waits are
bounded, backoff is exponential with jitter and a cap, exit codes are named."""

from __future__ import annotations

import asyncio
import os
import random
import signal
from collections.abc import Iterator
from contextlib import contextmanager

import structlog

from ingest import entry

log = structlog.get_logger(__name__)

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_CONFIG = 2
EXIT_FORCED = 130  # a second signal: the operator insisted

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@contextmanager
def stop_on_signals(stop: asyncio.Event) -> Iterator[None]:
    """First SIGTERM/SIGINT sets ``stop``; a second one exits at once.
    Handlers are removed on exit, so nothing outlives the run."""
    loop = asyncio.get_running_loop()

    def on_signal(signum: int) -> None:
        if stop.is_set():
            log.warning("forced_exit", signal=signal.Signals(signum).name)
            os._exit(EXIT_FORCED)
        log.info("stop_requested", signal=signal.Signals(signum).name)
        stop.set()

    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, on_signal, sig)
    if entry.stop_requested_early():  # signalled while still importing
        log.info("stop_requested", signal="before start-up finished")
        stop.set()
    try:
        yield
    finally:
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)


async def wait_stop(stop: asyncio.Event, timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` for ``stop``; True if it was requested."""
    try:
        async with asyncio.timeout(timeout_s):
            await stop.wait()
    except TimeoutError:
        return False
    return True


async def wait_either(first: asyncio.Event, second: asyncio.Event, timeout_s: float) -> None:
    """Return when either event is set or ``timeout_s`` passes."""
    waiters = [asyncio.create_task(first.wait()), asyncio.create_task(second.wait())]
    try:
        await asyncio.wait(waiters, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)


async def cancel_and_wait(task: asyncio.Task[object], timeout_s: float) -> bool:
    """Cancel ``task`` and wait for it to end, at most ``timeout_s``.

    Cancels again while it runs: redis-py (8.1) can swallow a cancellation
    that lands while a command is being set up, and the task then goes on to
    its next await, a blocking read of up to ``block_ms``. Return whether the
    task ended in time."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not task.done():
        task.cancel()
        remaining = deadline - asyncio.get_running_loop().time()
        if remaining <= 0:
            return False
        await asyncio.wait({task}, timeout=min(0.1, remaining))
    return True


class Backoff:
    """Exponential backoff with full jitter, capped; reset after a success."""

    def __init__(self, initial_ms: int, max_ms: int, rng: random.Random | None = None) -> None:
        self._initial_s = initial_ms / 1000
        self._max_s = max_ms / 1000
        self._attempt = 0
        self._rng = rng or random.Random()  # noqa: S311 - jitter, not security

    @property
    def attempt(self) -> int:
        return self._attempt

    def next_delay_s(self) -> float:
        ceiling = min(self._max_s, self._initial_s * (2**self._attempt))
        self._attempt += 1
        # Half fixed, half random: never a tight loop, never in lock-step.
        return float(ceiling / 2 + self._rng.uniform(0, ceiling / 2))

    def reset(self) -> None:
        self._attempt = 0


def leftover_tasks() -> list[str]:
    """Names of tasks still alive besides the caller: a run must leave none."""
    current = asyncio.current_task()
    return sorted(t.get_name() for t in asyncio.all_tasks() if t is not current and not t.done())
