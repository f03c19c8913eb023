"""The poll loop of one adapter: read a batch, store it in one transaction, repeat.

It never talks to the broker's ack API (the acker does, for committed rows
only), so whatever happens here the worst outcome is a redelivery; the one
exception is a transport whose acks are bound to the receiving channel,
which this loop acks through its adapter strictly after the commit
(``_ack_own``), and then marks. Broker and
database errors are logged, backed off and retried; the loop ends only when
``stop`` is set. On stop it abandons a read in progress (those entries stay
pending at the broker) but lets a store already under way commit or fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import structlog
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from backhalf import failpoints, metrics, tracing
from backhalf.db import DEFAULT_TRANSACTION_DEADLINE_MS, within_deadline
from backhalf.db_errors import is_transient
from backhalf.errors import AckStateError, DeadlineExceeded, StoreError
from backhalf.records import InboxRecord, PendingIntent, StoreBatch, StoreResult
from backhalf.writes import acks, body_schema, registry
from backhalf.writes import attempts as delivery_attempts
from backhalf.writes.normalize import content_size
from backhalf.writes.store import store
from ingest.adapters.base import (
    Delivery,
    OpenLedger,
    PendingCopies,
    PullAdapter,
    pull_provenance,
)
from ingest.adapters.factory import messaging_system
from ingest.config import AdapterConfig, IngestSettings
from ingest.errors import EXPECTED_FAILURES, BrokerError, error_kind
from ingest.lifecycle import Retry, cancel_and_wait, wait_stop
from ingest.observe.dependency import Dependency
from ingest.processes.intake import LOST_REASON, to_record
from ingest.processes.pull.commits import Commits

log = structlog.get_logger(__name__)

READ_CANCEL_TIMEOUT_S = 5.0
REDELIVERY = 2  # a delivery count from which a message is a redelivery
# The first redelivery is usually an ordinary crash or restart: batched as
# usual. From the second on, the message is a suspect and is stored alone.
# (The broker's count alone cannot name the culprit: a re-read batch raises
# the count of every message in it. Lone attempts, counted in PostgreSQL, can.)
ISOLATE_AFTER = 3
NORMALIZE_SLICE = 100
# Own acks whose marks failed, kept to mark with the next batch's; past this
# many the oldest are left to the settling at the next channel's start.
MAX_UNMARKED = 100_000


def delivery_size(delivery: Delivery) -> int:
    """A message's bytes as read."""
    return 0 if delivery.body is None else content_size(delivery.body)


def ledger_for(
    engine: AsyncEngine, adapter: str, deadline_ms: int = DEFAULT_TRANSACTION_DEADLINE_MS
) -> OpenLedger:
    """Transactions for an adapter's recovery: the row locks taken on pending
    ack intents hold until the ``async with`` ends."""

    @contextlib.asynccontextmanager
    async def open_ledger() -> AsyncIterator[PendingCopies]:
        async with within_deadline(engine.begin(), deadline_ms, f"adapter {adapter}: recovery") as conn:

            async def pending_copies(ack_key: str) -> Sequence[PendingIntent]:
                return await acks.lock_pending_copies(conn, adapter, ack_key)

            yield pending_copies

    return open_ledger


@dataclass(frozen=True, slots=True)
class Fetched:
    """A batch as read, and normalized for the store."""

    deliveries: list[Delivery]
    records: list[InboxRecord]
    size: int  # the messages' bytes as read, held until the batch's commit ends


