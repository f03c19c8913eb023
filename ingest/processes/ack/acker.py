"""``switchboard ack``: discharge committed ack intents to the broker.

Woken by NOTIFY (sent by the store, delivered only on commit) with a polling
fallback, so a lost notification or a dropped LISTEN connection delays acks by
at most ``poll_interval_ms``. Any login connected to the database can NOTIFY
too, so a notification is a hint (:class:`Hints`): one naming no adapter
acked here is dropped, and the others make at most one look at the adapters
they name, no sooner than a gap after the last look (issue 43). Each drain is one transaction per adapter:
claim the stream acks owed through the adapter's cursor (one acker at a time
holds it) and the queued intents, marking the queued ones acked in the same
statement (``FOR UPDATE SKIP LOCKED``: several ackers split the work), send
one broker ack per target per batch, mark the cursor's rows and move it,
commit. A crash or a broker error before the commit leaves the rows
pending; they are acked again, which brokers treat as a no-op.

Which adapters: the config's; with none in the config (no config file), every
adapter in the ``adapters`` table, its broker the default one
(``Settings.default_broker_url``), the table read again every ``REGISTRY_REFRESH_S`` so an
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
from collections.abc import Awaitable, Callable, Container, Mapping, MutableMapping, Sequence
from typing import Any

import psycopg
import structlog
from psycopg import sql as pgsql
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine

from backhalf import db_errors, failpoints
from backhalf import metrics as m
from backhalf.db import DEFAULT_TRANSACTION_DEADLINE_MS, DatabaseSettings, libpq_url, within_deadline
from backhalf.errors import DeadlineExceeded
from backhalf.housekeeping import heartbeats
from backhalf.lifecycle.rescue import Rescuer
from backhalf.queries import ACK_CHANNEL
from backhalf.records import AckClaim
from backhalf.writes import acks, registry
from backhalf.writes.registry import AdapterRow
from ingest.adapters import registered
from ingest.adapters.base import FAMILY, Acknowledger
from ingest.adapters.factory import acked_by, make_acknowledger
from ingest.config import AckerSettings, Settings
from ingest.errors import AcksRefused, AcksRolledBack, ConfigError, error_kind, log_failure
from ingest.lifecycle import NOTIFIED_GAP_MAX_S, NotifiedLooks, Retry, wait_either, wait_stop
from ingest.observe.dependency import Dependency
from ingest.observe.heartbeat import database_gauges_loop
from ingest.processes.ack.partitions import partitioned, upkeep_loop
from ingest.processes.ack.prune import prune_loop, walks
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
        failpoints.hit("acker_after_ack")
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
        raise AcksRolledBack(
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


class Hints:
    """What notifications asked the drain loop for since it last took them:
    the adapters they named, each checked against those acked here
    (``known``), or every adapter after the LISTEN connection was (re)made
    (notifications may have been lost). A payload is anyone's text (any
    login connected to the database may NOTIFY on the channel): a name not
    acked here is dropped at once and wakes nothing, and a known one is only
    a hint of where to look (issue 43)."""

    def __init__(self, known: Container[str]) -> None:
        self._known = known
        self._named: set[str] = set()
        self._everything = False

    def note(self, payload: str) -> bool:
        """Keep ``payload`` if it names an adapter acked here; whether it did."""
        if payload not in self._known:
            return False
        self._named.add(payload)
        return True

    def everything(self) -> None:
        self._everything = True

    def take(self) -> frozenset[str] | None:
        """The adapters named since the last take, forgotten now (None: every adapter)."""
        named, everything = frozenset(self._named), self._everything
        self._named.clear()
        self._everything = False
        return None if everything or not named else named


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
    hints: Hints | None = None,
    broker_health: Callable[[str], Dependency] | None = None,
) -> None:
    """Drain every adapter until stop. ``refresh``, if given, runs every
    ``refresh_interval_s`` and may add acknowledgers to ``acknowledgers``.
    ``wake`` is set by notifications: a look they cause drains only the
    adapters ``hints`` holds (every one without hints), and comes no sooner
    than the gap of :class:`~ingest.lifecycle.NotifiedLooks` after the last
    look; the poll, the held acks' look again, a backoff's end and a full
    drain's next look drain every adapter, at once."""
    drains = _Drains(engine, acknowledgers, settings, deadline_ms, stop, refresh, refresh_interval_s)
    drains.broker_health = broker_health
    cause = "timer"
    while not stop.is_set():
        tick()
        await drains.refresh_due()
        wake.clear()  # set again by any NOTIFY that arrives while we drain
        named = hints.take() if hints is not None else None
        only = named if cause == "notify" else None
        more_waiting, drained_any = await drains.look(only)
        drains.gate.looked(drains.now(), notified=cause == "notify", found=drained_any)
        if more_waiting:
            cause = "more"  # a full batch: look again at once
            continue
        cause = await _next_look(wake, stop, drains.now, drains.timer_at(), drains.gate.due_at())


