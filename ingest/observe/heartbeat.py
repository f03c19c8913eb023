"""What the long-running asyncio processes (``ingest``, ``ack``) run beside
their work so that operators can see them: the heartbeat row in
``processes``, the ``[metrics]`` endpoint, and the backlog gauges.

Each is a task of the process's TaskGroup that ends on stop by itself; the
endpoint's thread is stopped and joined when :func:`serving` exits.
"""

from __future__ import annotations

import asyncio
import os
import socket
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import structlog
from prometheus_client import Gauge
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine

from backhalf import metrics as m
from backhalf.db import within_deadline
from backhalf.errors import DeadlineExceeded
from backhalf.housekeeping import heartbeats
from backhalf.reads import backlog
from ingest.adapters.base import PullAdapter
from ingest.config import AdapterConfig, Settings
from ingest.config.transport import Figure
from ingest.config.transports import definitions
from ingest.errors import BrokerError, log_failure
from ingest.lifecycle import wait_stop
from ingest.observe.metrics_http import Liveness, MetricsServer

log = structlog.get_logger(__name__)

# The last beat's statement, on a graceful stop, gets this long: within the
# process's shutdown deadline, and long enough for a connection's set-up
# (TLS, a busy server): a deadline that expires in a new connection's
# set-up can leave that connection to the garbage collector.
STOPPED_MARK_TIMEOUT_MS = 5_000


def new_liveness() -> Liveness:
    # The database is healthy while heartbeats answer: three missed is not.
    return Liveness(database_stale_s=heartbeats.HEARTBEAT_TTL_S)


def loop_bound_s(settings: Settings, own_interval_s: float = 0.0) -> float:
    """How long a loop may go without a tick before /healthz says it is
    stuck: a whole transaction deadline, the longest backoff, its own
    sleep, and a margin of a heartbeat TTL."""
    longest_backoff_s = max(settings.ingest.backoff_max_ms, settings.acker.backoff_max_ms) / 1000
    return (
        settings.database.transaction_deadline_ms / 1000
        + longest_backoff_s
        + own_interval_s
        + heartbeats.HEARTBEAT_TTL_S
    )


@contextmanager
def serving(settings: Settings, liveness: Liveness) -> Iterator[MetricsServer | None]:
    """The endpoint while the body runs, if ``[metrics] port`` is not 0. A
    port that cannot be bound is a ConfigError: raised before any work."""
    if not settings.metrics.port:
        yield None
        return
    server = MetricsServer(settings.metrics.address, settings.metrics.port, liveness.report)
    m.switch_on()
    try:
        yield server
    finally:
        server.close()


async def heartbeat_loop(
    engine: AsyncEngine,
    role: str,
    detail: Callable[[], Mapping[str, Any]],
    liveness: Liveness,
    stop: asyncio.Event,
    *,
    deadline_ms: int,
    interval_s: float = heartbeats.HEARTBEAT_INTERVAL_S,
) -> None:
    """Beat every ``interval_s`` until stop, then mark the row stopped.
    A failed beat is logged and retried at the next turn: the heartbeat
    never ends the process, and /healthz says the database is not answering.
    ``detail`` is read at every beat (the acker's adapters grow), with the
    process's own verdict added as ``healthy``: a process whose loop hangs
    still beats, and ``status`` must not call it alive."""
    instance = uuid.uuid4()
    host = socket.gethostname()
    pid = os.getpid()
    tick = liveness.watch("heartbeat", interval_s + deadline_ms / 1000 + heartbeats.HEARTBEAT_TTL_S)
    bound = log.bind(role=role, instance=str(instance))
    beaten = False
    while not stop.is_set():
        # Judged by its loops only: the database half of /healthz is this very
        # beat. A server it needs that keeps failing is named (status shows it).
        failing = liveness.failing()
        described = {**detail(), "healthy": not liveness.loops_stuck()}
        if failing:
            described["failing"] = failing
        try:
            async with within_deadline(engine.begin(), deadline_ms, "writing the heartbeat") as conn:
                await conn.execute(heartbeats.beat_statement(instance, role, host, pid, described))
                if not beaten:
                    await conn.execute(heartbeats.forget_statement())
        except (SQLAlchemyError, DeadlineExceeded) as exc:
            liveness.database_failed(type(exc).__name__)
            if m.on():
                m.ERRORS.labels(role, "database", m.error_class(exc)).inc()
            log_failure(bound, "heartbeat_failed", exc)
        else:
            if not beaten:
                bound.info("heartbeat_started", host=host, pid=pid)
            beaten = True
            liveness.database_answered()
        tick()
        await wait_stop(stop, interval_s)
    if beaten:
        try:
            async with within_deadline(engine.begin(), STOPPED_MARK_TIMEOUT_MS, "marking stopped") as conn:
                await conn.execute(heartbeats.stopped_statement(instance))
        except (SQLAlchemyError, DeadlineExceeded) as exc:
            # Its row goes stale instead, and status calls it dead: a stop
            # that could not tell the database looks like a crash.
            log_failure(bound, "heartbeat_stop_not_recorded", exc)


