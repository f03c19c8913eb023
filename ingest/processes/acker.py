"""``switchboard ack``: discharge committed ack intents to the broker.

Woken by NOTIFY (sent by the store, delivered only on commit) with a polling
fallback, so a lost notification or a dropped LISTEN connection delays acks by
at most ``poll_interval_ms``. Each drain is one transaction per adapter:
claim the stream acks owed through the adapter's cursor (one acker at a time
holds it) and the queued intents, marking the queued ones acked in the same
statement (``FOR UPDATE SKIP LOCKED``: several ackers split the work), send
one broker ack per target per batch, mark the cursor's rows and move it,
commit. A crash or a broker error before the commit leaves the rows
pending; they are acked again, which brokers treat as a no-op.

Which adapters: the config's; with none in the config (no config file), every
adapter in the ``adapters`` table, its broker the default one
(``Settings.redis_url``), the table read again every ``REGISTRY_REFRESH_S`` so an
adapter registered later (an ingester started after the acker) is acked too.
At start-up the acker reads the table either way: a permanent database error
there (schema missing, login refused, no such database) stops it with
``DatabaseUnusable``; a transient one is retried with backoff.

The process runs in the skeleton (``ingest.processes.skeleton``): the engine,
the heartbeat and gauges, the TaskGroup and the shutdown deadline are its.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping, MutableMapping, Sequence
from typing import Any

import psycopg
import structlog
from psycopg import sql as pgsql
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine

from backhalf import acks, db_errors, failpoints, heartbeats, registry
from backhalf import metrics as m
from backhalf.db import DEFAULT_TRANSACTION_DEADLINE_MS, DatabaseSettings, libpq_url, within_deadline
from backhalf.errors import DeadlineExceeded
from backhalf.queries import ACK_CHANNEL
from backhalf.records import AckClaim
from backhalf.registry import AdapterRow
from backhalf.rescue import Rescuer
from ingest.adapters import registered
from ingest.adapters.base import FAMILY, Acknowledger
from ingest.adapters.factory import acked_by, make_acknowledger
from ingest.config import AckerSettings, Settings
from ingest.errors import AckError, AcksRefused, ConfigError, error_kind, log_failure
from ingest.lifecycle import Retry, wait_either, wait_stop
from ingest.observe.heartbeat import database_gauges_loop
from ingest.processes.prune import prune_loop, walks
from ingest.processes.skeleton import Job, Process, ProcessBody, run_process

log = structlog.get_logger(__name__)

# Without a notification for this long, prove the LISTEN connection is alive.
LISTEN_PROBE_INTERVAL_S = 10.0
LISTEN_PROBE_TIMEOUT_S = 5.0
# The first look again at stream acks the cursor could not take yet; doubled
# while they stay held, up to the poll interval.
HELD_RETRY_S = 0.005
# Without adapters in the config: how often the adapters table is read again.
REGISTRY_REFRESH_S = 5.0


async def drain_adapter(
    engine: AsyncEngine,
    adapter: str,
    acknowledger: Acknowledger,
    limit: int,
    deadline_ms: int = DEFAULT_TRANSACTION_DEADLINE_MS,
) -> int:
    """One claim-ack-mark transaction for one adapter; return how many intents
    were discharged (``_drain``)."""
    drained, _held = await _drain(engine, adapter, acknowledger, limit, deadline_ms)
    return drained


async def _drain(
    engine: AsyncEngine, adapter: str, acknowledger: Acknowledger, limit: int, deadline_ms: int
) -> tuple[int, bool]:
    """One claim-ack-mark transaction for one adapter; return how many intents
    were discharged, and whether stream acks may be owed that the cursor
    could not take yet (``CursorClaim.held``). Per adapter, so one broker being down stalls no other.
    Past the deadline the marks are lost with the connection and the rows
    stay pending: they are acked again, a no-op at the broker.

    Both claims, each up to ``limit``: the cursor's first (its snapshot's
    xmin must not be held back by this transaction's own id), then the
    queue's, so neither kind can starve the other."""
    started = time.perf_counter()
    async with within_deadline(engine.begin(), deadline_ms, f"adapter {adapter}: ack drain") as conn:
        by_cursor = await acks.claim_by_cursor(conn, adapter, limit)
        claims = await acks.claim(conn, [adapter], limit, planned=True)
        if by_cursor is not None:
            claims = by_cursor.claims + claims
        held = by_cursor is not None and by_cursor.held
        if not claims:
            return 0, held  # committed: a cursor made or reset by the claim stays
        failpoints.hit("acker_after_select")
        owed = {c.inbox_id for c in await acknowledger.ack(claims)}
        failpoints.hit("acker_after_xack")
        if owed:
            by_cursor = _leave_owed(adapter, claims, by_cursor, owed)
            done = [c for c in claims if c.inbox_id not in owed]
        else:
            done = claims
        if by_cursor is not None and by_cursor.claims:
            await acks.mark_by_cursor(conn, adapter, by_cursor)
    await acknowledger.acked(done)
    if m.on():
        m.ACKED.labels(adapter).inc(len(done))
        m.ACK_SECONDS.labels(adapter).observe(time.perf_counter() - started)
        m.ACK_BATCH.labels(adapter).observe(len(done))
    log.info("acks_sent", adapter=adapter, acked=len(done))
    if owed:
        # Committed: what was acked is marked. The adapter backs off before
        # its next drain takes the refused ones again.
        raise AcksRefused(
            f"adapter {adapter}: the broker refused {len(owed)} of {len(claims)} acks one by one;"
            f" they stay owed (first: inbox row {min(owed)})",
            acked=len(done),
        )
    return len(done), held


