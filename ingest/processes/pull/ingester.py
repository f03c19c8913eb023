"""``switchboard ingest``: one poll loop per enabled adapter in a TaskGroup.

Run in the process skeleton (``ingest.processes.skeleton``). Shutdown order,
under one deadline (``shutdown_timeout_s``): stop is set, each loop abandons
its read and finishes the store it is in, the loops return, adapters close
their connections, the engine is disposed. Loops still running at the
deadline are cancelled.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Mapping, Sequence
from typing import Any

import structlog
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine

from backhalf.db import MAX_OVERFLOW, within_deadline
from backhalf.errors import DeadlineExceeded
from backhalf.housekeeping import heartbeats
from backhalf.writes.stream_groups import GroupStartLedger
from ingest.adapters.base import FAMILY, AdapterBuilder, PullAdapter
from ingest.adapters.factory import make_adapter
from ingest.config import AdapterConfig, Settings
from ingest.errors import log_failure
from ingest.observe.heartbeat import broker_gauges_loop
from ingest.processes.intake import Registration, register_adapters
from ingest.processes.pull.poll import PollLoop
from ingest.processes.skeleton import Job, Process, ProcessBody, run_process

log = structlog.get_logger(__name__)


def pull_registrations(settings: Settings) -> list[Registration]:
    return [Registration(a.name, FAMILY, a.transport, a.mode, a.public_settings()) for a in settings.adapters]


def connections_needed(adapters: Sequence[PullAdapter], commits_in_flight: int) -> int:
    """Connections the poll loops may hold at once: each commit under way,
    plus one for a loop's own short transactions (the enabled flag, delivery
    attempts) while its commits run."""
    return sum((commits_in_flight if a.overlapping_commits else 1) + 1 for a in adapters)


def warn_if_pool_small(adapters: Sequence[PullAdapter], settings: Settings) -> None:
    # Not an error: a commit waiting for a connection is only slower, and
    # the wait counts against the transaction deadline. Said once, at start.
    needed = connections_needed(adapters, settings.ingest.commits_in_flight)
    if needed > settings.database.pool_size + MAX_OVERFLOW:
        log.warning(
            "pool_smaller_than_needed",
            pool_size=settings.database.pool_size,
            max_overflow=MAX_OVERFLOW,
            needed=needed,
            hint=f"set [database] pool_size to at least {needed - MAX_OVERFLOW}",
        )


async def run_ingester(
    settings: Settings,
    stop: asyncio.Event,
    *,
    adapter_factory: AdapterBuilder = make_adapter,
) -> None:
    await run_process(settings, stop, lambda engine: _Ingester(settings, engine, adapter_factory))


class _Ingester(ProcessBody):
    """The adapters registered, then a poll loop per adapter, each adapter's
    background task (its heartbeats and the like) beside it."""

    role = "ingest"
    traced = True
    stopped_event = "ingester_stopped"
    overdue_field = "loops"

    def __init__(self, settings: Settings, engine: AsyncEngine, adapter_factory: AdapterBuilder) -> None:
        self.shutdown_timeout_s = settings.ingest.shutdown_timeout_s
        self._settings = settings
        self._engine = engine
        self._adapter_factory = adapter_factory
        self._adapters: list[PullAdapter] = []
        self._polls: dict[str, PollLoop] = {}
        names = [cfg.name for cfg in settings.adapters]
        consumers = sorted({cfg.consumer for cfg in settings.adapters})
        # The slot: what a restart of this process reads again (see backhalf.housekeeping.heartbeats).
        self._detail = {
            "adapters": names,
            "consumers": consumers,
            # Which consumer reads which adapter: what two ingesters may not share.
            "reading": sorted([cfg.name, cfg.consumer] for cfg in settings.adapters),
            "slot": heartbeats.slot(names, consumers),
        }

    async def start(self, process: Process) -> bool:
        settings = self._settings
        if not await register_adapters(self._engine, settings, process.stop, pull_registrations(settings)):
            return False
        ledger = GroupStartLedger(self._engine, process.deadline_ms)
        self._adapters = [self._adapter_factory(cfg, ledger=ledger) for cfg in settings.adapters]
        warn_if_pool_small(self._adapters, settings)
        await self._warn_if_consumer_taken(process)
        return True

    async def _warn_if_consumer_taken(self, process: Process) -> None:
        """Another live ingester reading an adapter of ours under one of our
        consumer names: two processes sharing a stream consumer's pending
        list or a list's processing list, each taking the other's unacked
        messages for its own. Said once at start (a crash's restart is not
        another process: its row's pid is gone from this host)."""
        try:
            async with within_deadline(
                self._engine.connect(), process.deadline_ms, "reading heartbeats"
            ) as conn:
                rows = await heartbeats.list_processes(conn)
        except (SQLAlchemyError, DeadlineExceeded) as exc:
            log_failure(log, "heartbeats_unread", exc)  # a warning's worth: start anyway
            return
        for row in taken_consumers(rows, self._detail, socket.gethostname()):
            shared = _pairs_shared(self._detail, row.detail)
            log.warning(
                "consumer_name_in_use",
                consumers=sorted({consumer for _, consumer in shared}),
                adapters=sorted({adapter for adapter, _ in shared}),
                other_host=row.host,
                other_pid=row.pid,
                detail="another live ingester reads these adapters under the same consumer name: give each"
                " process its own (--consumer, or the adapter's consumer)",
            )

    def _pairs(self) -> list[tuple[PullAdapter, AdapterConfig]]:
        return list(zip(self._adapters, self._settings.adapters, strict=True))

    def spawn(self, process: Process) -> None:
        settings = self._settings
        pairs = self._pairs()
        self._polls = {
            cfg.name: PollLoop(
                a,
                cfg,
                self._engine,
                settings.ingest,
                process.stop,
                deadline_ms=process.deadline_ms,
                tick=process.watch(
                    f"poll:{cfg.name}", max(cfg.block_ms, settings.ingest.enabled_refresh_ms) / 1000
                ),
                broker_health=process.dependency(f"{cfg.transport} broker at {a.broker} ({cfg.name})"),
            )
            for a, cfg in pairs
        }
        for _a, cfg in pairs:
            process.work(self._polls[cfg.name].run(), name=f"poll:{cfg.name}")
        # Heartbeats and the like: they end on stop by themselves.
        for a, cfg in pairs:
            process.beside(a.run_background(process.stop), name=f"background:{cfg.name}")

    def detail(self) -> Mapping[str, Any]:
        return self._detail

    def gauges(self, process: Process, interval_s: float) -> tuple[str, Job]:
        polls = self._polls
        loop = broker_gauges_loop(self._pairs(), lambda name: polls[name].enabled, interval_s, process.stop)
        return "broker-gauges", loop

    async def close(self) -> None:
        for a in self._adapters:
            await a.close()


def taken_consumers(
    rows: Sequence[heartbeats.ProcessRow], ours: Mapping[str, Any], host: str
) -> list[heartbeats.ProcessRow]:
    """The live ingesters (not this process: it has not beaten yet) whose
    adapters and consumer names meet ``ours``; on this host only those whose
    pid still runs (a crashed slot's row stays fresh a few seconds)."""
    return [
        row
        for row in rows
        if row.role == _Ingester.role
        and row.state in ("alive", "stuck", "failing")
        and _pairs_shared(ours, row.detail)
        and (row.host != host or _pid_runs(row.pid))
    ]


def _pairs_shared(ours: Mapping[str, Any], theirs: Mapping[str, Any]) -> set[tuple[str, str]]:
    """The (adapter, consumer) pairs both read; for a row written before
    ``reading`` existed, every pair its adapters and consumers could make."""

    def pairs(detail: Mapping[str, Any]) -> set[tuple[str, str]]:
        if "reading" in detail:
            return {(str(a), str(c)) for a, c in detail["reading"]}
        return {(str(a), str(c)) for a in detail.get("adapters") or () for c in detail.get("consumers") or ()}

    return pairs(ours) & pairs(theirs)


def _pid_runs(pid: int) -> bool:
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it runs
        return True
    return True