class _Drains:
    """The drain loop's state between looks: per adapter its backoff and
    whether acks are held back; when the next timed look is due."""

    def __init__(
        self,
        engine: AsyncEngine,
        acknowledgers: Mapping[str, Acknowledger],
        settings: AckerSettings,
        deadline_ms: int,
        stop: asyncio.Event,
        refresh: Callable[[], Awaitable[object]] | None,
        refresh_interval_s: float,
    ) -> None:
        self._engine, self._acknowledgers, self._settings = engine, acknowledgers, settings
        self._deadline_ms, self._stop = deadline_ms, stop
        self._refresh, self._refresh_interval_s = refresh, refresh_interval_s
        self.now = asyncio.get_running_loop().time
        self._poll_s = settings.poll_interval_ms / 1000
        self.gate = NotifiedLooks(max_s=min(NOTIFIED_GAP_MAX_S, self._poll_s))
        self._held_wait_s = HELD_RETRY_S
        self._held: set[str] = set()
        self._retries: dict[str, Retry] = {}
        self._retry_at: dict[str, float] = {}
        self._next_refresh = self.now() + refresh_interval_s
        # Each adapter's broker, for /healthz, the heartbeat and status.
        self.broker_health: Callable[[str], Dependency] | None = None
        self._health: dict[str, Dependency] = {}

    async def refresh_due(self) -> None:
        if self._refresh is None or self.now() < self._next_refresh:
            return
        self._next_refresh = self.now() + self._refresh_interval_s
        try:
            await self._refresh()
        except Exception as exc:  # noqa: BLE001 - the acknowledgers we have go on; next time
            log_failure(log, "adapters_refresh_failed", exc, retry_in_s=self._refresh_interval_s)

    async def look(self, only: frozenset[str] | None) -> tuple[bool, bool]:
        """One drain of each adapter (of ``only``, if given) not backing off;
        whether one was full (more waiting), and whether any drained."""
        more_waiting = drained_any = False
        for adapter, acknowledger in list(self._acknowledgers.items()):
            if only is not None and adapter not in only:
                continue
            if self.now() < self._retry_at.get(adapter, 0.0) or self._stop.is_set():
                continue
            drained = await self._drain_one(adapter, acknowledger)
            more_waiting |= drained >= self._settings.batch_size
            drained_any |= drained > 0
        # Acks the cursor could not take yet (a transaction below a committed
        # store's was still running) are looked for again soon: usually that
        # transaction ends within milliseconds, and no NOTIFY says when. The
        # wait doubles while looks find nothing (a long transaction costs one
        # empty claim per poll interval) and starts over after one that did.
        if self._held and not drained_any:
            self._held_wait_s = min(self._held_wait_s * 2, self._poll_s)
        else:
            self._held_wait_s = HELD_RETRY_S
        return more_waiting, drained_any

    async def _drain_one(self, adapter: str, acknowledger: Acknowledger) -> int:
        try:
            drained, held = await _drain(
                self._engine, adapter, acknowledger, self._settings.batch_size, self._deadline_ms
            )
        except Exception as exc:  # noqa: BLE001 - broker, database or a bug: log, back off, go on
            m.ERRORS.labels("ack", error_kind(exc), m.error_class(exc)).inc()
            if (health := self._health_of(adapter)) is not None and error_kind(exc) == "broker":
                # Acks refused one by one: the broker answered.
                if isinstance(exc, AcksRefused | AcksRolledBack):
                    health.answered()
                else:
                    health.failed(exc)
            acked = _acked_anyway(adapter, exc)
            if acked is None:
                retry = self._retries.setdefault(adapter, Retry.from_settings(self._settings, log))
                self._retry_at[adapter] = self.now() + retry.failed("ack_failed", exc, adapter=adapter)
                self._held.discard(adapter)  # its backoff's end is its next look
                return 0
            drained, held = acked, False
        if adapter in self._retries:
            self._retries[adapter].succeeded()
        if (health := self._health_of(adapter)) is not None:
            # A drain that ended well: the broker took its acks, or none was
            # owed (or another acker holds the cursor): nothing is failing.
            health.answered()
        if held:
            self._held.add(adapter)
        else:
            self._held.discard(adapter)
        return drained

    def _health_of(self, adapter: str) -> Dependency | None:
        """How ``adapter``'s broker is reported (None: not at all)."""
        if self.broker_health is None:
            return None
        if adapter not in self._health:
            self._health[adapter] = self.broker_health(f"broker of adapter {adapter} (its acks)")
        return self._health[adapter]

    def timer_at(self) -> float:
        """When the next timed look is due: the poll, held acks' look again,
        the next backoff's end, the adapters table's next read."""
        now = self.now()
        held = bool(self._held.intersection(self._acknowledgers))
        due = [now + (min(self._poll_s, self._held_wait_s) if held else self._poll_s)]
        due += [t for t in self._retry_at.values() if t > now]
        if self._refresh is not None:
            due.append(max(now, self._next_refresh))
        return min(due)


