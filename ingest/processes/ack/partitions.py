"""The history tables' partitions, kept by the acker every ``[acker]
prune_interval_ms`` where ``[acker] retain_history_days`` is set (and by
one pass of ``switchboard prune`` and ``switchboard migrate``): partitions
made ahead, a new period begun every ``partition_hours``, the partitions
past the history dropped whole (:mod:`backhalf.housekeeping.partitions` says how;
issue 45).

Making and dropping a partition is the tables' owner's to do: an acker
running as the shipped ``switchboard_acker`` role may not, says so once
(``partitions_not_ours``), and goes on beginning periods where partitions
are ready (ops/roles.sql lets it move the identities), while ``switchboard
migrate``, run as the owner daily, makes and drops them (docs/operating.md,
"History in partitions").
"""

from __future__ import annotations

import asyncio
from datetime import timedelta

import structlog
from sqlalchemy.ext.asyncio import AsyncEngine

from backhalf.db import driver_connection, wrap_driver_errors
from backhalf.errors import PruneError
from backhalf.housekeeping import partitions, retention
from ingest.config import Settings
from ingest.lifecycle import Retry, wait_stop

log = structlog.get_logger(__name__)


def _keep(settings: Settings) -> timedelta | None:
    days = settings.acker.retain_history_days
    return None if days is None else timedelta(days=days)


def done_keep(settings: Settings) -> timedelta | None:
    """How long the finished todos' partitions are kept: where the history
    is partitioned (``[acker] retain_history_days``: the deployment keeps
    partitions, and drops them as their owner), the longest of the queues'
    ``retain_done_days``, when every queue has one (a queue that keeps its
    todos for ever, one an adapter names without a ``[queues.NAME]``
    included, keeps every partition; a queue no config names any more goes
    with the partitions). A queue with a shorter one is
    pruned row by row down to it (``ingest.processes.ack.prune``), and so is
    every queue where the history is not partitioned."""
    if settings.acker.retain_history_days is None:
        return None
    # Every queue the config names, its adapters' too: one with no
    # [queues.NAME] keeps its todos for ever, as it did.
    named = {a.queue for a in settings.adapters} | {w.queue for w in settings.webhooks} | set(settings.queues)
    days = [q.retain_done_days if (q := settings.queues.get(name)) else None for name in named]
    if not days or any(d is None for d in days):
        return None
    # Never less than the row walk's floor (backhalf.housekeeping.retention.TODO_FLOOR):
    # a mis-set retention must not drop a todo the moment it finished.
    return max(timedelta(days=max(d for d in days if d is not None)), retention.TODO_FLOOR)


def partitioned(settings: Settings) -> bool:
    """Do the settings retire partitions (the history's, or finished todos')?"""
    return _keep(settings) is not None or done_keep(settings) is not None


async def upkeep_once(
    engine: AsyncEngine, settings: Settings, owed_seen: dict[tuple[str, int], float] | None = None
) -> partitions.Upkeep:
    """One pass, on a connection of its own in autocommit mode (a partition
    is detached without blocking writers only outside a transaction)."""
    with wrap_driver_errors(PruneError, "keeping the history's partitions"):
        async with engine.connect() as opened:
            conn = await opened.execution_options(isolation_level="AUTOCOMMIT")
            pg = await driver_connection(conn)
            done = await partitions.upkeep(
                pg,
                period=timedelta(hours=settings.acker.partition_hours),
                keep=_keep(settings),
                keep_done=done_keep(settings),
                owed_seen=owed_seen,
            )
    for table, numbers in done.made.items():
        log.info(
            "partitions_made", table=table, partitions=[partitions.partition_name(table, n) for n in numbers]
        )
    for table, n in done.begun.items():
        log.info("partition_begun", table=table, partition=partitions.partition_name(table, n))
    for table, numbers in done.dropped.items():
        log.info(
            "partitions_dropped",
            table=table,
            partitions=[partitions.partition_name(table, n) for n in numbers],
        )
    if done.late_deleted:
        log.info("late_todos_deleted", table=partitions.LATE_TODOS, rows=done.late_deleted)
    return done


async def upkeep_loop(engine: AsyncEngine, settings: Settings, stop: asyncio.Event) -> None:
    """The acker's task: a pass every ``prune_interval_ms``; failures
    logged, backed off and retried, never the end of the process."""
    acker = settings.acker
    retry = Retry.from_settings(acker, log)
    owed_seen: dict[tuple[str, int], float] = {}
    told = False
    while not stop.is_set():
        try:
            done = await upkeep_once(engine, settings, owed_seen)
        except Exception as exc:  # noqa: BLE001 - the database or a bug: log, back off, go on
            await retry.back_off(stop, "partitions_failed", exc)
            continue
        retry.succeeded()
        if done.refused and not told:
            told = True
            log.warning(
                "partitions_not_ours",
                tables=done.refused,
                hint="run `switchboard migrate` as the tables' owner daily: it makes the partitions ahead"
                " and drops those past retain_history_days",
            )
        await wait_stop(stop, acker.prune_interval_ms / 1000)