def _leave_owed(
    adapter: str, claims: list[AckClaim], by_cursor: acks.CursorClaim | None, owed: set[int]
) -> acks.CursorClaim | None:
    """The cursor's claim with the acks the broker refused left pending. A
    refused ack claimed from the queue cannot be: the claim deleted its
    queue row and marked it acked in one statement. Then the whole drain
    rolls back and every claim is retried (acks are idempotent)."""
    cursor_ids = {c.inbox_id for c in by_cursor.claims} if by_cursor is not None else set()
    queued_ids = {c.inbox_id for c in claims[len(by_cursor.claims) if by_cursor is not None else 0 :]}
    if owed & queued_ids or not owed <= cursor_ids:
        raise AckError(
            f"adapter {adapter}: the broker refused {len(owed)} acks one by one, some claimed from the"
            " ack queue: none is marked, all are retried"
        )
    return by_cursor.leaving(owed) if by_cursor is not None else None


async def drain_once(
    engine: AsyncEngine,
    acknowledgers: Mapping[str, Acknowledger],
    limit: int,
    deadline_ms: int = DEFAULT_TRANSACTION_DEADLINE_MS,
) -> int:
    """One drain of every adapter; errors propagate (the loop handles them per adapter)."""
    total = 0
    for adapter, acknowledger in acknowledgers.items():
        total += await drain_adapter(engine, adapter, acknowledger, limit, deadline_ms)
    return total