class PollLoop:
    def __init__(
        self,
        adapter: PullAdapter,
        config: AdapterConfig,
        engine: AsyncEngine,
        settings: IngestSettings,
        stop: asyncio.Event,
        *,
        deadline_ms: int = DEFAULT_TRANSACTION_DEADLINE_MS,
        tick: Callable[[], None] = lambda: None,
        broker_health: Dependency | None = None,
    ) -> None:
        self._adapter = adapter
        self._tick = tick  # /healthz: the loop turns
        # /healthz, the heartbeat and status: the broker answering or not.
        self._broker_health = broker_health
        self._cfg = config
        self._engine = engine
        self._deadline_ms = deadline_ms
        self._settings = settings
        self._stop = stop
        self._enabled = True
        self._enabled_checked_at = float("-inf")
        self._paused = False  # disabled, and the adapter told so (pause)
        self._open_ledger = ledger_for(engine, config.name, deadline_ms)
        self._prefetch: asyncio.Task[Fetched] | None = None
        # The last store found messages already stored: the next one asks
        # before writing (StoreBatch.check_stored).
        self._found_stored = False
        # Lone attempts that failed for a transient reason: still open, their
        # count is reused by the next attempt (see _store_alone).
        self._open_attempts = delivery_attempts.OpenAttempts()
        # Bytes of the batches taken and not yet committed (max_inflight_bytes).
        self._held = 0
        self._validator: ThreadPoolExecutor | None = None  # schema validation's thread
        self._log = log.bind(
            adapter=config.name, mode=config.mode, source=config.source, consumer=config.consumer
        )
        self._commits = Commits(self._log)
        # Refs of deliveries this process acked itself whose marks have not
        # committed yet (a consumer-acked transport: see _ack_own).
        self._unmarked: list[str] = []
        self._system: str | None = None  # the ingest span's messaging.system

    async def run(self) -> None:
        try:
            await self._run()
        except asyncio.CancelledError:
            await self._cancel_in_flight()
            raise
        finally:
            await self._close_validator()

    async def _close_validator(self) -> None:
        """Join the validation thread (its checks were abandoned, so it ends at
        their next keyword): no thread outlives the loop."""
        if self._validator is not None:
            pool, self._validator = self._validator, None
            await asyncio.get_running_loop().run_in_executor(None, pool.shutdown)

    async def _cancel_in_flight(self) -> None:
        """Past the shutdown deadline: the read and the commits under way are
        cancelled too (rolled back, redelivered later) and waited for, so
        none outlives the loop."""
        if self._prefetch is not None:
            await self._abandon(self._prefetch)
            self._prefetch = None
        await self._commits.cancel(READ_CANCEL_TIMEOUT_S)

    async def _run(self) -> None:
        # Stream adapters overlap commits (``commits_in_flight``): one store
        # transaction keeps one PostgreSQL backend, one core, busy.
        depth = self._settings.commits_in_flight if self._adapter.overlapping_commits else 1
        # Every failure that reaches the retry is logged as a warning: a bug
        # was logged just before, with its traceback, as poll_step_crashed.
        retry = Retry.from_settings(self._settings, self._log, expected=(Exception,))
        self._log.info("poll_loop_started", broker=self._adapter.broker)
        while not self._stop.is_set():
            self._tick()
            try:
                await self._step(depth, retry)
            except Exception as exc:  # noqa: BLE001 - a bug must not end ingestion either; see _recover
                await self._recover(exc, retry)
        await self._wind_down()
        self._log.info("poll_loop_stopped")

    async def _step(self, depth: int, retry: Retry) -> None:
        """Take the batch read meanwhile (or read one), start reading the next
        one, start this one's commit, and return once fewer than ``depth``
        commits are under way."""
        self._commits.reap_ended()
        if self._prefetch is None:
            if not await self._is_enabled():
                if not self._paused:
                    # What committed is acked first (a consumer-acked
                    # transport's acks ride its commits), then the adapter
                    # gives back what its broker pushed ahead.
                    await self._commits.wait_all()
                    await self._adapter.pause()
                    self._paused = True
                    if self._broker_health is not None:
                        # Disabled (the remedy for a broker that is down):
                        # not read, so not failing either.
                        self._broker_health.answered()
                await wait_stop(self._stop, self._settings.enabled_refresh_ms / 1000)
                return
            self._paused = False
            count = self._read_count()
            if not count and self._commits:
                # No room for another read: wait for the oldest commit.
                await self._commits.wait_below(len(self._commits))
                return
            # (Nothing in flight leaves room for one; never a read of 0,
            # which Redis would take as "no limit".)
            self._prefetch = self._start_fetch(max(count, 1))
        if not await self._fetched_unless_stopped(self._prefetch):
            return  # stopped while a schema was still validating: _wind_down abandons it
        fetched = await self._prefetch
        self._prefetch = None
        if self._broker_health is not None:
            self._broker_health.answered()
        if not fetched.deliveries:
            retry.succeeded()
            return
        if metrics.on():  # every delivery read, whether its batch commits or not
            metrics.CONSUMED.labels(self._cfg.name).inc(len(fetched.deliveries))
        failpoints.hit("after_read")
        # The next batch is read and normalized while this one commits:
        # Python, Redis and PostgreSQL work overlap instead of taking turns.
        room = self._read_count(holding=fetched.size)
        if room and not self._stop.is_set() and await self._is_enabled():
            self._prefetch = self._start_fetch(room)
        # A batch holding a redelivery follows a crash or a stall: it is
        # committed with nothing beside it, before or after. Otherwise a
        # message that crashes the ingester would take the overlapping
        # batch down too, every time, and the lone attempts of the
        # suspects in it would be counted against them (max_deliveries
        # would reject innocents).
        alone = any(r.deliveries >= REDELIVERY for r in fetched.records)
        if alone:
            await self._commits.wait_all()
        self._held += fetched.size
        self._commits.start(lambda after: self._commit_held(fetched, after), name=f"commit:{self._cfg.name}")
        await self._commits.wait_below(1 if alone else depth)
        retry.succeeded()

    async def _recover(self, exc: Exception, retry: Retry) -> None:
        """After a failed step: drop the batch read meanwhile, wait for the
        commits under way, rewind, and back off."""
        if self._prefetch is not None:
            await self._abandon(self._prefetch)
            self._prefetch = None
        # Rewind only once no commit is under way: a batch still
        # committing would be confirmed after the rewind forgot it.
        await self._commits.settle(reported=exc)
        if not isinstance(exc, EXPECTED_FAILURES):
            self._log.exception("poll_step_crashed", error=exc, exc_info=exc)
        # Whatever was read and not stored is redelivered from the broker's
        # record of un-acked messages (from memory only for pub/sub, which
        # keeps none).
        self._adapter.rewind()
        if isinstance(exc, BrokerError) and self._broker_health is not None:
            self._broker_health.failed(exc)
        event = "broker_error" if isinstance(exc, BrokerError) else "store_failed"
        metrics.ERRORS.labels("ingest", error_kind(exc), metrics.error_class(exc)).inc()
        await retry.back_off(self._stop, event, exc, broker=self._adapter.broker)

    async def _wind_down(self) -> None:
        """On stop, commits under way finish (or fail: redelivered later).
        After a failure no rewind follows, so nothing more is stored either."""
        failed = await self._commits.settle(reported=None)
        if self._prefetch is not None:
            if failed:
                await self._abandon(self._prefetch)
            else:
                await self._finish_on_stop(self._prefetch)
            self._prefetch = None

    async def _fetched_unless_stopped(self, prefetch: asyncio.Task[Fetched]) -> bool:
        """Whether the batch is read and normalized, or stop came first. A read
        ends at stop by itself; only validation against a schema (in a worker
        thread, up to ``schema_timeout_ms`` per message) may take long enough
        to keep a stop waiting, so only then is stop watched here too."""
        if prefetch.done() or self._cfg.body_schema is None:
            return True
        stopped = asyncio.create_task(self._stop.wait(), name=f"stop-wait:{self._cfg.name}")
        try:
            await asyncio.wait({prefetch, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not await cancel_and_wait(stopped, READ_CANCEL_TIMEOUT_S):
                self._log.error("read_not_cancellable", task=stopped.get_name())
        return prefetch.done()

    def _read_count(self, holding: int = 0) -> int:
        """How many messages the next read may ask for: ``batch_size``, or as
        many as fit at ``max_message_bytes`` each in what ``max_inflight_bytes``
        leaves free beside the batches held (and ``holding`` bytes about to
        be). With nothing held there is always room for one (config checks
        that one message fits), so the loop never stalls on the bound."""
        free = self._settings.max_inflight_bytes - self._held - holding
        fits = max(free, 0) // self._cfg.max_message_bytes
        return min(self._cfg.batch_size, fits if self._held + holding else max(fits, 1))

    def _start_fetch(self, count: int) -> asyncio.Task[Fetched]:
        return asyncio.create_task(self._fetch(count), name=f"fetch:{self._cfg.name}")

    async def _abandon(self, prefetch: asyncio.Task[Fetched]) -> None:
        """Drop a prefetch: its batch is redelivered after the rewind that follows."""
        if not await cancel_and_wait(prefetch, READ_CANCEL_TIMEOUT_S):
            self._log.error("read_not_cancellable", task=prefetch.get_name())
        if not prefetch.cancelled():
            prefetch.exception()  # retrieved: its error, if any, is the rewind's business

    async def _finish_on_stop(self, prefetch: asyncio.Task[Fetched]) -> None:
        """On stop, a prefetch that already completed is stored (it may carry
        reports of deleted entries that exist nowhere else); one still
        reading is abandoned, its messages pending at the broker."""
        if not prefetch.done():
            await self._abandon(prefetch)
            return
        if prefetch.cancelled() or prefetch.exception() is not None or not prefetch.result().deliveries:
            return
        try:
            await self._commit(prefetch.result())
        except EXPECTED_FAILURES as exc:
            self._log.warning("final_store_failed", error=exc, error_type=type(exc).__name__)

    async def _fetch(self, count: int) -> Fetched:
        deliveries = await self._adapter.recover(self._open_ledger)
        if not deliveries:
            deliveries = await self._read_unless_stopped(count)
        records = await self._normalize(deliveries)
        return Fetched(deliveries, records, sum(map(delivery_size, deliveries)))

    async def _normalize(self, deliveries: list[Delivery]) -> list[InboxRecord]:
        if self._cfg.body_schema is not None:
            return await self._normalize_off_the_loop(deliveries)
        records = []
        for start in range(0, len(deliveries), NORMALIZE_SLICE):
            records += [to_record(d, self._cfg) for d in deliveries[start : start + NORMALIZE_SLICE]]
            # Yield between slices: the store of the previous batch waits on
            # its statements' replies in this same event loop.
            await asyncio.sleep(0)
        return records

    async def _normalize_off_the_loop(self, deliveries: list[Delivery]) -> list[InboxRecord]:
        """A schema's cost is the producer's to choose: validation runs in a
        worker thread, so heartbeats, commits and stop signals are served
        meanwhile (the interpreter switches threads every few ms), each
        message within the adapter's ``schema_timeout_ms`` (an overrun is
        that message's rejection). A read abandoned (on stop, or after a
        failure) ends the thread's checks at their next keyword, so neither
        the thread nor the process's exit waits for the message under way."""
        abandon = body_schema.Abandon()

        def normalize_all() -> list[InboxRecord]:
            with body_schema.abandonable(abandon):
                records = []
                for d in deliveries:
                    if abandon.ended:
                        return []  # nobody waits for these any more
                    records.append(to_record(d, self._cfg))
                return records

        try:
            if self._validator is None:
                # Its own thread, not the loop's default pool, which also
                # resolves host names for reconnects.
                self._validator = ThreadPoolExecutor(1, thread_name_prefix=f"validate:{self._cfg.name}")
            return await asyncio.get_running_loop().run_in_executor(self._validator, normalize_all)
        finally:
            abandon.end()

    async def _commit_held(self, fetched: Fetched, after: asyncio.Task[None] | None) -> None:
        """``_commit``; the batch's bytes stop counting as held once it has
        ended, committed, failed or cancelled."""
        try:
            await self._commit(fetched, after)
        finally:
            self._held -= fetched.size

    async def _commit(self, fetched: Fetched, after: asyncio.Task[None] | None = None) -> None:
        """Store a batch; confirm it to the adapter once ``after`` (the commit
        of the batch before it, which may still be running) has been: batches
        are confirmed in the order they were read, and a failure of the one
        before fails this one too, so the rewind that follows covers both."""
        deliveries = fetched.deliveries
        started = time.perf_counter()
        batched, suspects = await self._split_suspects(fetched.records, deliveries)
        results = [await self._store(chunk) for chunk in (self._chunks(batched) if batched else [])]
        # Suspects go one by one, each lone attempt counted and committed first:
        # if one of them crashes us every time, it alone is counted and, past
        # max_deliveries, rejected; the messages around it are stored.
        results += [await self._store_alone(rec) for rec in suspects]
        if after is not None:
            await after
        # Confirmed only once every chunk committed; a failure in between
        # redelivers the whole batch and the committed chunks dedup.
        self._adapter.stored()
        result = StoreResult.total(results)
        if metrics.on():
            metrics.STORE_BATCH.labels(self._cfg.name).observe(len(deliveries))
        self._log.info(
            "batch_stored",
            messages=len(deliveries),
            new=result.new,
            redelivered=result.redelivered,
            rejected=result.rejected,
            todos_created=result.todos_created,
            todos_deduped=result.todos_deduped,
            reused_ids=len(result.reused),
            first_id=deliveries[0].message_id,
            last_id=deliveries[-1].message_id,
            store_ms=round((time.perf_counter() - started) * 1000, 2),
        )
        for message_id, key in result.reused:
            # Not a redelivery: a different message on an id already stored.
            self._log.error(
                "entry_id_reused",
                message_id=message_id,
                stored_as=key,
                detail="another body is stored under this entry id (a broker restored or failed over,"
                " or explicit ids reused): stored under its own key",
            )
        for d in deliveries:
            if d.lost:
                self._log.error("lost_before_ingest", message_id=d.message_id, key=d.idempotency_key)
        await self._ack_own()

    async def _ack_own(self) -> None:
        """A consumer-acked transport: the committed batches acked on their
        own channel (only now: the commit came first), then their intents
        marked acked. The ack failing raises (the channel is gone, and with
        it every delivery it held went back to the queue: redelivered,
        deduplicated, acked then). The mark failing does not: the broker
        holds nothing any more, so the refs are kept and marked with the next
        batch's, and whatever a crash leaves unmarked is settled when the
        consumer's next channel opens (``settle_acks``). A no-op for every
        transport the acker acks for."""
        acked = await self._adapter.ack_stored()
        refs = self._unmarked + [d.ack_ref for d in acked if d.ack_ref is not None]
        if not refs:
            return
        if metrics.on() and acked:
            metrics.ACKED.labels(self._cfg.name).inc(len(acked))
        failpoints.hit("after_own_ack")
        try:
            async with self._within_deadline(self._engine.begin(), f"marking {len(refs)} acks") as conn:
                await acks.mark_own(conn, self._cfg.name, refs)
        except (SQLAlchemyError, DeadlineExceeded, AckStateError) as exc:
            self._unmarked = refs[-MAX_UNMARKED:]
            self._log.warning(
                "own_acks_unmarked", acks=len(refs), error=str(exc), error_type=type(exc).__name__
            )
            return
        self._unmarked = []

    @property
    def enabled(self) -> bool:
        """The runtime flag as last read (the metrics' adapter_enabled)."""
        return self._enabled

    def _count(self, result: StoreResult, store_s: float) -> None:
        """Counted at the commit, so a batch whose later chunk fails still
        counts the chunks that committed (their redelivery then counts as
        deduplicated, as it is)."""
        metrics.count_store(self._cfg.name, result, store_s, LOST_REASON)

    async def _split_suspects(
        self,
        records: list[InboxRecord],
        deliveries: Sequence[Delivery] = (),
    ) -> tuple[list[InboxRecord], list[InboxRecord]]:
        """Messages redelivered more than once (by the broker's count, or with
        lone attempts on record in PostgreSQL, whose count does not roll back)
        are suspects, and so are redeliveries whose count is only a lower
        bound (``deliveries`` not ``deliveries_exact``); the rest is stored
        in batches as usual. A batch with no redelivery costs one pass."""
        again = [r.idempotency_key for r in records if r.deliveries >= REDELIVERY]
        if not again:
            return records, []
        unsure = {d.idempotency_key for d in deliveries if not d.deliveries_exact}
        async with self._within_deadline(self._engine.connect(), "reading delivery attempts") as conn:
            on_record = await delivery_attempts.known(conn, self._cfg.name, again)
        batched: list[InboxRecord] = []
        suspects: list[InboxRecord] = []
        for rec in records:
            suspect = rec.error is None and (
                rec.deliveries >= ISOLATE_AFTER
                or rec.idempotency_key in on_record
                or rec.idempotency_key in unsure
            )
            # An ordered adapter's messages after a suspect go alone with it,
            # in order: stored in the batch, they would commit before it.
            if suspect or (self._adapter.ordered and suspects):
                suspects.append(rec)
            else:
                batched.append(rec)
        return batched, suspects

    async def _store_alone(self, rec: InboxRecord) -> StoreResult:
        """A suspect's lone attempt: counted and committed first, then stored.

        A store that fails for a transient reason (a lock or statement
        timeout, a lost connection, a deadline: ``db_errors.is_transient``)
        leaves its attempt open: the next lone attempt of that message in this
        process reuses the count instead of adding one, so an outage never
        turns the head of the queue into poison. Only an attempt that never
        ended (the process died in it) stays counted, which is what the count
        is for; a failure the statement raised on this message's data (say, a
        value PostgreSQL refuses) is counted too, since it recurs every time."""
        attempts = await self._count_lone_attempt(rec.idempotency_key)
        try:
            return await self._store([self._past_limit(rec, attempts)])
        except StoreError as exc:
            if is_transient(exc):
                self._open_attempts.keep(rec.idempotency_key, attempts)
            raise

    async def _count_lone_attempt(self, key: str) -> int:
        reopened = self._open_attempts.pop(key)
        if reopened is not None:
            self._log.info("lone_attempt_reopened", key=key, attempts=reopened)
            return reopened
        async with self._within_deadline(self._engine.begin(), "counting a lone attempt") as conn:
            return (await delivery_attempts.record(conn, self._cfg.name, [key]))[key]

    def _past_limit(self, rec: InboxRecord, attempts: int) -> InboxRecord:
        """The record to store: as it is, or rejected past ``max_deliveries``."""
        # Two batched deliveries came before the lone attempts began.
        delivered = ISOLATE_AFTER - 1 + attempts
        if delivered <= self._cfg.max_deliveries:
            return rec
        self._log.warning(
            "message_rejected_after_max_deliveries", key=rec.idempotency_key, deliveries=delivered
        )
        return rec._replace(
            payload=None,
            error=f"max_deliveries_exceeded: delivered {delivered} times, never stored "
            f"(limit {self._cfg.max_deliveries})",
            deliveries=max(rec.deliveries, delivered),
        )

    def _within_deadline(
        self, opening: contextlib.AbstractAsyncContextManager[AsyncConnection], what: str
    ) -> contextlib.AbstractAsyncContextManager[AsyncConnection]:
        return within_deadline(opening, self._deadline_ms, f"adapter {self._cfg.name}: {what}")

    def _chunks(self, records: list[InboxRecord]) -> list[list[InboxRecord]]:
        limit = self._settings.max_batch_bytes
        chunks: list[list[InboxRecord]] = [[]]
        size = 0
        for rec in records:
            rec_size = 3 * len(rec.body)  # the raw body, and its payload twice (event and todo)
            if chunks[-1] and size + rec_size > limit:
                chunks.append([])
                size = 0
            chunks[-1].append(rec)
            size += rec_size
        return chunks

    async def _is_enabled(self) -> bool:
        now = time.monotonic()
        if now - self._enabled_checked_at >= self._settings.enabled_refresh_ms / 1000:
            async with self._within_deadline(self._engine.connect(), "reading the enabled flag") as conn:
                enabled = await registry.is_enabled(conn, self._cfg.name)
            if enabled != self._enabled:
                self._log.info("adapter_enabled" if enabled else "adapter_disabled")
            self._enabled = enabled
            self._enabled_checked_at = now
        return self._enabled

    async def _read_unless_stopped(self, count: int) -> list[Delivery]:
        """Read a batch, or nothing if stop is requested first; a read cut
        short leaves its entries pending at the broker for redelivery. A read
        that completed is stored even if stop came meanwhile: it may carry
        reports (deleted entries) that exist nowhere else."""
        if self._stop.is_set():
            return []
        read = asyncio.create_task(self._adapter.read(count), name=f"read:{self._cfg.name}")
        # Cancelled itself (a prefetch abandoned at stop) just as the read
        # failed, this coroutine never reaches read.result(): the read's error
        # would be logged at garbage collection as never retrieved, with a
        # traceback. It is the rewind's business, as any failed read's.
        read.add_done_callback(_retrieved)
        stopped = asyncio.create_task(self._stop.wait(), name=f"stop-wait:{self._cfg.name}")
        try:
            await asyncio.wait({read, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (read, stopped):
                if not await cancel_and_wait(task, READ_CANCEL_TIMEOUT_S):
                    self._log.error("read_not_cancellable", task=task.get_name())
        if read.cancelled():
            return []
        return read.result()

    async def _store(self, records: list[InboxRecord]) -> StoreResult:
        if not tracing.on():
            return await self._store_now(records)
        with tracing.ingest_span(
            adapter=self._cfg.name,
            system=self._messaging_system(),
            destination=self._cfg.source,
            contexts=[r.trace_context for r in records],
        ):
            return await self._store_now(records)

    def _messaging_system(self) -> str:
        """The transport's messaging.system, looked up once (tracing on only)."""
        if self._system is None:
            self._system = messaging_system(self._cfg)
        return self._system

    async def _store_now(self, records: list[InboxRecord]) -> StoreResult:
        adapter = self._adapter
        batch = StoreBatch(
            adapter=self._cfg.name,
            queue=self._cfg.queue,
            consumer=self._cfg.consumer,
            ack_after=self._cfg.ack_after,
            ack=adapter.ack_target,
            provenance=pull_provenance(adapter.identity),
            records=records,
            check_stored=self._found_stored,
        )
        try:
            # The transaction boundary: inbox, events, todos and the NOTIFY
            # commit together or not at all.
            # Test hook: a crash while processing these (rejected ones are not processed).
            failpoints.hit("before_store", (r.body for r in records if r.error is None))
            what = f"storing {len(records)} messages"
            began = time.perf_counter()
            async with self._within_deadline(self._engine.begin(), what) as conn:
                result = await store(conn, batch)
                redelivered = [r.idempotency_key for r in records if r.deliveries >= REDELIVERY]
                await delivery_attempts.clear(conn, self._cfg.name, redelivered)
                failpoints.hit("before_commit")
        except (SQLAlchemyError, DeadlineExceeded) as exc:  # connect, checkout, a statement or COMMIT
            # The outcome may be unknown (a COMMIT without its reply): the
            # batch is not confirmed, so it is redelivered and deduplicated.
            raise StoreError(
                f"adapter {self._cfg.name}: transaction for {len(records)} messages failed: {exc}"
            ) from exc
        failpoints.hit("after_commit")
        self._count(result, time.perf_counter() - began)
        self._found_stored = result.redelivered > 0
        return result


def _retrieved(task: asyncio.Task[Any]) -> None:
    """Mark a finished task's error as retrieved (its owner handles it, or
    was cancelled and abandoned it)."""
    if not task.cancelled():
        task.exception()
