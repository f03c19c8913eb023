"""dramatiq's broker for Switchboard's workers: the todos table itself
(DESIGN.md section 7b; docs/decisions/0001-workers-on-postgresql.md).

There is no second copy of a todo: a worker process claims due todos
straight from ``todos`` and hands each to dramatiq's worker threads as a
message that exists only in memory. What dramatiq keeps is what it is good
at: its threads, its middleware (time limits, the user's own), its
processes and signals.

* **Wake and claim** (:class:`Claimer`, on the process's one consumer
  thread). One connection LISTENs on the store's NOTIFY and runs the claims;
  a poll every ``[worker] poll_interval_ms`` covers a lost notification and
  retries whose backoff has ended. One statement (``claim_todos``) claims
  at most what the free threads can start now, plus a prefetch only where
  runs are quick: as many todos as the threads finish within
  ``PREFETCH_WAIT_S``, so a prefetched todo waits a few milliseconds at
  most, and a process with slow handlers prefetches none (it never holds
  work its threads cannot start while another process idles). A thread
  that frees up wakes the claimer at once (a self-pipe beside the
  connection's socket). A notification is a hint anyone connected to the
  database can send (issue 43): one naming no queue this process serves
  is dropped, and the claim others cause comes no sooner than a gap after
  the last claim (:class:`~ingest.lifecycle.NotifiedLooks`), so a burst is
  one claim and a flood a few a second.
* **Leases** (:class:`LeaseKeeper`): a claim holds a short lease
  (``[worker] lease_ms``), extended every third of it for as long as the
  process holds the claim, run or waiting; a killed process's claims lapse
  and the acker's rescuer puts them back, whatever the time limit. A claim
  found lost (cancelled, or rescued after the process was cut off) is not
  run if it has not started.
* **Ends** go to the process's :class:`~backhalf.lifecycle.state_writer.StateWriter`
  (background batches); a claim is held, and its lease extended, until its
  end is committed or given up.
* **Stop**: claims dramatiq never started (its work queue, the claimer's
  own buffer) are given back, pending again and their attempt uncounted.

Every Switchboard actor is on one dramatiq queue, ``switchboard``, so one
consumer (one claim) serves all of a process's queues and its threads are
shared among them; the claim walks the queues in turn. Actors of other
dramatiq queues declared on this broker (an application's own, imported
with a handler) get a consumer that never yields a message: this broker
only carries todos, and refuses to enqueue.
"""

from __future__ import annotations

import collections
import contextlib
import os
import select
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from queue import Empty, Queue
from typing import Any

import dramatiq
import psycopg
import structlog
from dramatiq.broker import Consumer, MessageProxy
from dramatiq.errors import DramatiqError
from psycopg import sql as pgsql
from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError

from backhalf import metrics, queries
from backhalf.db import HeldConnection
from backhalf.lifecycle import todos
from backhalf.lifecycle.queues import ACTOR_PREFIX
from backhalf.lifecycle.state_writer import StateWriter
from ingest.lifecycle import NOTIFIED_GAP_MAX_S, NotifiedLooks

log = structlog.get_logger(__name__)