async def drain_loop(
    engine: AsyncEngine,
    acknowledgers: Mapping[str, Acknowledger],
    settings: AckerSettings,
    wake: asyncio.Event,
    stop: asyncio.Event,
    deadline_ms: int = DEFAULT_TRANSACTION_DEADLINE_MS,
    *,
    refresh: Callable[[], Awaitable[object]] | None = None,
    refresh_interval_s: float = REGISTRY_REFRESH_S,
    tick: Callable[[], None] = lambda: None,
) -> None:
    """Drain every adapter until stop. ``refresh``, if given, runs every
    ``refresh_interval_s`` and may add acknowledgers to ``acknowledgers``."""
    loop = asyncio.get_running_loop()
    held_wait_s = HELD_RETRY_S
    retries: dict[str, Retry] = {}
    retry_at: dict[str, float] = {}
    next_refresh = loop.time() + refresh_interval_s
    while not stop.is_set():
        tick()
        if refresh is not None and loop.time() >= next_refresh:
            next_refresh = loop.time() + refresh_interval_s
            try:
                await refresh()
            except Exception as exc:  # noqa: BLE001 - the acknowledgers we have go on; next time
                log_failure(log, "adapters_refresh_failed", exc, retry_in_s=refresh_interval_s)
        wake.clear()  # set again by any NOTIFY that arrives while we drain
        more_waiting = held = drained_any = False
        for adapter, acknowledger in list(acknowledgers.items()):
            if loop.time() < retry_at.get(adapter, 0.0) or stop.is_set():
                continue
            try:
                drained, adapter_held = await _drain(
                    engine, adapter, acknowledger, settings.batch_size, deadline_ms
                )
            except Exception as exc:  # noqa: BLE001 - broker, database or a bug: log, back off, go on
                m.ERRORS.labels("ack", error_kind(exc), m.error_class(exc)).inc()
                acked = _acked_anyway(adapter, exc)
                if acked is None:
                    retry = retries.setdefault(adapter, Retry.from_settings(settings, log))
                    retry_at[adapter] = loop.time() + retry.failed("ack_failed", exc, adapter=adapter)
                    continue
                drained, adapter_held = acked, False
            if adapter in retries:
                retries[adapter].succeeded()
            more_waiting |= drained >= settings.batch_size
            held |= adapter_held
            drained_any |= drained > 0
        # Acks the cursor could not take yet (a transaction below a committed
        # store's was still running) are looked for again soon: usually that
        # transaction ends within milliseconds, and no NOTIFY says when. The
        # wait doubles while rounds find nothing (a long transaction costs one
        # empty claim per poll interval) and starts over after one that did.
        poll_s = settings.poll_interval_ms / 1000
        held_wait_s = min(held_wait_s * 2, poll_s) if held and not drained_any else HELD_RETRY_S
        if not more_waiting:
            timeout_s = min(poll_s, held_wait_s) if held else poll_s
            upcoming = [t - loop.time() for t in retry_at.values() if t > loop.time()]
            if refresh is not None:
                upcoming.append(max(0.0, next_refresh - loop.time()))
            if upcoming:
                timeout_s = min(timeout_s, *upcoming)
            await wait_either(wake, stop, timeout_s)


def _acked_anyway(adapter: str, exc: Exception) -> int | None:
    """How many acks a drain that raised still made, where the broker
    answered and refused some acks one by one (AcksRefused): the adapter is
    not backed off over those (the next drain, at the poll's pace, takes
    them again: the cursor stopped before them), so the acks stored after
    them are not held back with them. None: the broker or the database
    failed; back off."""
    if isinstance(exc, AcksRefused):
        log.warning("acks_refused", adapter=adapter, error=str(exc), acked=exc.acked)
        return exc.acked
    return None


class RegisteredAcknowledgers:
    """Acknowledgers for the adapters of the ``adapters`` table, their broker
    at one URL: added to ``into`` as they appear. A row this version cannot
    rebuild (unknown mode, ill-typed settings) is skipped with a warning, once
    per version of its settings."""

    def __init__(self, into: MutableMapping[str, Acknowledger], broker_url: str) -> None:
        self._into = into
        self._broker_url = broker_url
        self._skipped: dict[str, Mapping[str, object]] = {}

    def adopt(self, rows: Sequence[AdapterRow]) -> None:
        for row in rows:
            if row.name in self._into or self._skipped.get(row.name) == row.settings:
                continue
            if row.family != FAMILY:  # a webhook's: answered, never acked
                self._skipped[row.name] = row.settings
                continue
            try:
                config = registered.adapter_config(row, self._broker_url)
                if acked_by(config) != "acker":
                    # Its ingester acks (AMQP): nothing here to do for it.
                    self._skipped[row.name] = row.settings
                    log.info("registered_adapter_acked_by_ingester", adapter=row.name)
                    continue
                acknowledger = make_acknowledger(config)
            except ConfigError as exc:
                self._skipped[row.name] = row.settings
                log.warning("registered_adapter_skipped", adapter=row.name, error=exc)
                continue
            self._into[row.name] = acknowledger
            log.info("registered_adapter_acked", adapter=row.name, mode=row.mode)

    async def refresh(self, engine: AsyncEngine, deadline_ms: int) -> None:
        async with within_deadline(engine.connect(), deadline_ms, "reading the adapters table") as conn:
            rows = await registry.list_adapters(conn)
        self.adopt(rows)


