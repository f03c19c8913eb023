"""Group commit for pushed deliveries: each request hands its one record
here and waits for the commit that holds it.

A few committers (``COMMITTERS``) each take what is waiting, up to
``MAX_BATCH`` records, and store it in one transaction, one ``store`` call
per (adapter, provenance), as a poll loop stores a batch. Nothing waits on
purpose: under light load a record commits alone at once; under heavy load
the records that arrive while the committers are busy share the next
commit, so a delivery costs a share of a transaction instead of a whole one.
A failed transaction fails every request in it (503: their senders retry,
the keys dedup); one record's poison is its own (stored as rejected).

Where the sender signs its delivery id (``id_names_message``), a stored id
met with another body is the same delivery resent, a duplicate. Where it
does not (GitHub), a different body under a stored id is stored as its own
message under the reused-id form of the key (``backhalf.writes.store``), so
nobody holding one signed body can make a pending delivery's id name that
body instead (issue 43), even when both are handed in together (the store
takes two bodies under one key in turn).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import defaultdict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import structlog
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from backhalf import failpoints, metrics
from backhalf.db import within_deadline
from backhalf.errors import DeadlineExceeded, StoreError
from backhalf.records import NO_ACK, AckTarget, InboxRecord, Provenance, StoreBatch, StoreResult
from backhalf.writes.store import store

log = structlog.get_logger(__name__)

# Transactions under way at once. Two: one commits while the next batch
# gathers; more only split the same deliveries into smaller transactions,
# each costing its own round trips (measured: at 500/s four committers
# carried 2.8 deliveries a transaction).
COMMITTERS = 2
MAX_BATCH = 200  # records per transaction at most
HELD_IDLE_S = 5.0
# Records waiting for a committer at most: past it a delivery is 503 at once
# (its sender retries) rather than held in memory behind a slow database.
MAX_WAITING = COMMITTERS * MAX_BATCH * 5
_NO_ACK = AckTarget(NO_ACK)


@dataclass(slots=True)
class _Waiting:
    adapter: str
    queue: str
    provenance: Provenance
    record: InboxRecord
    # The delivery id names this one message (the sender signs it): another
    # body under it is the same delivery resent. False: GitHub's.
    id_names_message: bool
    done: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    # Its request gave up (answered 503) before a committer took it: never
    # stored then, so a database that is away does not leave a backlog of
    # deliveries already answered to be committed ahead of live ones.
    abandoned: bool = False


class PushStore:
    """Stores records handed in by :meth:`store`, from :meth:`run`'s committers."""

    def __init__(self, engine: AsyncEngine, deadline_ms: int) -> None:
        self._engine = engine
        self._deadline_ms = deadline_ms
        self._waiting: asyncio.Queue[_Waiting] = asyncio.Queue(MAX_WAITING)

    async def store(
        self,
        adapter: str,
        queue: str,
        provenance: Provenance,
        record: InboxRecord,
        *,
        id_names_message: bool = True,
    ) -> None:
        """Return once ``record`` is committed; raise StoreError (or
        DeadlineExceeded) if its transaction failed: the outcome may be
        unknown (a COMMIT without its reply), and the sender's retry dedups.
        With ``MAX_WAITING`` records waiting already (the database slower
        than the deliveries), StoreError at once. ``id_names_message``: the
        sender signs the delivery id (module docstring)."""
        waiting = _Waiting(adapter, queue, provenance, record, id_names_message)
        try:
            self._waiting.put_nowait(waiting)
        except asyncio.QueueFull as exc:
            raise StoreError(f"{MAX_WAITING} deliveries wait for the database already") from exc
        try:
            await asyncio.shield(waiting.done)
        except asyncio.CancelledError:
            # The request gave up (its deadline): not stored if no committer
            # took it yet; else its commit goes on without it.
            waiting.abandoned = True
            waiting.done.add_done_callback(_retrieve)
            raise

    async def run(self, stop: asyncio.Event) -> None:
        """The committers, until ``stop``; what is handed in after that
        still commits while the server drains its requests (the caller
        cancels this only once no request is left)."""
        async with asyncio.TaskGroup() as tg:
            for i in range(COMMITTERS):
                tg.create_task(self._commit_loop(), name=f"push-commit:{i}")

    async def _commit_loop(self) -> None:
        held = _HeldConnection(self._engine)
        try:
            while True:
                taken = [await self._waiting.get()]
                while len(taken) < MAX_BATCH and not self._waiting.empty():
                    taken.append(self._waiting.get_nowait())
                live = [w for w in taken if not w.abandoned]
                for w in taken:
                    if w.abandoned:
                        _settle(w.done, StoreError("its request gave up before the commit"))
                if live:
                    await self._commit(held, live)
        finally:
            await held.drop()

    async def _commit(self, held: _HeldConnection, taken: list[_Waiting]) -> None:
        groups: dict[_Group, list[_Waiting]] = defaultdict(list)
        for w in taken:
            groups[w.adapter, w.queue, w.provenance, w.id_names_message].append(w)
        began = time.perf_counter()
        results: list[tuple[str, StoreResult]] = []
        try:
            what = f"storing {len(taken)} webhook deliveries"
            async with within_deadline(held.begin(), self._deadline_ms, what) as conn:
                # One order for every transaction: two committers holding
                # duplicates of two adapters lock them alike, not crosswise.
                for (adapter, queue, provenance, names), ws in sorted(groups.items(), key=_group_order):
                    # Two bodies under one key share no statement: the store
                    # takes them in turn, so the second meets the first's row.
                    batch = StoreBatch(
                        adapter=adapter,
                        queue=queue,
                        consumer=None,
                        ack_after="store",
                        ack=_NO_ACK,
                        provenance=provenance,
                        records=[w.record for w in ws],
                        id_names_message=names,
                    )
                    results.append((adapter, await store(conn, batch)))
                failpoints.hit("receiver_before_commit")
        except (StoreError, DeadlineExceeded) as exc:
            _fail(taken, exc)
            await held.drop()
            return
        except SQLAlchemyError as exc:  # connect, checkout, or the COMMIT itself
            _fail(taken, StoreError(f"storing {len(taken)} webhook deliveries failed: {exc}"))
            await held.drop()
            return
        except Exception as exc:  # a bug fails these requests (503), never the receiver
            log.exception("push_commit_crashed", deliveries=len(taken), error=exc)
            _fail(taken, StoreError(f"storing {len(taken)} webhook deliveries failed: {type(exc).__name__}"))
            await held.drop()
            return
        except BaseException:  # cancelled: the receiver is stopping
            _fail(taken, StoreError("the receiver stopped before the commit"))
            raise
        for w in taken:
            _settle(w.done, None)
        failpoints.hit("receiver_after_commit")  # committed, the requests not yet answered
        store_s = time.perf_counter() - began
        for adapter, result in results:
            metrics.count_store(adapter, result, store_s, lost_reason="")
            for delivery_id, key in result.reused:
                # A signed body under a delivery id that holds another: a
                # capture sent again, or the genuine delivery after one.
                log.warning(
                    "delivery_id_reused",
                    adapter=adapter,
                    delivery_id=delivery_id,
                    key=key,
                    detail="another body is stored under this unsigned id: stored as its own message",
                )