# The one dramatiq queue of every Switchboard actor.
SWITCHBOARD_QUEUE = "switchboard"
# A prefetched todo waits at most about this long for a thread: the prefetch
# is what the threads finish in that time at the runs' recent pace, so only
# quick handlers get one (docs/workers.md, "Wake and claim").
PREFETCH_WAIT_S = 0.005
# And never more than this many per thread, whatever the pace.
PREFETCH_MAX_PER_THREAD = 4
# The pace is an average that follows the last few dozen runs.
PACE_WEIGHT = 0.1
# A claim that failed on the database is tried again after these waits.
CLAIM_BACKOFF_S = (0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
GIVEN_BACK = "given back unrun: the worker stopped with it claimed"
NOT_RUN = "given back unrun: a middleware skipped its message"


class TodoMessage(MessageProxy):
    """A claimed todo as dramatiq's message: in memory only, its claim with it."""

    def __init__(self, message: dramatiq.Message[Any], claim: todos.Claimed, owner: Claimer) -> None:
        super().__init__(message)
        self.claim = claim
        self.owner = owner  # the claimer that made it, which counts it in flight
        self.began = 0.0  # monotonic: when a worker thread took it
        self.ran = False  # whether its actor took the claim


class Leases:
    """The claims this process holds, from their claim until their end is
    settled (or they are given back): the lease keeper extends them all."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[tuple[int, Any], todos.Claimed] = {}
        self._lost: set[tuple[int, Any]] = set()

    def hold(self, claims: Iterable[todos.Claimed]) -> None:
        with self._lock:
            for c in claims:
                self._held[(c.todo.id, c.token)] = c

    def release(self, claim: todos.Claimed) -> None:
        with self._lock:
            key = (claim.todo.id, claim.token)
            self._held.pop(key, None)
            self._lost.discard(key)

    def held(self) -> list[todos.Claimed]:
        with self._lock:
            return list(self._held.values())

    def lose(self, claim: todos.Claimed) -> bool:
        """Mark a claim the database says is no longer this run's; False if
        it is not held any more (its own end came first: nothing lost)."""
        with self._lock:
            key = (claim.todo.id, claim.token)
            if key not in self._held:
                return False
            self._lost.add(key)
            return True

    def lost(self, claim: todos.Claimed) -> bool:
        with self._lock:
            return (claim.todo.id, claim.token) in self._lost


class LeaseKeeper:
    """Extends the leases of every claim the process holds, every third of
    the lease, one statement a beat, on a connection of its own: never
    behind an end batch the database is slow to answer (a lease lapsing
    under a live run would let the rescuer run it twice at once)."""

    def __init__(self, leases: Leases, engine: Engine, lease_s: float) -> None:
        self._leases, self._lease_s = leases, lease_s
        # Its own: each beat one statement, bounded by the engine's timeouts.
        self._conn = HeldConnection(engine, "lease keeper", todos.by_id_session)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="switchboard-leases", daemon=True)
        self._thread.start()

    def beat(self) -> None:
        held = self._leases.held()
        if not held:
            return
        try:
            answers = todos.extend_leases(self._conn.get(), held, self._lease_s)
        except (psycopg.Error, SQLAlchemyError):
            self._conn.discard()
            raise
        for claim in held:
            extended = answers.get((claim.todo.id, claim.token), False)
            # An end committed since the snapshot released its claim first:
            # nothing lost (a background end is settled in the writer's
            # thread, a failed run's and a give-back let go before writing).
            if extended is False and self._leases.lose(claim):
                log.warning("todo_claim_lost", todo_id=claim.todo.id, queue=claim.todo.queue,
                            reason="cancelled or rescued while this worker held it")  # fmt: skip

    def _run(self) -> None:
        while not self._stop.wait(self._lease_s / 3):
            try:
                self.beat()
            except (psycopg.Error, SQLAlchemyError) as exc:
                # Missed beats leave a third of the lease, twice, before the
                # claims lapse: the next beat tries again, connected anew.
                log.warning("todo_leases_not_extended", error=f"{type(exc).__name__}: {exc}")
            except Exception as exc:  # the keeper must outlive a bug: claims would lapse under live runs
                log.exception("todo_lease_keeper_failed", error=f"{type(exc).__name__}: {exc}")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self._lease_s)
        if not self._thread.is_alive():
            self._conn.discard()


class Claimer:
    """Claims due todos for one worker process and hands them to dramatiq
    as messages; told by the worker threads when one is done with."""

    def __init__(
        self,
        engine: Engine,
        writer: StateWriter,
        leases: Leases,
        queues: Sequence[str],
        *,
        threads: int,
        lease_s: float,
        poll_interval_s: float,
    ) -> None:
        self._writer, self._leases = writer, leases
        self._order = collections.deque(queues)
        self._threads, self._lease_s, self._poll_s = threads, lease_s, poll_interval_s
        self._lock = threading.Lock()
        self._in_flight = 0  # claimed and not yet done with (run, skipped or given back)
        self._running = 0  # of those, taken by a thread
        self._sleeping = False  # the consumer waits: a thread freed must wake it
        # The recent runs' average length, per queue: a queue's prefetch
        # follows its own pace, so a slow queue never rides on a quick one's.
        self._pace_s: dict[str, float] = {}
        self._ready: collections.deque[TodoMessage] = collections.deque()
        # LISTEN and claims on it; its session prices sorts out and commits
        # without waiting for a flush (queries.sql, claimer_session).
        self._conn = HeldConnection(engine, "claimer", _claimer_session)
        self._wanted = True  # todos may be due: claim when threads are free
        self._next_poll = 0.0
        # A notification naming a queue served here: todos may be due once
        # the gap after the last claim has passed.
        self._served = frozenset(queues)
        self._hinted = False
        self._by_notify = False  # the wanted claim is a notification's
        self._gate = NotifiedLooks(max_s=min(NOTIFIED_GAP_MAX_S, poll_interval_s))
        self._failures = 0
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._stopping = False

    # -- the consumer thread ------------------------------------------------------

    def next_message(self, timeout_s: float) -> TodoMessage | None:
        """The next claimed todo, or None after ``timeout_s`` with none (dramatiq
        then looks whether it is stopping)."""
        if self._stopping and self._ready:
            self.release()  # claimed before the stop: given back, not started
        deadline = time.monotonic() + timeout_s
        while not self._ready:
            now = time.monotonic()
            self._due(now)
            if (limit := self._worth_claiming()) > 0:
                self._claim(limit)
                continue
            if now >= deadline:
                return None
            with self._lock:
                # Said under the lock a finishing thread takes to decide
                # whether to wake us: no wake-up is lost in between.
                self._sleeping = True
            try:
                if self._worth_claiming() == 0:
                    notified_at = self._gate.due_at() if self._hinted else deadline
                    self._wait(min(deadline, self._next_poll, notified_at) - now)
            finally:
                self._sleeping = False
        return self._ready.popleft()

    def _due(self, now: float) -> None:
        """Todos may be due: the poll's time has come, or a notification's
        gap after the last claim has passed."""
        if now >= self._next_poll:
            self._wanted, self._by_notify, self._next_poll = True, False, now + self._poll_s
        if self._hinted and now >= self._gate.due_at():
            self._by_notify = not self._wanted  # a claim wanted anyway is not the notification's
            self._wanted, self._hinted = True, False

    def _worth_claiming(self) -> int:
        """How many to claim now, 0 for none: todos may be due, and either a
        thread would idle without one or half the room is free (so that
        quick runs are claimed in batches, not one per thread freed)."""
        if not self._wanted or self._stopping:
            return 0
        with self._lock:
            return self._claimable()

    def stop_claiming(self) -> None:
        """The worker is stopping: no more claims."""
        self._stopping = True

    def _prefetch(self, queue: str) -> int:
        """(Under the lock.) What the threads finish of ``queue``'s todos within
        PREFETCH_WAIT_S at its recent pace: 0 until one of its runs is timed."""
        pace = self._pace_s.get(queue)
        if pace is None:
            return 0
        return min(
            PREFETCH_MAX_PER_THREAD * self._threads, int(self._threads * PREFETCH_WAIT_S / max(pace, 1e-6))
        )

    def _claimable(self) -> int:
        """(Under the lock.) The free room, if worth a claim now: every free
        thread plus the quickest served queue's prefetch, less what is
        claimed; claimed when no claim waits for a thread or half the room
        is free (quick runs claimed in batches, not one per thread freed)."""
        room = self._threads + max((self._prefetch(q) for q in self._order), default=0)
        free = room - self._in_flight
        waiting = self._in_flight - self._running
        return free if free > 0 and (waiting <= 0 or 2 * free >= room) else 0

    def _limits(self) -> list[int]:
        """Per queue, in the claim's order, what it may add: the free threads
        and that queue's own prefetch."""
        with self._lock:
            return [max(0, self._threads + self._prefetch(q) - self._in_flight) for q in self._order]

    def _claim(self, limit: int) -> None:
        self._order.rotate(-1)  # each claim starts at the next queue: none starves another
        by_notify, self._by_notify = self._by_notify, False
        try:
            pg = self._conn.get()
            claimed = todos.claim(pg, list(self._order), limit, self._lease_s, per_queue=self._limits())
        except (psycopg.Error, SQLAlchemyError) as exc:
            self._gate.looked(time.monotonic(), notified=by_notify, found=False)
            self._failed(exc)
            return
        self._gate.looked(time.monotonic(), notified=by_notify, found=bool(claimed))
        if self._failures:
            log.info("todo_claims_resumed", after_failures=self._failures)
            self._failures = 0
        # A full claim may have left more due; a short one took what was.
        self._wanted = len(claimed) >= limit
        if not claimed:
            return
        messages = [
            TodoMessage(
                dramatiq.Message(
                    queue_name=SWITCHBOARD_QUEUE,
                    actor_name=ACTOR_PREFIX + claim.todo.queue,
                    args=(claim.todo.id,),
                    kwargs={},
                    options={},
                ),
                claim,
                self,
            )
            for claim in claimed
        ]
        self._leases.hold(claimed)
        with self._lock:
            self._in_flight += len(claimed)
        self._ready.extend(messages)
        if metrics.on():
            for claim in claimed:
                metrics.CLAIMED.labels(claim.todo.queue).inc()

    def _failed(self, exc: BaseException) -> None:
        """The database refused or dropped a claim: the connection is
        replaced, and the next claim waits a little longer each time."""
        self._conn.discard()
        delay_s = CLAIM_BACKOFF_S[min(self._failures, len(CLAIM_BACKOFF_S) - 1)]
        self._failures += 1
        log.warning("todo_claim_failed", error=f"{type(exc).__name__}: {exc}", retry_in_s=delay_s,
                    failures=self._failures)  # fmt: skip
        # No claim until the next poll: the wait until then is the backoff.
        self._wanted, self._hinted, self._next_poll = False, False, time.monotonic() + delay_s

    def _wait(self, timeout_s: float) -> None:
        """Until a notification, a thread freed, or ``timeout_s``."""
        pg = self._pg()
        if pg is not None and self._notified(pg):
            return
        # A failed read discarded the connection (its fileno() would raise,
        # ending dramatiq's consumer): then the wake-up pipe alone, until
        # the next claim connects again.
        pg = self._pg()
        pg_fd = pg.fileno() if pg is not None else None
        poller = select.poll()  # not select(): no limit on the descriptors' numbers
        poller.register(self._wake_r, select.POLLIN)
        if pg_fd is not None:
            poller.register(pg_fd, select.POLLIN)
        ready = {fd for fd, _ in poller.poll(max(0, int(timeout_s * 1000)))}
        if self._wake_r in ready:
            with contextlib.suppress(BlockingIOError):
                while os.read(self._wake_r, 4096):
                    pass
        if pg is not None and pg_fd in ready:
            self._notified(pg)

    def _notified(self, pg: psycopg.Connection[Any]) -> bool:
        """Whether a notification naming a queue served here arrived (read
        without waiting): todos may be due, from the gap's end on. The
        others (another process's queues, anyone's text) are read and dropped."""
        try:
            got = sum(1 for n in pg.notifies(timeout=0) if n.payload in self._served)
        except psycopg.Error as exc:
            self._failed(exc)
            return False
        self._hinted |= got > 0
        return got > 0

    def _pg(self) -> psycopg.Connection[Any] | None:
        return self._conn.current()

    # -- the worker threads -------------------------------------------------------

    def began(self, message: TodoMessage) -> None:
        """A thread took a claimed message: the room a claim is worth may
        open now (the last waiting claim taken)."""
        message.began = time.monotonic()
        with self._lock:
            self._running += 1
            wake = self._sleeping and self._wanted and self._claimable() > 0
        if wake:
            self._wake()

    def _wake(self) -> None:
        # A full pipe: the claimer has wake-ups waiting already.
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"\0")

    def done_with(self, message: TodoMessage) -> None:
        """A message dramatiq is done with (acked or rejected): its thread is
        free. A claim its actor never took (a middleware skipped the
        message) is given back."""
        try:
            if not message.ran:
                # Not due again at once: a middleware that skips it would
                # otherwise have it claimed and skipped in a loop.
                self.give_back([message], NOT_RUN, delay_s=self._poll_s)
        finally:
            took_s = time.monotonic() - message.began if message.began else None
            queue = message.claim.todo.queue
            with self._lock:
                self._in_flight -= 1
                if message.began:
                    self._running -= 1
                if took_s is not None and message.ran:
                    pace = self._pace_s.get(queue)
                    self._pace_s[queue] = took_s if pace is None else pace + PACE_WEIGHT * (took_s - pace)
                wake = self._sleeping and self._wanted and self._claimable() > 0
            if wake:
                self._wake()

    def give_back(
        self, messages: Sequence[TodoMessage], detail: str = GIVEN_BACK, *, delay_s: float = 0.0
    ) -> None:
        """Claims never started: pending again (due after ``delay_s``), attempt
        uncounted, committed on return; or, not written, left to lapse into
        the rescuer's hands. Released from the lease keeper first: a beat
        between the commit and the release would call them lost."""
        claims = [m.claim for m in messages]
        if not claims:
            return
        for claim in claims:
            self._leases.release(claim)
        endings = [todos.Ending(c, "pending", None, detail, unrun=True, delay_s=delay_s) for c in claims]
        try:
            answers: list[bool | BaseException] = self._writer.end_all(endings)
        except Exception as exc:  # noqa: BLE001 - whatever kept them from being written: they lapse
            answers = [exc] * len(claims)
        for claim, answer in zip(claims, answers, strict=True):
            if isinstance(answer, BaseException):
                log.warning("todo_not_given_back", todo_id=claim.todo.id, error=str(answer),
                            detail="its lease lapses and the rescuer puts it back")  # fmt: skip
        log.info("todo_claims_given_back", todos=len(claims), detail=detail)

    # -- stop ------------------------------------------------------------------------

    def requeue(self, messages: Iterable[MessageProxy]) -> None:
        """dramatiq's work queue at stop: its messages never ran."""
        mine = [m for m in messages if isinstance(m, TodoMessage)]
        for owner in {m.owner for m in mine}:
            owner.untrack(sum(1 for m in mine if m.owner is owner))
        self.give_back(mine)

    def untrack(self, count: int) -> None:
        """``count`` of this claimer's messages will never reach a thread."""
        with self._lock:
            self._in_flight -= count

    def drain(self, work_queue: Queue[Any]) -> None:
        """SIGTERM: the claims waiting in dramatiq's work queue for a thread
        are given back now, not when the last running handler ends (dramatiq
        requeues its work queue only then). A thread takes an item or this
        does, never both."""
        mine: list[TodoMessage] = []
        others = []
        while True:
            try:
                item = work_queue.get_nowait()
            except Empty:
                break
            work_queue.task_done()
            if isinstance(item.message, TodoMessage):
                mine.append(item.message)
            else:
                others.append(item)
        for item in others:  # not ours (another queue's): back for dramatiq
            work_queue.put(item)
        self.requeue(mine)

    def release(self) -> None:
        """Give back what was claimed and not handed out, and drop the
        connection: dramatiq's consumer closing (at stop, or restarted after
        an error, when the same claimer serves its next consumer)."""
        ready, self._ready = list(self._ready), collections.deque()
        self.untrack(len(ready))
        self.give_back(ready)
        self._conn.discard()