async def _next_look(
    wake: asyncio.Event, stop: asyncio.Event, now: Callable[[], float], timer_at: float, notify_at: float
) -> str:
    """Wait for the next look and say what caused it: ``timer`` once
    ``timer_at`` comes; ``notify`` once a notification has come and
    ``notify_at`` has passed (a burst is one look; earlier ones wait out
    the gap); ``stop``."""
    while not stop.is_set():
        at = now()
        if at >= timer_at:
            return "timer"
        if wake.is_set():
            if at >= notify_at:
                return "notify"
            await wait_stop(stop, min(timer_at, notify_at) - at)
        else:
            await wait_either(wake, stop, timer_at - at)
    return "stop"


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
    database: DatabaseSettings,
    settings: AckerSettings,
    wake: asyncio.Event,
    hints: Hints,
    stop: asyncio.Event,
) -> None:
    """Turn NOTIFYs that name an adapter acked here into ``hints`` and
    ``wake`` (the ack drain's); reconnect with backoff; never the only path.
    A notification costs a set lookup here and at most a share of one look
    (``drain_loop``): never a statement of its own. The connection is
    probed once per ``LISTEN_PROBE_INTERVAL_S`` however many arrive."""
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
                _everything(wake, hints)  # anything committed before LISTEN took effect
                while not stop.is_set():
                    # Every notification of the interval, then one probe.
                    async for notify in conn.notifies(timeout=LISTEN_PROBE_INTERVAL_S):
                        if hints.note(notify.payload):
                            wake.set()
                    async with asyncio.timeout(LISTEN_PROBE_TIMEOUT_S):
                        await conn.execute("SELECT 1")
        except Exception as exc:  # noqa: BLE001 - LISTEN is an optimisation; polling goes on
            _everything(wake, hints)  # notifications may have been lost: look now
            await retry.back_off(stop, "listen_failed", exc)


def _everything(wake: asyncio.Event, hints: Hints) -> None:
    hints.everything()
    wake.set()


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
    broker at ``settings.default_broker_url``."""
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
        # backhalf.housekeeping.heartbeats); the adapters acked can grow (the table).
        self._served_queues = sorted(settings.queues)
        self._slot = heartbeats.slot([cfg.name for cfg in settings.adapters], self._served_queues)

    async def start(self, process: Process) -> bool:
        rows = await registered_at_start(self._engine, self._settings, process.stop)
        if rows is None:
            return False
        if not self._settings.adapters:
            table = RegisteredAcknowledgers(self._acknowledgers, self._settings.default_broker_url)
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
        wake, hints = asyncio.Event(), Hints(self._acknowledgers)
        listener = process.beside(
            _listen_loop(settings.database, settings.acker, wake, hints, stop), "listen"
        )
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
            hints=hints,
            broker_health=process.dependency,
        )
        process.work(drain, "drain")
        if settings.acker.prune_interval_ms > 0 and walks(settings):
            # Retention: bounded batches on a connection of its own.
            process.work(prune_loop(self._engine, settings, stop), "prune")
        if settings.acker.prune_interval_ms > 0 and partitioned(settings):
            # The history's partitions: ahead, a new period, the old ones dropped.
            process.work(upkeep_loop(self._engine, settings, stop), "partitions")
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