class _HeldConnection:
    """A committer's own connection, kept between its transactions: a
    pool checkout and its ping per delivery batch cost more than the batch's
    own statements (docs/performance.md, "Webhook receiver"). Idle past
    ``HELD_IDLE_S`` it is given back and the next batch checks one out (so
    pinged) again; after any failure it is discarded, never reused."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine
        self._conn: AsyncConnection | None = None
        self._used_at = 0.0

    @contextlib.asynccontextmanager
    async def begin(self) -> AsyncIterator[AsyncConnection]:
        if self._conn is not None and time.monotonic() - self._used_at > HELD_IDLE_S:
            conn, self._conn = self._conn, None
            await conn.close()  # back to the pool, idle: its next checkout pings it
        if self._conn is None:
            self._conn = await self._engine.connect()
        async with self._conn.begin():
            yield self._conn
        self._used_at = time.monotonic()

    async def drop(self) -> None:
        """Discard the connection (its state is unknown after a failure):
        closed without a word to the server, which may not answer."""
        conn, self._conn = self._conn, None
        if conn is not None:
            await conn.invalidate()
            await conn.close()


# (adapter, queue, provenance, id_names_message): one store call's batch.
_Group = tuple[str, str, Provenance, bool]


def _group_order(item: tuple[_Group, list[_Waiting]]) -> tuple[str, str, str, bool]:
    (adapter, queue, provenance, names), _ = item
    return adapter, queue, provenance.verify_detail or "", names


def _fail(taken: list[_Waiting], error: Exception) -> None:
    for w in taken:
        _settle(w.done, error)


def _settle(done: asyncio.Future[None], error: BaseException | None) -> None:
    if done.done():
        return
    if error is None:
        done.set_result(None)
    else:
        done.set_exception(error)


def _retrieve(done: asyncio.Future[None]) -> None:
    with contextlib.suppress(BaseException):
        done.exception()