def _claimer_session(pg: psycopg.Connection[Any]) -> None:
    todos.by_id_session(pg)
    pg.execute(queries.CLAIMER_SESSION)  # the claim walks ix_todos_claimable (queries.sql says why)
    pg.execute(pgsql.SQL("LISTEN {}").format(pgsql.Identifier(queries.TODO_CHANNEL)))
    log.info("listening", channel=queries.TODO_CHANNEL)


class TodoConsumer(Consumer):
    """dramatiq's consumer of the ``switchboard`` queue: the claimer's messages."""

    def __init__(self, claimer: Claimer, timeout_ms: int) -> None:
        self._claimer, self._timeout_s = claimer, timeout_ms / 1000

    def __next__(self) -> MessageProxy | None:
        return self._claimer.next_message(self._timeout_s)

    def ack(self, message: MessageProxy) -> None:
        if isinstance(message, TodoMessage):
            # Its own claimer's: a consumer restarted after an error has a new one.
            message.owner.done_with(message)

    def nack(self, message: MessageProxy) -> None:
        self.ack(message)  # the todo's state is its end's, written by the run

    def requeue(self, messages: Iterable[MessageProxy]) -> None:
        self._claimer.requeue(messages)

    def close(self) -> None:
        self._claimer.release()


class _IdleConsumer(Consumer):
    """A consumer of a queue this broker carries nothing on."""

    def __init__(self, timeout_ms: int) -> None:
        self._timeout_s = timeout_ms / 1000

    def __next__(self) -> MessageProxy | None:
        time.sleep(self._timeout_s)
        return None

    def ack(self, message: MessageProxy) -> None:
        pass

    def nack(self, message: MessageProxy) -> None:
        pass

    def requeue(self, messages: Iterable[MessageProxy]) -> None:
        pass


