"""Retention: the walks that delete what is past its ``retain_*`` setting
(issue 14), run by the acker every ``[acker] prune_interval_ms`` and by
``switchboard prune``.

One walk per retention setting: an adapter's acked inbox rows (with their
events), its rejected rows, its stale delivery attempts; a queue's done and
cancelled todos, its failed todos (with their ``todo_events``). A walk is a
run of bounded batches (``backhalf.retention``), each its own short
transaction under the transaction deadline, with a pause between them so
autovacuum and replicas keep up with the deletes and nobody's locks are held
for long; it ends at the first row newer than its cutoff.

A :class:`Pruner` remembers where each walk should start again: just before
the first row it had to keep for a reason that passes (an ack pending, a todo
active, a row locked), else where it stopped. The acker's pruner lives as long
as the process, so each run reads only what was written since the last one
(plus what the last one had to keep); a new process, or ``switchboard
prune``, starts at the beginning of each table once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Literal

import structlog
from sqlalchemy.ext.asyncio import AsyncEngine

from backhalf import retention
from backhalf.db import within_deadline
from ingest.config import AckerSettings, Settings
from ingest.lifecycle import Backoff, Retry, wait_stop

log = structlog.get_logger(__name__)

DAY_S = 86_400.0

WalkKind = Literal["acked", "rejected", "attempts", "done", "failed"]
# Which tables each kind of walk deletes from, in the order they are reported.
TABLES: dict[WalkKind, tuple[str, ...]] = {
    "acked": ("inbox", "events"),
    "rejected": ("inbox", "events"),
    "attempts": ("delivery_attempts",),
    "done": ("todos", "todo_events"),
    "failed": ("todos", "todo_events"),
}


@dataclass(frozen=True, slots=True)
class Walk:
    """One retention setting at work: ``owner`` is ``adapter NAME`` or ``queue NAME``."""

    kind: WalkKind
    name: str
    age: timedelta

    @property
    def owner(self) -> str:
        return f"{'queue' if self.kind in ('done', 'failed') else 'adapter'} {self.name}"


def walks(settings: Settings) -> list[Walk]:
    """The walks the settings ask for: none when no ``retain_*`` key is set."""
    found: list[Walk] = []
    for a in settings.adapters:
        if a.retain_acked_days is not None:
            age = timedelta(seconds=a.retain_acked_days * DAY_S)
            # A stale attempt is of a message not seen for as long as an
            # acked row is kept: the same horizon.
            found += [Walk("acked", a.name, age), Walk("attempts", a.name, age)]
        if a.retain_rejected_days is not None:
            found.append(Walk("rejected", a.name, timedelta(seconds=a.retain_rejected_days * DAY_S)))
    for q in settings.queues.values():
        if q.retain_done_days is not None:
            found.append(Walk("done", q.name, timedelta(seconds=q.retain_done_days * DAY_S)))
        if q.retain_failed_days is not None:
            found.append(Walk("failed", q.name, timedelta(seconds=q.retain_failed_days * DAY_S)))
    return found


@dataclass(slots=True)
class WalkResult:
    """One walk of one run: rows deleted (or, dry, that would be) by table."""

    walk: Walk
    deleted: dict[str, int]
    batches: int = 0
    scanned: int = 0
    longest_batch_s: float = 0.0
    elapsed_s: float = 0.0
    finished: bool = False  # False: stopped before its end (shutdown)

    def add(self, deleted: dict[str, int]) -> None:
        for table, n in deleted.items():
            self.deleted[table] = self.deleted.get(table, 0) + n


Progress = Callable[[WalkResult], None]


@dataclass(slots=True)
class Pruner:
    """Runs the walks; remembers where each starts again (see the module docstring)."""

    engine: AsyncEngine
    walks: list[Walk]
    batch_size: int
    pause_ms: int
    deadline_ms: int
    _resume: dict[Walk, int] = field(default_factory=dict)

    async def run(
        self,
        stop: asyncio.Event | None = None,
        *,
        dry_run: bool = False,
        progress: Progress | None = None,
        progress_interval_s: float = 5.0,
    ) -> list[WalkResult]:
        """Every walk once, or until ``stop``. A dry run deletes nothing and
        moves no restart point. A failed batch raises (``PruneError``,
        ``DeadlineExceeded``): what earlier batches deleted stays deleted, and
        that walk starts again where it last started."""
        results = []
        for walk in self.walks:
            if stop is not None and stop.is_set():
                break
            result = await self._walk(walk, stop, dry_run, progress, progress_interval_s)
            results.append(result)
            if any(result.deleted.values()):
                log.info(
                    "prune_walk_done",
                    kind=walk.kind,
                    owner=walk.owner,
                    dry_run=dry_run,
                    batches=result.batches,
                    scanned=result.scanned,
                    longest_batch_ms=round(result.longest_batch_s * 1000, 1),
                    elapsed_s=round(result.elapsed_s, 3),
                    finished=result.finished,
                    **result.deleted,
                )
        return results

    async def _walk(
        self,
        walk: Walk,
        stop: asyncio.Event | None,
        dry_run: bool,
        progress: Progress | None,
        progress_interval_s: float,
    ) -> WalkResult:
        result = WalkResult(walk, dict.fromkeys(TABLES[walk.kind], 0))
        started = time.monotonic()
        next_progress = started + progress_interval_s
        cursor = self._resume.get(walk, 0)
        held: int | None = None
        while True:
            batch_started = time.monotonic()
            what = f"{walk.owner}: pruning ({walk.kind})"
            async with within_deadline(self.engine.begin(), self.deadline_ms, what) as conn:
                if walk.kind == "attempts":
                    n = await retention.prune_attempts(
                        conn, adapter=walk.name, age=walk.age, limit=self.batch_size, dry_run=dry_run
                    )
                    batch = retention.Batch(n, None, None, None, {"delivery_attempts": n})
                elif walk.kind in ("acked", "rejected"):
                    batch = await retention.prune_inbox(
                        conn,
                        adapter=walk.name,
                        status="stored" if walk.kind == "acked" else "rejected",
                        age=walk.age,
                        cursor=cursor,
                        limit=self.batch_size,
                        dry_run=dry_run,
                    )
                else:
                    batch = await retention.prune_todos(
                        conn,
                        queue=walk.name,
                        statuses=retention.DONE_STATUSES
                        if walk.kind == "done"
                        else retention.FAILED_STATUSES,
                        age=walk.age,
                        cursor=cursor,
                        limit=self.batch_size,
                        dry_run=dry_run,
                    )
            now = time.monotonic()
            result.longest_batch_s = max(result.longest_batch_s, now - batch_started)
            result.batches += 1
            result.scanned += batch.scanned
            result.add(batch.deleted)
            if batch.held_id is not None and held is None:
                held = batch.held_id
            if progress is not None and now >= next_progress:
                next_progress = now + progress_interval_s
                result.elapsed_s = now - started
                progress(result)
            if walk.kind == "attempts":
                # Not a cursor walk: a dry run counts one batch's worth and
                # says so; a real one deletes until a batch comes back short.
                ended = dry_run or batch.scanned < self.batch_size
            else:
                ended = batch.edge_id is not None or batch.scanned < self.batch_size
                if batch.last_id is not None:
                    cursor = batch.last_id if batch.edge_id is None else batch.edge_id - 1
            if ended:
                result.finished = True
                break
            # The pause: autovacuum and replicas catch up between batches.
            if stop is None:
                await asyncio.sleep(self.pause_ms / 1000)
            elif await wait_stop(stop, self.pause_ms / 1000):
                break
        result.elapsed_s = time.monotonic() - started
        if not dry_run and walk.kind != "attempts":
            self._resume[walk] = cursor if held is None else min(cursor, held - 1)
        return result


async def prune_loop(engine: AsyncEngine, settings: Settings, stop: asyncio.Event) -> None:
    """The acker's task: every ``prune_interval_ms``, each walk once; failures
    are logged, backed off and retried, never the end of the process."""
    acker: AckerSettings = settings.acker
    pruner = Pruner(
        engine,
        walks(settings),
        batch_size=acker.prune_batch_size,
        pause_ms=acker.prune_pause_ms,
        deadline_ms=settings.database.transaction_deadline_ms,
    )
    log.info(
        "prune_on",
        walks=[f"{w.owner} {w.kind} after {w.age.total_seconds() / DAY_S:g} days" for w in pruner.walks],
        interval_ms=acker.prune_interval_ms,
        batch_size=acker.prune_batch_size,
    )
    retry = Retry(Backoff(acker.backoff_initial_ms, acker.backoff_max_ms), log)
    while not stop.is_set():
        try:
            await pruner.run(stop)
        except Exception as exc:  # noqa: BLE001 - the database or a bug: log, back off, go on
            await retry.back_off(stop, "prune_failed", exc)
            continue
        retry.succeeded()
        await wait_stop(stop, acker.prune_interval_ms / 1000)
