"""``switchboard ack``: discharge committed ack intents to the broker.

Woken by NOTIFY (sent by the store, delivered only on commit) with a polling
fallback, so a lost notification or a dropped LISTEN connection delays acks by
at most ``poll_interval_ms``. Each drain is one transaction: claim pending
intents with ``FOR UPDATE SKIP LOCKED`` (several ackers split the work), send
one broker ack per target per batch, mark the rows acked, commit. A crash
between the broker ack and the commit leaves the rows pending; they are acked
again, which brokers treat as a no-op.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import psycopg
import structlog
from psycopg import sql as pgsql
from sqlalchemy.engine import make_url
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine

from backhalf import acks, failpoints
from backhalf.db import DatabaseSettings, create_engine
from backhalf.errors import BackhalfError
from backhalf.records import AckClaim
from backhalf.sql import ACK_CHANNEL
from ingest.adapter import Acknowledger
from ingest.config import AckerSettings, Settings
from ingest.errors import IngestError
from ingest.lifecycle import Backoff, wait_either, wait_stop
from ingest.modes import make_acknowledger

log = structlog.get_logger(__name__)

# Without a notification for this long, prove the LISTEN connection is alive.
LISTEN_PROBE_INTERVAL_S = 10.0
LISTEN_PROBE_TIMEOUT_S = 5.0


def _libpq_url(url: str) -> str:
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


async def drain_once(engine: AsyncEngine, acknowledgers: Mapping[str, Acknowledger], limit: int) -> int:
    """One claim-ack-mark transaction; return how many intents were discharged."""
    async with engine.begin() as conn:
        claims = await acks.claim(conn, list(acknowledgers), limit)
        if not claims:
            return 0
        failpoints.hit("acker_after_select")
        by_adapter: dict[str, list[AckClaim]] = {}
        for c in claims:
            by_adapter.setdefault(c.adapter, []).append(c)
        for adapter, adapter_claims in by_adapter.items():
            await acknowledgers[adapter].ack(adapter_claims)
        failpoints.hit("acker_after_xack")
        await acks.mark_acked(conn, [c.inbox_id for c in claims])
    log.info("acks_sent", acked=len(claims), adapters=sorted(by_adapter))
    return len(claims)


async def _drain_loop(
    engine: AsyncEngine,
    acknowledgers: Mapping[str, Acknowledger],
    settings: AckerSettings,
    wake: asyncio.Event,
    stop: asyncio.Event,
) -> None:
    backoff = Backoff(settings.backoff_initial_ms, settings.backoff_max_ms)
    while not stop.is_set():
        wake.clear()  # set again by any NOTIFY that arrives while we drain
        try:
            drained = await drain_once(engine, acknowledgers, settings.batch_size)
        except (IngestError, BackhalfError, SQLAlchemyError) as exc:
            delay_s = backoff.next_delay_s()
            log.warning(
                "ack_failed",
                error=exc,
                error_type=type(exc).__name__,
                attempt=backoff.attempt,
                retry_in_s=round(delay_s, 3),
            )
            await wait_stop(stop, delay_s)
            continue
        backoff.reset()
        if drained < settings.batch_size:
            await wait_either(wake, stop, settings.poll_interval_ms / 1000)


async def _listen_loop(
    database: DatabaseSettings, settings: AckerSettings, wake: asyncio.Event, stop: asyncio.Event
) -> None:
    """Turn NOTIFYs into ``wake``; reconnect with backoff; never the only path."""
    backoff = Backoff(settings.backoff_initial_ms, settings.backoff_max_ms)
    while not stop.is_set():
        try:
            async with await psycopg.AsyncConnection.connect(
                _libpq_url(database.url), autocommit=True, connect_timeout=database.connect_timeout_s
            ) as conn:
                await conn.execute(pgsql.SQL("LISTEN {}").format(pgsql.Identifier(ACK_CHANNEL)))
                log.info("listening", channel=ACK_CHANNEL)
                backoff.reset()
                wake.set()  # anything committed before LISTEN took effect
                while not stop.is_set():
                    async for _ in conn.notifies(timeout=LISTEN_PROBE_INTERVAL_S, stop_after=1):
                        wake.set()
                    async with asyncio.timeout(LISTEN_PROBE_TIMEOUT_S):
                        await conn.execute("SELECT 1")
        except (psycopg.Error, TimeoutError, OSError) as exc:
            delay_s = backoff.next_delay_s()
            log.warning("listen_failed", error=exc, attempt=backoff.attempt, retry_in_s=round(delay_s, 3))
            wake.set()  # notifications may have been lost: poll now
            await wait_stop(stop, delay_s)


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
                _drain_loop(engine, acknowledgers, settings.acker, wake, stop), name="drain"
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