class NotAQueue(DramatiqError):
    """Todos are made by Switchboard's store, never sent through dramatiq."""

    def __init__(self, message: str) -> None:
        super().__init__(message)  # type: ignore[no-untyped-call]


class TodoBroker(dramatiq.Broker):
    """dramatiq's broker over ``todos``: consumes only (one claimer per
    process, made by the first :meth:`consume`)."""

    def __init__(
        self, make_claimer: Callable[[], Claimer], middleware: list[dramatiq.Middleware] | None = None
    ) -> None:
        super().__init__(middleware=middleware)
        self._make_claimer = make_claimer
        self.claimer: Claimer | None = None
        self.queues: dict[str, None] = {}

    def consume(self, queue_name: str, prefetch: int = 1, timeout: int = 30000) -> Consumer:
        if queue_name != SWITCHBOARD_QUEUE:
            return _IdleConsumer(timeout)
        if self.claimer is None:
            # One per process: a consumer dramatiq restarts after an error
            # gets the same one, its counts of what is in flight whole.
            self.claimer = self._make_claimer()
        return TodoConsumer(self.claimer, timeout)

    def declare_queue(self, queue_name: str) -> None:
        if queue_name in self.queues:
            return
        self.emit_before("declare_queue", queue_name)
        self.queues[queue_name] = None
        self.emit_after("declare_queue", queue_name)

    def enqueue(self, message: dramatiq.Message[Any], *, delay: int | None = None) -> dramatiq.Message[Any]:
        raise NotAQueue(
            f"cannot send {message.actor_name!r}: Switchboard's workers take their todos from PostgreSQL;"
            " todos are made by `switchboard ingest` and `receive`, retried by `switchboard todos retry`"
        )

    def flush(self, queue_name: str) -> None:
        """Nothing to drop: the todos are the database's."""

    def flush_all(self) -> None:
        """Nothing to drop: the todos are the database's."""

    def join(self, queue_name: str, *, timeout: int | None = None) -> None:
        raise NotAQueue("join: wait for the todos in PostgreSQL instead")

    def close(self) -> None:
        if self.claimer is not None:
            self.claimer.release()
