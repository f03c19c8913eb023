"""``switchboard ack``: discharge committed ack intents to the broker.

Woken by NOTIFY (sent by the store, delivered only on commit) with a polling
fallback, so a lost notification or a dropped LISTEN connection delays acks by
at most ``poll_interval_ms``. Each drain is one transaction per adapter:
claim pending intents and mark them acked in one statement (``FOR UPDATE SKIP
LOCKED``: several ackers split the work), send one broker ack per target per
batch, commit. A crash or a broker error before the commit leaves the rows
pending; they are acked again, which brokers treat as a no-op.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import psycopg
import structlog
from psycopg import sql as pgsql
from sqlalchemy.ext.asyncio import AsyncEngine

from backhalf import acks, failpoints
from backhalf.db import (
    DEFAULT_TRANSACTION_DEADLINE_MS,
    DatabaseSettings,
    create_engine,
    libpq_url,
    within_deadline,
)
from backhalf.queries import ACK_CHANNEL
from ingest.adapters.base import Acknowledger
from ingest.adapters.factory import make_acknowledger
from ingest.config import AckerSettings, Settings
from ingest.lifecycle import Backoff, Retry, wait_either

log = structlog.get_logger(__name__)

# Without a notification for this long, prove the LISTEN connection is alive.
LISTEN_PROBE_INTERVAL_S = 10.0
LISTEN_PROBE_TIMEOUT_S = 5.0


async def drain_adapter(
    engine: AsyncEngine,
    adapter: str,
    acknowledger: Acknowledger,
    limit: int,
    deadline_ms: int = DEFAULT_TRANSACTION_DEADLINE_MS,
) -> int:
    """One claim-ack-mark transaction for one adapter; return how many intents
    were discharged. Per adapter, so one broker being down stalls no other.
    Past the deadline the marks are lost with the connection and the rows
    stay pending: they are acked again, a no-op at the broker."""
    async with within_deadline(engine.begin(), deadline_ms, f"adapter {adapter}: ack drain") as conn:
        claims = await acks.claim(conn, [adapter], limit)
        if not claims:
            return 0
        failpoints.hit("acker_after_select")
        await acknowledger.ack(claims)
        failpoints.hit("acker_after_xack")
    await acknowledger.acked(claims)
    log.info("acks_sent", adapter=adapter, acked=len(claims))
    return len(claims)


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
) -> None:
    loop = asyncio.get_running_loop()
    retries = {
        name: Retry(Backoff(settings.backoff_initial_ms, settings.backoff_max_ms), log)
        for name in acknowledgers
    }
    retry_at = dict.fromkeys(acknowledgers, 0.0)
    while not stop.is_set():
        wake.clear()  # set again by any NOTIFY that arrives while we drain
        more_waiting = False
        for adapter, acknowledger in acknowledgers.items():
            if loop.time() < retry_at[adapter] or stop.is_set():
                continue
            try:
                drained = await drain_adapter(engine, adapter, acknowledger, settings.batch_size, deadline_ms)
            except Exception as exc:  # noqa: BLE001 - broker, database or a bug: log, back off, go on
                retry_at[adapter] = loop.time() + retries[adapter].failed("ack_failed", exc, adapter=adapter)
                continue
            retries[adapter].succeeded()
            more_waiting |= drained >= settings.batch_size
        if not more_waiting:
            timeout_s = settings.poll_interval_ms / 1000
            upcoming = [t - loop.time() for t in retry_at.values() if t > loop.time()]
            if upcoming:
                timeout_s = min(timeout_s, *upcoming)
            await wait_either(wake, stop, timeout_s)


async def _listen_loop(
    database: DatabaseSettings, settings: AckerSettings, wake: asyncio.Event, stop: asyncio.Event
) -> None:
    """Turn NOTIFYs into ``wake``; reconnect with backoff; never the only path."""
    # LISTEN is an optimisation: whatever ends it is retried; the driver's and
    # the network's errors are warnings, anything else a bug with its traceback.
    retry = Retry(
        Backoff(settings.backoff_initial_ms, settings.backoff_max_ms),
        log,
        expected=(psycopg.Error, TimeoutError, OSError),
    )
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
                wake.set()  # anything committed before LISTEN took effect
                while not stop.is_set():
                    async for _ in conn.notifies(timeout=LISTEN_PROBE_INTERVAL_S, stop_after=1):
                        wake.set()
                    async with asyncio.timeout(LISTEN_PROBE_TIMEOUT_S):
                        await conn.execute("SELECT 1")
        except Exception as exc:  # noqa: BLE001 - LISTEN is an optimisation; polling goes on
            wake.set()  # notifications may have been lost: poll now
            await retry.back_off(stop, "listen_failed", exc)


async def _stop_listener(listener: asyncio.Task[None], stop: asyncio.Event) -> None:
    await stop.wait()
    listener.cancel()


async def run_acker(settings: Settings, stop: asyncio.Event) -> None:
    engine = create_engine(settings.database)
    acknowledgers = {cfg.name: make_acknowledger(cfg) for cfg in settings.adapters}
    wake = asyncio.Event()
    try:
        async with asyncio.TaskGroup() as tg:
            listener = tg.create_task(
                _listen_loop(settings.database, settings.acker, wake, stop), name="listen"
            )
            # The listener may sit in notifies() for up to the probe interval;
            # it holds no state worth finishing, so stop cancels it.
            tg.create_task(_stop_listener(listener, stop), name="listen-stopper")
            drain = tg.create_task(
                drain_loop(
                    engine,
                    acknowledgers,
                    settings.acker,
                    wake,
                    stop,
                    settings.database.transaction_deadline_ms,
                ),
                name="drain",
            )
            await stop.wait()
            _done, running = await asyncio.wait([drain], timeout=settings.acker.shutdown_timeout_s)
            if running:
                log.error("shutdown_deadline_exceeded", tasks=["drain"])
                drain.cancel()
    finally:
        for a in acknowledgers.values():
            await a.close()
        await engine.dispose()
        log.info("acker_stopped")
