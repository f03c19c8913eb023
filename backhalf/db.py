"""The database engine: SQLAlchemy's async engine over psycopg 3, with every
wait bounded (pool checkout, connect, statement, lock, dead peer)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Any, cast

import psycopg
import structlog
from sqlalchemy import Engine, PoolProxiedConnection, event
from sqlalchemy import create_engine as sa_create_engine
from sqlalchemy.engine import make_url
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from backhalf.errors import BackhalfError, DeadlineExceeded

DEFAULT_TRANSACTION_DEADLINE_MS = 30_000

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class DatabaseSettings:
    url: str
    statement_timeout_ms: int = 10_000
    lock_timeout_ms: int = 5_000
    connect_timeout_s: int = 10
    pool_checkout_timeout_s: float = 10.0
    pool_size: int = 4
    # A peer that vanished without a reset (blackhole) is noticed by TCP within
    # this bound instead of hanging a commit forever.
    tcp_user_timeout_ms: int = 30_000
    # The client-side bound on a whole transaction, checkout to COMMIT reply.
    # TCP timeouts cannot see a peer that still ACKs but never answers (a
    # proxy or load balancer whose backend vanished); this can.
    transaction_deadline_ms: int = DEFAULT_TRANSACTION_DEADLINE_MS


# Connections opened past ``pool_size`` when every pooled one is checked out.
MAX_OVERFLOW = 2


def normalize_url(url: str) -> str:
    """Accept ``postgresql://`` and ``postgres://`` and pin the psycopg 3 driver."""
    parsed = make_url(url)
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed.render_as_string(hide_password=False)


def libpq_url(url: str) -> str:
    """The libpq form of a SQLAlchemy URL (``postgresql+psycopg://`` ->
    ``postgresql://``), password kept: for psycopg connections of our own."""
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def redact_url(url: str) -> str:
    return make_url(url).render_as_string(hide_password=True)


def _connect_args(settings: DatabaseSettings, application_name: str) -> dict[str, Any]:
    # jit=off: Switchboard's statements are short, and a packaged PostgreSQL
    # (JIT on, as most distributions build it) compiled the store's 2,000-row
    # batch for 1.3 s, its planner misled by CTE estimates into costs past
    # jit_above_cost (docs/decisions/0002-jit-off-for-switchboard-sessions.md).
    options = (
        f"-c statement_timeout={int(settings.statement_timeout_ms)}"
        f" -c lock_timeout={int(settings.lock_timeout_ms)}"
        " -c idle_in_transaction_session_timeout=60000"
        " -c jit=off"
    )
    return {
        "connect_timeout": settings.connect_timeout_s,
        "options": options,
        "application_name": application_name,
        "keepalives": 1,
        "keepalives_idle": 10,
        "keepalives_interval": 5,
        "keepalives_count": 3,
        "tcp_user_timeout": settings.tcp_user_timeout_ms,
    }


def create_engine(settings: DatabaseSettings) -> AsyncEngine:
    engine = create_async_engine(
        normalize_url(settings.url),
        pool_size=settings.pool_size,
        max_overflow=MAX_OVERFLOW,
        pool_timeout=settings.pool_checkout_timeout_s,
        pool_pre_ping=True,
        connect_args=_connect_args(settings, "switchboard"),
    )
    event.listen(engine.sync_engine, "connect", _pin_synchronous_commit)
    return engine


def create_sync_engine(settings: DatabaseSettings, pool_size: int) -> Engine:
    """The same connections, for code that runs in threads (dramatiq's worker
    threads): one pooled connection per thread, every wait bounded alike."""
    engine = sa_create_engine(
        normalize_url(settings.url),
        pool_size=pool_size,
        max_overflow=MAX_OVERFLOW,
        pool_timeout=settings.pool_checkout_timeout_s,
        pool_pre_ping=True,
        connect_args=_connect_args(settings, "switchboard-worker"),
    )
    event.listen(engine, "connect", _pin_synchronous_commit)
    return engine


# Store-then-ack: the acker acks a message once it sees its todo committed, so
# that commit must survive a server crash. ``off`` and ``local`` do not
# guarantee it (``off`` acknowledges before the WAL flush; ``local`` ignores
# synchronous standbys); ``on``, ``remote_write`` and ``remote_apply`` do, the
# latter two with their replication meaning kept.
_WEAK_SYNCHRONOUS_COMMIT = ("off", "local")
# One statement, run once per new connection (never per transaction): raise a
# weak setting to ``on`` and report what the session had.
_PIN_SYNCHRONOUS_COMMIT = (
    "SELECT current_setting('synchronous_commit'),"
    " CASE WHEN current_setting('synchronous_commit') IN ('off', 'local')"
    " THEN set_config('synchronous_commit', 'on', false) END"
)
_weakened_default_logged = False


