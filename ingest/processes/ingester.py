"""``switchboard ingest``: one poll loop per enabled adapter in a TaskGroup.

Shutdown order, under one deadline (``shutdown_timeout_s``): stop is set, each
loop abandons its read and finishes the store it is in, the loops return,
adapters close their connections, the engine is disposed. Loops still running
at the deadline are cancelled.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import structlog
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine

from backhalf import db_errors, heartbeats, registry, stream_groups
from backhalf.db import MAX_OVERFLOW, create_engine, within_deadline
from backhalf.errors import DeadlineExceeded
from backhalf.stream_groups import GroupStartLedger
from ingest.adapters.base import FAMILY, AdapterBuilder, PullAdapter
from ingest.adapters.factory import make_adapter
from ingest.config import Settings
from ingest.lifecycle import Backoff, Retry
from ingest.observe.heartbeat import broker_gauges_loop, heartbeat_loop, loop_bound_s, new_liveness, serving
from ingest.observe.metrics_http import Liveness
from ingest.processes.poll import PollLoop

log = structlog.get_logger(__name__)


async def register_adapters(engine: AsyncEngine, settings: Settings, stop: asyncio.Event) -> bool:
    """Upsert every configured adapter, retrying while the database is away.
    Return False if stop was requested first. A permanent error (the schema
    missing, the login refused, no such database) raises DatabaseUnusable:
    waiting would not fix it."""
    retry = Retry(Backoff(settings.ingest.backoff_initial_ms, settings.ingest.backoff_max_ms), log)
    while not stop.is_set():
        try:
            deadline_ms = settings.database.transaction_deadline_ms
            async with within_deadline(engine.begin(), deadline_ms, "registering adapters") as conn:
                for a in settings.adapters:
                    await registry.register(
                        conn,
                        name=a.name,
                        family=FAMILY,
                        transport=a.transport,
                        mode=a.mode,
                        settings=a.public_settings(),
                    )
                # The stream adapters record their groups' starts there: a
                # database not migrated to this version stops us here (exit 3,
                # "run switchboard migrate"), not in every poll loop's retries.
                await stream_groups.present(conn)
        except (SQLAlchemyError, DeadlineExceeded) as exc:
            db_errors.raise_if_permanent(exc)
            await retry.back_off(stop, "register_failed", exc)
        else:
            log.info("adapters_registered", adapters=[a.name for a in settings.adapters])
            return True
    return False


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
    liveness = new_liveness()
    with serving(settings, liveness):
        await _run_ingester(settings, stop, adapter_factory, liveness)


async def _run_ingester(
    settings: Settings, stop: asyncio.Event, adapter_factory: AdapterBuilder, liveness: Liveness
) -> None:
    engine = create_engine(settings.database)
    adapters: list[PullAdapter] = []
    deadline_ms = settings.database.transaction_deadline_ms
    try:
        if not await register_adapters(engine, settings, stop):
            return
        group_starts = GroupStartLedger(engine, deadline_ms)
        adapters = [adapter_factory(cfg, group_starts=group_starts) for cfg in settings.adapters]
        warn_if_pool_small(adapters, settings)
        async with asyncio.TaskGroup() as tg:
            pairs = list(zip(adapters, settings.adapters, strict=True))
            polls = {
                cfg.name: PollLoop(
                    a,
                    cfg,
                    engine,
                    settings.ingest,
                    stop,
                    deadline_ms=deadline_ms,
                    tick=liveness.watch(
                        f"poll:{cfg.name}",
                        loop_bound_s(settings, max(cfg.block_ms, settings.ingest.enabled_refresh_ms) / 1000),
                    ),
                )
                for a, cfg in pairs
            }
            loops = [tg.create_task(polls[cfg.name].run(), name=f"poll:{cfg.name}") for _a, cfg in pairs]
            # Heartbeats and the like: they end on stop by themselves.
            for a, cfg in pairs:
                tg.create_task(a.run_background(stop), name=f"background:{cfg.name}")
            names = [cfg.name for cfg in settings.adapters]
            consumers = sorted({cfg.consumer for cfg in settings.adapters})
            # The slot: what a restart of this process reads again (see backhalf.heartbeats).
            detail = {"adapters": names, "consumers": consumers, "slot": heartbeats.slot(names, consumers)}
            observers = [
                tg.create_task(
                    heartbeat_loop(engine, "ingest", lambda: detail, liveness, stop, deadline_ms=deadline_ms),
                    name="heartbeat",
                )
            ]
            if settings.metrics.port:
                observers.append(tg.create_task(
                    broker_gauges_loop(
                        pairs,
                        lambda name: polls[name].enabled,
                        settings.metrics.refresh_interval_ms / 1000,
                        stop,
                    ),
                    name="broker-gauges",
                ))  # fmt: skip
            await stop.wait()
            # The observers end on stop too, within the same deadline.
            _done, running = await asyncio.wait(
                [*loops, *observers], timeout=settings.ingest.shutdown_timeout_s
            )
            if running:
                log.error("shutdown_deadline_exceeded", loops=sorted(t.get_name() for t in running))
                for task in running:
                    task.cancel()
    finally:
        for a in adapters:
            await a.close()
        await engine.dispose()
        log.info("ingester_stopped")