async def registered_at_start(
    engine: AsyncEngine, settings: Settings, stop: asyncio.Event
) -> list[AdapterRow] | None:
    """The ``adapters`` table, read at start-up, retrying while the database
    is away; None if stop was requested first. A permanent error raises
    ``DatabaseUnusable``."""
    retry = Retry.from_settings(settings.acker, log)
    while not stop.is_set():
        try:
            deadline_ms = settings.database.transaction_deadline_ms
            async with within_deadline(engine.connect(), deadline_ms, "reading the adapters table") as conn:
                return await registry.list_adapters(conn)
        except (SQLAlchemyError, DeadlineExceeded) as exc:
            db_errors.raise_if_permanent(exc)
            await retry.back_off(stop, "start_failed", exc)
    return None


async def _listen_loop(
    database: DatabaseSettings, settings: AckerSettings, wakes: Sequence[asyncio.Event], stop: asyncio.Event
) -> None:
    """Turn NOTIFYs into ``wakes`` (the ack drain's); reconnect
    with backoff; never the only path."""
    # LISTEN is an optimisation: whatever ends it is retried; the driver's and
    # the network's errors are warnings, anything else a bug with its traceback.
    retry = Retry.from_settings(settings, log, expected=(psycopg.Error, TimeoutError, OSError))
    while not stop.is_set():
        try:
            async with await psycopg.AsyncConnection.connect(
                libpq_url(database.url),
                autocommit=True,
                connect_timeout=database.connect_timeout_s,
                keepalives=1,
                keepalives_idle=10,
                keepalives_interval=5,
                keepalives_count=3,
                tcp_user_timeout=database.tcp_user_timeout_ms,
                application_name="switchboard-acker-listen",
            ) as conn:
                async with asyncio.timeout(LISTEN_PROBE_TIMEOUT_S):
                    await conn.execute(pgsql.SQL("LISTEN {}").format(pgsql.Identifier(ACK_CHANNEL)))
                log.info("listening", channel=ACK_CHANNEL)
                retry.succeeded()
                _set_all(wakes)  # anything committed before LISTEN took effect
                while not stop.is_set():
                    async for _ in conn.notifies(timeout=LISTEN_PROBE_INTERVAL_S, stop_after=1):
                        _set_all(wakes)
                    async with asyncio.timeout(LISTEN_PROBE_TIMEOUT_S):
                        await conn.execute("SELECT 1")
        except Exception as exc:  # noqa: BLE001 - LISTEN is an optimisation; polling goes on
            _set_all(wakes)  # notifications may have been lost: poll now
            await retry.back_off(stop, "listen_failed", exc)


def _set_all(events: Sequence[asyncio.Event]) -> None:
    for event in events:
        event.set()


async def rescue_loop(
    step: Callable[[], Awaitable[int]],
    settings: AckerSettings,
    stop: asyncio.Event,
    *,
    tick: Callable[[], None] = lambda: None,
) -> None:
    """The rescuer (``step`` puts lapsed claims back, or fails them) until
    stop: after a short batch, wait ``rescue_interval_ms``; after a full one,
    go on at once. Failures are logged, backed off and retried, never the
    end of the loop."""
    retry = Retry.from_settings(settings, log)
    interval_s = settings.rescue_interval_ms / 1000
    while not stop.is_set():
        tick()
        try:
            moved = await step()
        except Exception as exc:  # noqa: BLE001 - the database or a bug: back off, go on
            m.ERRORS.labels("ack", error_kind(exc), m.error_class(exc)).inc()
            await retry.back_off(stop, "rescue_failed", exc)
            continue
        retry.succeeded()
        if moved < settings.batch_size:
            await wait_stop(stop, interval_s)


async def _stop_listener(listener: asyncio.Task[None], stop: asyncio.Event) -> None:
    await stop.wait()
    listener.cancel()


async def run_acker(settings: Settings, stop: asyncio.Event) -> None:
    """With no adapters in the config, those of the adapters table, their
    broker at ``settings.redis_url``."""
    await run_process(settings, stop, lambda engine: _Acker(settings, engine))