def _pin_synchronous_commit(dbapi_connection: Any, _record: Any) -> None:
    """Pool ``connect`` handler: ``synchronous_commit`` is at least ``on`` for
    the session. Runs in SQLAlchemy's greenlet, where the async adapter's
    cursor is driven synchronously. The SET is committed, so the pool's
    reset-on-return rollback cannot undo it."""
    global _weakened_default_logged
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute(_PIN_SYNCHRONOUS_COMMIT)
        row = cursor.fetchone()
    finally:
        cursor.close()
    dbapi_connection.commit()
    configured = row[0] if row else None
    if configured in _WEAK_SYNCHRONOUS_COMMIT and not _weakened_default_logged:
        _weakened_default_logged = True
        log.info(
            "synchronous_commit_pinned",
            configured=configured,
            pinned="on",
            reason="store-then-ack needs each commit durable before its entry is acknowledged",
        )


@contextmanager
def wrap_driver_errors(error: type[BackhalfError], what: str) -> Iterator[None]:
    """The database boundary: a driver error (psycopg, SQLAlchemy) raised in
    the block becomes ``error("<what>: <type>: <message>")``, the original
    kept as its ``__cause__``, so callers handle one type and log context."""
    try:
        yield
    except (psycopg.Error, SQLAlchemyError) as exc:
        raise error(f"{what}: {type(exc).__name__}: {exc}") from exc


async def driver_connection(conn: AsyncConnection) -> psycopg.AsyncConnection[Any]:
    """The psycopg connection under a SQLAlchemy connection, in its transaction."""
    raw = await conn.get_raw_connection()
    return cast("psycopg.AsyncConnection[Any]", raw.driver_connection)


@asynccontextmanager
async def database_deadline(deadline_ms: int, what: str) -> AsyncIterator[None]:
    """The block bounded by a client-side deadline for its database work
    (one or several transactions); past it, ``DeadlineExceeded`` naming
    ``what``. A timeout of something else inside the block is re-raised."""
    deadline = asyncio.timeout(deadline_ms / 1000)
    try:
        async with deadline:
            yield
    except TimeoutError as exc:
        if not deadline.expired():
            raise
        raise DeadlineExceeded(f"{what}: no reply from the database within {deadline_ms} ms") from exc


@asynccontextmanager
async def within_deadline(
    opening: AbstractAsyncContextManager[AsyncConnection], deadline_ms: int, what: str
) -> AsyncIterator[AsyncConnection]:
    """``engine.begin()`` or ``engine.connect()`` bounded by a client-side
    deadline. On expiry psycopg cancels the statement in flight, or closes the
    connection when the cancel gets no answer (at most 10 s more), and the
    pool discards it; the caller gets ``DeadlineExceeded``. A COMMIT cut off
    this way may have committed: callers treat the outcome as unknown (the
    ingester does not confirm the batch; redelivery dedups it)."""
    async with database_deadline(deadline_ms, what), opening as conn:
        yield conn


class HeldConnection:
    """One connection of ``engine`` taken out of its pool for good, in
    autocommit (each statement its own transaction, no checkout, ping and
    reset per use), made on first use by ``setup`` and discarded (invalidated)
    after a failure, to be made anew at the next: what a worker's claimer,
    lease keeper and state writer hold. ``name`` names it in the log."""

    def __init__(
        self, engine: Engine, name: str, setup: Callable[[psycopg.Connection[Any]], None] = lambda pg: None
    ) -> None:
        self._engine, self._name, self._setup = engine, name, setup
        self._raw: PoolProxiedConnection | None = None
        # The driver's connection, once set up: one attribute, so another
        # thread (the state writer's watchdog) reads it whole or not at all.
        self._pg: psycopg.Connection[Any] | None = None

    def current(self) -> psycopg.Connection[Any] | None:
        """The connection held now, None if there is none."""
        return self._pg

    def get(self) -> psycopg.Connection[Any]:
        """The connection, made (and set up) if none is held."""
        if self._pg is not None:
            return self._pg
        self._raw = self._engine.raw_connection()
        pg = self._raw.driver_connection
        assert isinstance(pg, psycopg.Connection)
        try:
            pg.autocommit = True
            self._setup(pg)
        except BaseException:
            self.discard()
            raise
        self._pg = pg
        return pg

    def discard(self) -> None:
        self._pg = None
        raw, self._raw = self._raw, None
        if raw is not None:
            try:
                raw.invalidate()
            except (psycopg.Error, SQLAlchemyError) as exc:
                log.warning(
                    "connection_discarded", connection=self._name, error=f"{type(exc).__name__}: {exc}"
                )
