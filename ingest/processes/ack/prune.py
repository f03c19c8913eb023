"""Retention: the walks that delete what is past its ``retain_*`` setting
(issue 14), run by the acker every ``[acker] prune_interval_ms`` and by
``switchboard prune``.

One walk per retention setting: an adapter's acked inbox rows (with their
events), its rejected rows, its stale delivery attempts; a queue's done and
cancelled todos, its failed todos (with their ``todo_events``). A walk is a
run of bounded batches (``backhalf.housekeeping.retention``), each its own short
transaction under the transaction deadline, with a pause between them so
autovacuum and replicas keep up with the deletes and nobody's locks are held
for long; it ends at the first row newer than its cutoff. Acked walks of
adapters with the same retention run as one (:meth:`Pruner.units`): one
read of the inbox for all of them, the deletions counted by adapter.

A :class:`Pruner` remembers, for each walk, a cursor and the rows it held.
The cursor moves past every row a batch examined, up to the edge, kept rows
included; a row kept for a reason that passes (an ack pending, a todo
active, a row locked) goes into the walk's held set (at most
:data:`HELD_LIMIT`), which each run re-checks by id first. So one long-held
row costs a primary-key probe a run, never a re-read of what follows it.
What the cursor cannot see is a row that turns into the walk's status after
the walk passed it (a failed todo retried that ends done; a rejected row
replayed and stored): every :data:`FULL_SWEEP_INTERVAL_S` a walk starts from
the first id again, which finds those, and any held rows past the bound.
The acker's pruner lives as long as the process, so between full sweeps a
run reads only what was written since the last one plus its held rows; a new
process, ``switchboard prune`` and every dry run start with a full sweep.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Literal

import structlog
from sqlalchemy.ext.asyncio import AsyncEngine

from backhalf.db import within_deadline
from backhalf.housekeeping import retention
from ingest.config import AckerSettings, AdapterConfig, Settings, WebhookConfig
from ingest.lifecycle import Retry, wait_stop
from ingest.processes.ack.partitions import done_keep

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
    # A webhook's rows (ack 'none') are kept by the same walks: its dedup
    # horizon against the senders' retries.
    kept: list[AdapterConfig | WebhookConfig] = [*settings.adapters, *settings.webhooks]
    for a in kept:
        if a.retain_acked_days is not None:
            age = timedelta(seconds=a.retain_acked_days * DAY_S)
            # A stale attempt is of a message not seen for as long as an
            # acked row is kept: the same horizon.
            found += [Walk("acked", a.name, age), Walk("attempts", a.name, age)]
        if a.retain_rejected_days is not None:
            found.append(Walk("rejected", a.name, timedelta(seconds=a.retain_rejected_days * DAY_S)))
    # Finished todos kept as long as the longest retention go with their
    # partitions (ingest.processes.ack.partitions); a queue that keeps them
    # less long is walked down to its own.
    by_partition = done_keep(settings)
    for q in settings.queues.values():
        if q.retain_done_days is not None:
            age = timedelta(seconds=q.retain_done_days * DAY_S)
            if by_partition is None or age < by_partition:
                found.append(Walk("done", q.name, age))
        if q.retain_failed_days is not None:
            found.append(Walk("failed", q.name, timedelta(seconds=q.retain_failed_days * DAY_S)))
    return found


@dataclass(slots=True)
class WalkResult:
    """One walk of one run: rows deleted (or, dry, that would be) by table."""

    walk: Walk
    deleted: dict[str, int]
    batches: int = 0
    scanned: int = 0  # rows read; shared by the adapters of one acked walk
    longest_batch_s: float = 0.0
    elapsed_s: float = 0.0
    finished: bool = False  # False: stopped before its end (shutdown)
    full_sweep: bool = False  # this run walked from the first id
    held: int = 0  # rows the walk is left holding, to re-check by id

    def add(self, deleted: dict[str, int]) -> None:
        for table, n in deleted.items():
            self.deleted[table] = self.deleted.get(table, 0) + n


Progress = Callable[[WalkResult], None]

# How often a walk starts again from the first id: what changed into its
# status behind its cursor (a failed todo retried that ends done, a rejected
# row replayed), and held rows past the bound below, are found then.
FULL_SWEEP_INTERVAL_S = 3600.0
# The most held rows a walk re-checks by id; past it, the next full sweep
# finds the rest (a stalled queue's active backlog must not grow the set).
HELD_LIMIT = 10_000


@dataclass(slots=True)
class _WalkState:
    """Where a walk goes on from: its cursor, the rows it holds, and when its
    last full sweep started (None: never)."""

    cursor: int = 0
    held: set[int] = field(default_factory=set)
    swept_at: float | None = None


@dataclass(slots=True)
class _Tally:
    """One run of a unit's walks: their results, and when progress is next
    reported (every ``progress_interval_s``, if there is a ``progress``)."""

    results: dict[str, WalkResult]
    progress: Progress | None
    progress_interval_s: float
    started: float = field(default_factory=time.monotonic)
    next_progress: float = field(init=False)

    def __post_init__(self) -> None:
        self.next_progress = self.started + self.progress_interval_s

    def account(self, batch_started: float, scanned: int, by_owner: dict[str, dict[str, int]]) -> None:
        """One batch done: ``scanned`` rows read, ``by_owner`` the rows deleted per walk and table."""
        now = time.monotonic()
        for name, result in self.results.items():
            result.longest_batch_s = max(result.longest_batch_s, now - batch_started)
            result.batches += 1
            result.scanned += scanned
            result.add(by_owner.get(name, {}))
        if self.progress is not None and now >= self.next_progress:
            self.next_progress = now + self.progress_interval_s
            for result in self.results.values():
                result.elapsed_s = now - self.started
                self.progress(result)

    def ended(self, finished: bool, *, full_sweep: bool = False, held: int = 0) -> list[WalkResult]:
        for result in self.results.values():
            result.finished, result.full_sweep, result.held = finished, full_sweep, held
            result.elapsed_s = time.monotonic() - self.started
        return list(self.results.values())


@dataclass(slots=True)
class Pruner:
    """Runs the walks; remembers where each goes on from (see the module docstring)."""

    engine: AsyncEngine
    walks: list[Walk]
    batch_size: int
    pause_ms: int
    deadline_ms: int
    full_sweep_interval_s: float = FULL_SWEEP_INTERVAL_S
    held_limit: int = HELD_LIMIT
    clock: Callable[[], float] = time.monotonic
    _state: dict[tuple[Walk, ...], _WalkState] = field(default_factory=dict)

    def units(self) -> list[tuple[Walk, ...]]:
        """The walks as run: acked walks of the same age together (one read of
        the inbox for all those adapters, counted apart), every other alone."""
        found: dict[tuple[WalkKind, timedelta] | Walk, list[Walk]] = {}
        for walk in self.walks:
            found.setdefault((walk.kind, walk.age) if walk.kind == "acked" else walk, []).append(walk)
        return [tuple(group) for group in found.values()]

    async def run(
        self,
        stop: asyncio.Event | None = None,
        *,
        dry_run: bool = False,
        progress: Progress | None = None,
        progress_interval_s: float = 5.0,
    ) -> list[WalkResult]:
        """Every walk once, or until ``stop``. A dry run walks from the first
        id, deletes nothing and changes no walk's state. A failed batch raises
        (``PruneError``, ``DeadlineExceeded``): what earlier batches deleted
        stays deleted, and the walk goes on after the last batch that
        committed."""
        results = []
        for unit in self.units():
            if stop is not None and stop.is_set():
                break
            done = await self._walk(unit, stop, dry_run, progress, progress_interval_s)
            results += done
            for result in done:
                if not any(result.deleted.values()):
                    continue
                log.info(
                    "prune_walk_done",
                    kind=result.walk.kind,
                    owner=result.walk.owner,
                    dry_run=dry_run,
                    batches=result.batches,
                    scanned=result.scanned,
                    held=result.held,
                    full_sweep=result.full_sweep,
                    longest_batch_ms=round(result.longest_batch_s * 1000, 1),
                    elapsed_s=round(result.elapsed_s, 3),
                    finished=result.finished,
                    **result.deleted,
                )
        return results

    async def _batch(
        self, unit: tuple[Walk, ...], *, cursor: int = 0, ids: list[int] | None = None, dry_run: bool
    ) -> retention.Batch:
        walk = unit[0]
        what = f"{walk.owner}: pruning ({walk.kind})"
        window = retention.Window(
            age=walk.age, limit=self.batch_size, cursor=cursor, ids=ids, dry_run=dry_run
        )
        async with within_deadline(self.engine.begin(), self.deadline_ms, what) as conn:
            if walk.kind in ("acked", "rejected"):
                return await retention.prune_inbox(
                    conn,
                    adapters=[w.name for w in unit],
                    status="stored" if walk.kind == "acked" else "rejected",
                    window=window,
                )
            batch = await retention.prune_todos(
                conn,
                queue=walk.name,
                statuses=retention.DONE_STATUSES if walk.kind == "done" else retention.FAILED_STATUSES,
                window=window,
            )
            return dataclasses.replace(batch, by_owner={walk.name: batch.deleted})

    async def _attempts_batch(self, walk: Walk, after: str, dry_run: bool) -> retention.AttemptsPage:
        what = f"{walk.owner}: pruning ({walk.kind})"
        async with within_deadline(self.engine.begin(), self.deadline_ms, what) as conn:
            if dry_run:
                return await retention.count_attempts(
                    conn, adapter=walk.name, age=walk.age, after=after, limit=self.batch_size
                )
            n = await retention.prune_attempts(conn, adapter=walk.name, age=walk.age, limit=self.batch_size)
            # Not a cursor walk: deleted rows are gone, so the next batch
            # finds the next ones; a short batch is the end.
            return retention.AttemptsPage(n, None if n < self.batch_size else after, n)

    async def _walk(
        self,
        unit: tuple[Walk, ...],
        stop: asyncio.Event | None,
        dry_run: bool,
        progress: Progress | None,
        progress_interval_s: float,
    ) -> list[WalkResult]:
        # One result per walk; what the unit's batches share (rows read,
        # batches, time) is the same on each.
        results = {w.name: WalkResult(w, dict.fromkeys(TABLES[w.kind], 0)) for w in unit}
        tally = _Tally(results, progress, progress_interval_s)
        if unit[0].kind == "attempts":
            return await self._walk_attempts(unit[0], tally, stop, dry_run)
        return await self._walk_by_cursor(unit, tally, stop, dry_run)

    async def _paused(self, stop: asyncio.Event | None) -> bool:
        """The pause between batches (autovacuum and replicas catch up);
        True: stop was asked for."""
        if stop is None:
            await asyncio.sleep(self.pause_ms / 1000)
            return False
        return await wait_stop(stop, self.pause_ms / 1000)

    async def _walk_attempts(
        self, walk: Walk, tally: _Tally, stop: asyncio.Event | None, dry_run: bool
    ) -> list[WalkResult]:
        after = ""
        while True:
            batch_started = time.monotonic()
            page = await self._attempts_batch(walk, after, dry_run)
            tally.account(batch_started, page.scanned, {walk.name: {"delivery_attempts": page.old}})
            if page.last_key is None or page.scanned < self.batch_size:
                return tally.ended(True)
            after = page.last_key
            if await self._paused(stop):
                return tally.ended(False)

    async def _walk_by_cursor(
        self, unit: tuple[Walk, ...], tally: _Tally, stop: asyncio.Event | None, dry_run: bool
    ) -> list[WalkResult]:
        # A dry run counts everything from the first id and leaves the
        # acker's walk as it was.
        state = _WalkState() if dry_run else self._state.setdefault(unit, _WalkState())
        now = self.clock()
        full_sweep = state.swept_at is None or now - state.swept_at >= self.full_sweep_interval_s
        if full_sweep:
            # Starting from the first id finds every held row again.
            state.cursor, state.held, state.swept_at = 0, set(), now
        if not await self._recheck_held(unit, state, tally, stop, dry_run):
            return tally.ended(False, full_sweep=full_sweep, held=len(state.held))
        while True:
            batch_started = time.monotonic()
            batch = await self._batch(unit, cursor=state.cursor, dry_run=dry_run)
            # Past every row examined, held ones included, up to the edge.
            if batch.last_id is not None:
                state.cursor = batch.last_id if batch.edge_id is None else batch.edge_id - 1
            room = max(self.held_limit - len(state.held), 0)
            state.held.update(batch.held_ids[:room])
            tally.account(batch_started, batch.scanned, batch.by_owner)
            if batch.edge_id is not None or batch.scanned < self.batch_size:
                return tally.ended(True, full_sweep=full_sweep, held=len(state.held))
            if await self._paused(stop):
                return tally.ended(False, full_sweep=full_sweep, held=len(state.held))

    async def _recheck_held(
        self,
        unit: tuple[Walk, ...],
        state: _WalkState,
        tally: _Tally,
        stop: asyncio.Event | None,
        dry_run: bool,
    ) -> bool:
        """The rows the walk holds, by id, first: one long-held row costs one
        probe a run, not a re-read of everything after it. False: stop was
        asked for."""
        pending = sorted(state.held)
        for i in range(0, len(pending), self.batch_size):
            chunk = pending[i : i + self.batch_size]
            batch_started = time.monotonic()
            batch = await self._batch(unit, ids=chunk, dry_run=dry_run)
            state.held.difference_update(chunk)
            state.held.update(batch.held_ids)
            tally.account(batch_started, batch.scanned, batch.by_owner)
            if await self._paused(stop):
                return False
        return True


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
    retry = Retry.from_settings(acker, log)
    while not stop.is_set():
        try:
            await pruner.run(stop)
        except Exception as exc:  # noqa: BLE001 - the database or a bug: log, back off, go on
            await retry.back_off(stop, "prune_failed", exc)
            continue
        retry.succeeded()
        await wait_stop(stop, acker.prune_interval_ms / 1000)