class _Acker(ProcessBody):
    """The ack drain, woken by LISTEN; beside it, with ``[queues.*]``, the
    rescuer, and with ``retain_*`` keys, the pruner."""

    role = "ack"
    stopped_event = "acker_stopped"
    overdue_field = "tasks"

    def __init__(self, settings: Settings, engine: AsyncEngine) -> None:
        self.shutdown_timeout_s = settings.acker.shutdown_timeout_s
        self._settings = settings
        self._engine = engine
        # An adapter its ingester acks (AMQP: acks are bound to the channel
        # that received the message) has no part here.
        self._acknowledgers: dict[str, Acknowledger] = {
            cfg.name: make_acknowledger(cfg) for cfg in settings.adapters if acked_by(cfg) == "acker"
        }
        self._refresh: Callable[[], Awaitable[object]] | None = None
        self._rescuer: Rescuer | None = None
        if settings.queues:
            self._rescuer = Rescuer(
                engine,
                settings.queues,
                batch_size=settings.acker.batch_size,
                deadline_ms=settings.database.transaction_deadline_ms,
            )
        # The slot: what a restart of this process serves again (see
        # backhalf.heartbeats); the adapters acked can grow (the table).
        self._served_queues = sorted(settings.queues)
        self._slot = heartbeats.slot([cfg.name for cfg in settings.adapters], self._served_queues)

    async def start(self, process: Process) -> bool:
        rows = await registered_at_start(self._engine, self._settings, process.stop)
        if rows is None:
            return False
        if not self._settings.adapters:
            table = RegisteredAcknowledgers(self._acknowledgers, self._settings.redis_url)
            table.adopt(rows)
            if not rows:
                log.warning(
                    "no_adapters_registered",
                    hint="each adapter `switchboard ingest` registers is acked"
                    f" within {REGISTRY_REFRESH_S:g} s",
                )

            def refresh_table() -> Awaitable[None]:
                return table.refresh(self._engine, process.deadline_ms)

            self._refresh = refresh_table
        return True

    def spawn(self, process: Process) -> None:
        settings, stop = self._settings, process.stop
        wake = asyncio.Event()
        listener = process.beside(_listen_loop(settings.database, settings.acker, [wake], stop), "listen")
        # The listener may sit in notifies() for up to the probe interval;
        # it holds no state worth finishing, so stop cancels it.
        process.beside(_stop_listener(listener, stop), "listen-stopper")
        poll_s = settings.acker.poll_interval_ms / 1000
        drain = drain_loop(
            self._engine,
            self._acknowledgers,
            settings.acker,
            wake,
            stop,
            process.deadline_ms,
            refresh=self._refresh,
            tick=process.watch("drain", poll_s),
        )
        process.work(drain, "drain")
        if settings.acker.prune_interval_ms > 0 and walks(settings):
            # Retention: bounded batches on a connection of its own.
            process.work(prune_loop(self._engine, settings, stop), "prune")
        if self._rescuer is not None:
            rescue_s = settings.acker.rescue_interval_ms / 1000
            rescue = rescue_loop(self._rescuer.rescue_once, settings.acker, stop,
                                 tick=process.watch("rescue", rescue_s))  # fmt: skip
            process.work(rescue, "rescue")
        else:
            # A warning: a worker killed with claims would leave them running
            # for good, with no acker to put them back.
            log.warning("rescue_off", reason="no [queues.*] in the config: lapsed claims are not looked for",
                        hint="give the acker the workers' [queues.*]")  # fmt: skip
        for cfg in settings.adapters:
            if settings.queues and cfg.queue not in settings.queues:
                log.warning(
                    "queue_not_served",
                    adapter=cfg.name,
                    queue=cfg.queue,
                    detail=f"no [queues.{cfg.queue}] in the config: its todos stay pending",
                )

    def detail(self) -> Mapping[str, Any]:
        return {"adapters": sorted(self._acknowledgers), "queues": self._served_queues, "slot": self._slot}

    def gauges(self, process: Process, interval_s: float) -> tuple[str, Job]:
        acknowledgers = self._acknowledgers
        # Adapters their ingesters ack (AMQP): their pending intents are
        # reported here too, so stuck ones are seen and alerted on.
        own_acked = [cfg.name for cfg in self._settings.adapters if acked_by(cfg) == "consumer"]
        loop = database_gauges_loop(
            self._engine,
            lambda: list(acknowledgers),
            interval_s,
            process.stop,
            deadline_ms=process.deadline_ms,
            own_acked=own_acked,
        )
        return "database-gauges", loop

    async def close(self) -> None:
        for a in self._acknowledgers.values():
            await a.close()
