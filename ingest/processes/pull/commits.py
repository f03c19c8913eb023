"""The commits of one poll loop still under way (``ingest.processes.pull.poll``).

A stream adapter keeps up to ``commits_in_flight`` store transactions running
at once; each waits for the one before it before it confirms its batch to the
adapter. This class owns them, oldest first, and names the waits the loop
needs: reap those that ended, wait until fewer than N run, wait for all,
settle after a failure, cancel on the shutdown deadline.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from ingest.errors import log_failure

if TYPE_CHECKING:
    from structlog.typing import FilteringBoundLogger

# A commit, handed the commit before it (if any) to wait for.
Commit = Callable[[asyncio.Task[None] | None], Coroutine[Any, Any, None]]


class Commits:
    """The commits of one poll loop still under way, oldest first.

    Each commit waits for the one before it to be confirmed (see
    :meth:`PollLoop._commit`), so they are confirmed in the order they were
    read, and a failure of one fails every later one with the same exception.
    A commit leaves only once it has ended: until then a rewind must wait for
    it, or a batch still committing would be confirmed after the rewind forgot
    it. A failure a method raises leaves the failed commit in place, for
    :meth:`settle`, unless the method says otherwise.
    """

    def __init__(self, log: FilteringBoundLogger) -> None:
        self._tasks: deque[asyncio.Task[None]] = deque()
        self._log = log

    def __len__(self) -> int:
        return len(self._tasks)

    def start(self, commit: Commit, name: str) -> None:
        """Start a commit, handed the commit before it (None if none is under
        way) to wait for before it confirms."""
        after = self._tasks[-1] if self._tasks else None
        self._tasks.append(asyncio.create_task(commit(after), name=name))

    def reap_ended(self) -> None:
        """Let go of the oldest commits that already ended, without waiting;
        the first failure met is raised (that commit is let go of too)."""
        while self._tasks and self._tasks[0].done():
            self._tasks.popleft().result()

    async def wait_below(self, limit: int) -> None:
        """Wait, oldest first, until fewer than ``limit`` commits are under way."""
        while len(self._tasks) >= limit:
            await self._tasks[0]
            self._tasks.popleft()

    async def wait_all(self) -> None:
        """Wait, oldest first, until no commit is under way."""
        await self.wait_below(1)

    async def settle(self, reported: BaseException | None) -> bool:
        """Wait for every commit under way (each is bounded by the transaction
        deadline), failed or not; return whether any failed. A failure is
        logged here unless it is ``reported`` (the one the caller logs), which
        a later commit re-raises when it waited for its predecessor."""
        logged = {id(reported)}
        failed = False
        while self._tasks:
            try:
                await self._tasks[0]
            except Exception as exc:  # noqa: BLE001 - logged, then the rewind covers it
                failed = True
                if id(exc) not in logged:
                    logged.add(id(exc))
                    log_failure(self._log, "store_failed", exc, overlapping=True)
            self._tasks.popleft()
        return failed

    async def cancel(self, timeout_s: float) -> None:
        """Cancel every commit under way (each rolls back, its batch is
        redelivered later), wait up to ``timeout_s`` for them to end, and let
        go of them all, so none outlives the loop unnoticed."""
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=timeout_s)
        for task in self._tasks:
            if not task.done():
                self._log.error("commit_not_cancellable", task=task.get_name())
            # Retrieved (now or when it ends): the batch is redelivered either way.
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
        self._tasks.clear()