async def broker_gauges_loop(
    pairs: Sequence[tuple[PullAdapter, AdapterConfig]],
    enabled: Callable[[str], bool | None],
    interval_s: float,
    stop: asyncio.Event,
) -> None:
    """The ingester's view of each broker: stream lag and PEL, list lengths,
    and each adapter's flag, every ``interval_s``."""
    while not stop.is_set():
        for adapter, cfg in pairs:
            flag = enabled(cfg.name)
            if flag is not None:
                m.ADAPTER_ENABLED.labels(cfg.name).set(1 if flag else 0)
            try:
                described = await asyncio.wait_for(adapter.describe(), timeout=interval_s + 5.0)
            except Exception as exc:
                # A broker's error (BrokerError, a timeout) as expected; any
                # other is a bug of a transport's describe, logged as such.
                m.ERRORS.labels("ingest", "broker", m.error_class(exc)).inc()  # only run when on
                if isinstance(exc, BrokerError | TimeoutError):
                    log_failure(log, "broker_gauges_failed", exc, adapter=cfg.name)
                else:
                    log.exception("broker_gauges_crashed", adapter=cfg.name, error=exc)
                continue
            _set_broker_gauges(cfg.name, cfg.transport, described)
        await wait_stop(stop, interval_s)


# Each neutral figure's gauge.
_GAUGES: Mapping[Figure, Gauge] = {
    "held": m.SOURCE_HELD,
    "backlog": m.SOURCE_BACKLOG,
    "in_flight": m.SOURCE_IN_FLIGHT,
    "in_flight_limit": m.IN_FLIGHT_LIMIT,
    "list_backlog": m.LIST_BACKLOG,
    "processing": m.PROCESSING,
    "dead_lettered": m.DEAD_LETTERED,
}


def _set_broker_gauges(adapter: str, transport: str, described: Mapping[str, Any]) -> None:
    """The adapter's figures, as its transport maps them onto the neutral ones."""
    definition = definitions().get(transport)
    if definition is None:
        return
    for figure, value in definition.figures(described).items():
        _GAUGES[figure].labels(adapter).set(value)


async def database_gauges_loop(
    engine: AsyncEngine, adapters: Callable[[], Sequence[str]], interval_s: float, stop: asyncio.Event,
    *, deadline_ms: int, own_acked: Sequence[str] = (),
) -> None:  # fmt: skip
    """The acker's view of the database's backlog, every ``interval_s``.
    An adapter with nothing owed reports 0, not its last figure."""
    while not stop.is_set():
        try:
            async with within_deadline(engine.connect(), deadline_ms, "reading the backlog") as conn:
                acks = await backlog.ack_backlog(conn, own_acked)
                active = await backlog.active_todos(conn)
        except (SQLAlchemyError, DeadlineExceeded) as exc:
            m.ERRORS.labels("ack", "database", m.error_class(exc)).inc()
            log_failure(log, "database_gauges_failed", exc)
        else:
            for name in {*adapters(), *own_acked, *acks}:
                owed = acks.get(name)
                m.PENDING_ACKS.labels(name).set(owed.pending if owed else 0)
                m.OLDEST_UNACKED.labels(name).set(owed.oldest_age_s if owed else 0.0)
            for (queue, status), n in active.items():
                m.TODOS.labels(queue, status).set(n)
            for queue, status in _seen_todo_labels() - set(active):
                m.TODOS.labels(queue, status).set(0)
        await wait_stop(stop, interval_s)


def _seen_todo_labels() -> set[tuple[str, str]]:
    """The (queue, status) pairs the gauge has reported: one that emptied
    must read 0, not the figure it had."""
    seen: set[tuple[str, str]] = set()
    for metric in m.TODOS.collect():
        for sample in metric.samples:
            seen.add((sample.labels["queue"], sample.labels["status"]))
    return seen
