"""Bounded waits, backoff and retry for the long-running loops: every wait
has a timeout, backoff is exponential with jitter and a cap, and every retried
failure is logged the same way (:class:`Retry`). (Stop signals are turned into
a stop request in ``ingest.signals``; exit codes are named in
``ingest.exit_codes``.)"""

from __future__ import annotations

import asyncio
import random
from typing import TYPE_CHECKING, Any, Protocol

from ingest.errors import EXPECTED_FAILURES, log_failure

if TYPE_CHECKING:
    from structlog.typing import FilteringBoundLogger


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

    Cancels again while it runs: a client library can swallow a cancellation
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


# A notification (LISTEN/NOTIFY) is a hint that any login connected to the
# database can send, as often as it likes (issue 43): what it may cost.
NOTIFIED_GAP_MIN_S = 0.005
NOTIFIED_GAP_MAX_S = 0.1


class NotifiedLooks:
    """How soon a notification may make a loop look again (the acker's
    drain, a worker's claim): never sooner than ``gap_s`` after the loop's
    last look ended, whatever caused that one, so a burst of notifications
    is one look and a flood of them a bounded rate of looks. The gap doubles
    after a look a notification caused that found nothing, up to ``max_s``,
    and is back at ``min_s`` after any look that found work: forged
    notifications cost a few looks a second, a real one waits at most a few
    milliseconds while the loop's looks find work, and at most ``max_s``
    after a run of empty ones. Times are the caller's clock's."""

    def __init__(self, min_s: float = NOTIFIED_GAP_MIN_S, max_s: float = NOTIFIED_GAP_MAX_S) -> None:
        self.min_s, self.max_s = min_s, max(min_s, max_s)
        self.gap_s = min_s
        self._last = float("-inf")

    def due_at(self) -> float:
        """From when a notification may cause a look."""
        return self._last + self.gap_s

    def looked(self, at: float, *, notified: bool, found: bool) -> None:
        """A look ended at ``at``: caused by a notification or not, and
        whether it found anything to do."""
        self._last = at
        if found:
            self.gap_s = self.min_s
        elif notified:
            self.gap_s = min(self.gap_s * 2, self.max_s)


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


class BackoffSettings(Protocol):
    """The backoff keys of a settings section (``[ingest]``, ``[acker]``);
    named here so that this module needs no import of the config."""

    @property
    def backoff_initial_ms(self) -> int: ...

    @property
    def backoff_max_ms(self) -> int: ...


class Retry:
    """How a loop retries: each failure is logged (see
    :func:`ingest.errors.log_failure`) with its ``attempt`` and ``retry_in_s``,
    and answered with the backoff's next delay; a success resets the backoff.

    ``expected`` names the failures logged as warnings; any other is logged
    with its traceback."""

    def __init__(
        self,
        backoff: Backoff,
        log: FilteringBoundLogger,
        *,
        expected: tuple[type[BaseException], ...] = EXPECTED_FAILURES,
    ) -> None:
        self._backoff = backoff
        self._log = log
        self._expected = expected

    @classmethod
    def from_settings(
        cls,
        settings: BackoffSettings,
        log: FilteringBoundLogger,
        *,
        expected: tuple[type[BaseException], ...] = EXPECTED_FAILURES,
    ) -> Retry:
        """The retry of every loop that backs off: a fresh backoff from the
        section's ``backoff_initial_ms`` and ``backoff_max_ms``."""
        return cls(Backoff(settings.backoff_initial_ms, settings.backoff_max_ms), log, expected=expected)

    def failed(self, event: str, exc: BaseException, **fields: Any) -> float:
        """Log the failure; return how long to wait before the next attempt."""
        delay_s = self._backoff.next_delay_s()
        log_failure(
            self._log,
            event,
            exc,
            expected=self._expected,
            attempt=self._backoff.attempt,
            retry_in_s=round(delay_s, 3),
            **fields,
        )
        return delay_s

    async def back_off(self, stop: asyncio.Event, event: str, exc: BaseException, **fields: Any) -> None:
        """Log the failure, then wait the delay out, or until ``stop``."""
        await wait_stop(stop, self.failed(event, exc, **fields))

    def succeeded(self) -> None:
        self._backoff.reset()


def leftover_tasks() -> list[str]:
    """Names of tasks still alive besides the caller: a run must leave none."""
    current = asyncio.current_task()
    return sorted(t.get_name() for t in asyncio.all_tasks() if t is not current and not t.done())
