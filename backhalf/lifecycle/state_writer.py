"""One writer per worker process for the ends of its runs: a group commit.

Every run of a todo ends durably (done, failed, or pending again for its
retry; a claim given back unrun).
Done one transaction per change from each worker thread, that is a commit, a
pool checkout and their round trips per todo, several times dramatiq's own
cost per message (docs/architecture.md, "The workers' group commit").

Here each worker thread hands its run's end to the process's writer and
goes on to its next todo (:meth:`StateWriter.finish`: settled later, in the
writer's thread, by a callback), or waits for it (:meth:`StateWriter.end`);
the writer takes every end queued meanwhile and writes them as one
statement (``end_runs``) on one autocommit connection: one round trip and
one commit for the batch (two statements in a transaction when an end must
release broker acks, ``ack_after = "complete"``, or gives a claim back).
The batch is what queued while the last one committed (under load, up to
2 ms more, for the other threads), so a lone end waits for nothing and a
busy process commits many at once.

No end waits for a row another transaction holds: the statement skips it
and answers "busy", and the end is asked for again a little later, for up to
about 5 s (an operator's cancel, the rescuer, or a store deduping to the
todo hold a row for milliseconds), then given up with :class:`StoreError`:
the todo stays running until its lease lapses and the rescuer puts it back.
Waiting inside the batch would hold up every thread of the process.

A batch that fails on the database (a connection lost, a failover) is
written again after a short wait. That is safe even when the failure hid a
commit that succeeded: an end written again finds its run ended and is
answered as discarded (the state is right; only the log line says less).
Once the retries are spent, each end gets :class:`StoreError`. A batch the
database refuses for the data of an end in it (SQLSTATE classes 22 and 23,
or the driver refusing a parameter) is not written again as it was: it is
halved until the end is alone, which is answered :class:`ChangeRefused`
(never retried), and every other end of the batch is written. A transaction
that gets no answer within the deadline is cancelled by the watchdog; a
thread that times out waiting for an end the writer has not taken yet
withdraws it (a withdrawn end is never written).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import TypeVar

import psycopg
import structlog
from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError

from backhalf import failpoints
from backhalf.db import HeldConnection
from backhalf.errors import ChangeRefused, StoreError
from backhalf.lifecycle import todos

log = structlog.get_logger(__name__)
T = TypeVar("T")

# A batch written again after a database error, after these waits.
RETRY_DELAYS_S = (0.2, 0.5, 1.0)
# At most this many changes in one transaction.
MAX_BATCH = 256
# Under load, how long a batch waits for the other threads' changes.
LINGER_MS = 2.0
# A change whose row another transaction holds is asked for again after
# these waits (about 5 s in all), then given up with StoreError.
BUSY_RETRY_DELAYS_S = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 1.0, 1.0, 1.0)
# How often the writer looks up from an empty queue (to notice close()).
IDLE_WAKE_S = 1.0


class _Settle:
    """A background end's answer (:meth:`StateWriter.finish`): nobody waits
    for it, so no Future (its lock and condition cost the worker more than
    the rest of the hand-off); the writer hands the result to a callback:
    whether the run held its todo, None (its row was busy), or the error."""

    __slots__ = ("_done", "_then")

    def __init__(self, then: Callable[[bool | BaseException | None], None]) -> None:
        self._then, self._done = then, False

    def set_running_or_notify_cancel(self) -> bool:
        return True

    def done(self) -> bool:
        return self._done

    def set_result(self, held: bool | None) -> None:
        self._settle(held)

    def set_exception(self, exc: BaseException) -> None:
        self._settle(exc)

    def _settle(self, outcome: bool | BaseException | None) -> None:
        self._done = True
        try:
            self._then(outcome)
        except Exception as exc:  # the writer's thread must outlive a callback's bug
            log.exception("todo_end_callback_failed", error=f"{type(exc).__name__}: {exc}")


@dataclass(slots=True)
class _End:
    ending: todos.Ending
    answer: Future[bool | None] | _Settle  # None: busy


# What a background end (StateWriter.finish) reports to its callback, in
# the writer's thread once the end is settled: whether its run still held
# the todo (False: cancelled or rescued meanwhile, the result discarded), or
# the error that kept it from being written (the todo stays running until
# its lease expires, then the rescuer runs it again).
Settled = Callable[[bool | BaseException], None]


class StateWriter:
    """The todos' state changes of one worker process, group-committed on one
    connection of ``engine`` (sync; its connect options bound every
    statement and lock wait, its connect hook pins synchronous_commit)."""

    def __init__(
        self,
        engine: Engine,
        *,
        deadline_ms: int,
        threads: int,
        releases: bool = True,
        linger_ms: float = LINGER_MS,
        max_batch: int = MAX_BATCH,
    ) -> None:
        self._engine = engine
        self._threads = threads
        # Whether an adapter of the config acks on complete: only then does
        # an end release acks, in a transaction of two statements (without,
        # one statement in autocommit: one round trip).
        self._releases = releases
        self._linger_s = linger_ms / 1000
        self._deadline_s = deadline_ms / 1000
        self._max_batch = max_batch
        self._queue: queue.SimpleQueue[_End] = queue.SimpleQueue()
        self._closing = threading.Event()
        # Its own connection, out of the engine's pool for good (its connect
        # hook has pinned synchronous_commit): psycopg's own transactions,
        # without a checkout, ping and reset per batch.
        self._conn = HeldConnection(self._engine, "state writer", todos.by_id_session)
        # The running transaction (a sequence number) and its deadline
        # (monotonic), for the watchdog.
        self._lock = threading.Lock()
        self._batch_no = 0
        self._busy_until: float | None = None
        # Changes answered busy so far (a row held by another transaction).
        self.busy_answers = 0
        # Background ends not settled yet (StateWriter.finish), for close().
        self._background = 0
        self._background_lock = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="switchboard-state-writer", daemon=True)
        self._watchdog = threading.Thread(target=self._watch, name="switchboard-state-watchdog", daemon=True)
        self._thread.start()
        self._watchdog.start()

    # -- the worker threads' side ---------------------------------------------------------

    def end(self, ending: todos.Ending) -> bool:
        """End a run, committed on return; False if the run no longer held
        its todo (its result is discarded)."""

        def request() -> tuple[_End, Future[bool | None]]:
            answer: Future[bool | None] = Future()
            return _End(ending, answer), answer

        what = f"todo {ending.run.todo.id}: recording its run ({ending.to_status})"
        held = self._ask(request, lambda answer: answer is None, what)
        assert held is not None
        return held

    def finish(self, ending: todos.Ending, settled: Settled) -> None:
        """End a run in the background: queued for the next batch, and
        ``settled`` called from the writer's thread once it is committed or
        given up (a row held elsewhere is asked for again, as :meth:`end`
        does, from a timer). Never raises: a writer that is closed settles
        at once with the error. :meth:`close` waits for every background
        end to settle."""
        with self._background_lock:
            self._background += 1

        def last(outcome: bool | BaseException) -> None:
            try:
                settled(outcome)
            finally:
                with self._background_lock:
                    self._background -= 1
                    self._background_lock.notify_all()

        self._finish(ending, last, 0)

    def _finish(self, ending: todos.Ending, settled: Settled, busy_tries: int) -> None:
        def answered(held: bool | BaseException | None) -> None:
            if held is not None:
                settled(held)
                return
            self.busy_answers += 1
            if busy_tries >= len(BUSY_RETRY_DELAYS_S):
                held_elsewhere = f"todo {ending.run.todo.id}: its row stayed locked by another transaction"
                settled(StoreError(held_elsewhere))
                return
            timer = threading.Timer(BUSY_RETRY_DELAYS_S[busy_tries], self._finish,
                                    (ending, settled, busy_tries + 1))  # fmt: skip
            timer.daemon = True
            timer.start()

        change = _End(ending, _Settle(answered))
        try:
            self._submit(change)
        except StoreError as exc:
            change.answer.set_exception(exc)

    def end_all(self, endings: Sequence[todos.Ending]) -> list[bool | BaseException]:
        """Several ends at once (claims given back), each committed or failed
        on return: whether its run held the todo, or why it was not
        written. A row held elsewhere is not asked for again (the rescuer
        sees to the todo once its lease expires)."""
        futures: list[Future[bool | None]] = [Future() for _ in endings]
        try:
            for ending, future in zip(endings, futures, strict=True):
                self._submit(_End(ending, future))
        except StoreError as exc:
            for future in futures:
                future.cancel()  # withdrawn: never written
            return [exc] * len(futures)
        answers: list[bool | BaseException] = []
        for future in futures:
            try:
                held = self._await(future, "giving back a claim")
            except StoreError as exc:
                answers.append(exc)
                continue
            answers.append(StoreError("its row was held by another transaction") if held is None else held)
        return answers

    def _ask(self, request: Callable[[], tuple[_End, Future[T]]], busy: Callable[[T], bool], what: str) -> T:
        """Submit a change and wait for its answer, asking again after each
        "busy" (its row held by another transaction), for about 5 s."""
        for delay_s in (*BUSY_RETRY_DELAYS_S, None):
            change, answer = request()
            self._submit(change)
            answered = self._await(answer, what)
            if not busy(answered):
                return answered
            self.busy_answers += 1
            if delay_s is None:
                break
            time.sleep(delay_s)
        raise StoreError(
            f"{what}: its row stayed locked by another transaction for {sum(BUSY_RETRY_DELAYS_S)} s"
        )

    @property
    def _write_bound_s(self) -> float:
        """The longest a batch takes: every try within the deadline, plus the waits between them."""
        return self._deadline_s * (len(RETRY_DELAYS_S) + 1) + sum(RETRY_DELAYS_S)

    def _submit(self, request: _End) -> None:
        if self._closing.is_set():
            raise StoreError("the worker is stopping: its state writer is closed")
        self._queue.put(request)

    def _await(self, answer: Future[T], what: str) -> T:
        """The answer, within a bound: every try of a batch within the
        deadline, plus the waits between them. A change not taken into a
        batch by then is withdrawn and never written; one being written is
        waited for once more, as long again."""
        bound_s = self._write_bound_s + IDLE_WAKE_S
        try:
            return answer.result(timeout=bound_s)
        except FutureTimeout as exc:
            if answer.cancel():
                raise StoreError(f"{what}: not written within {bound_s:.0f} s (withdrawn)") from exc
        try:
            return answer.result(timeout=bound_s)
        except FutureTimeout as exc:
            raise StoreError(f"{what}: no answer from the state writer within {2 * bound_s:.0f} s") from exc

    @property
    def queued(self) -> int:
        """Changes waiting for the writer to take them into a batch."""
        return self._queue.qsize()

    def close(self) -> None:
        """Write what is queued and every background end (one asked for again
        after a busy answer too), then stop; later changes are refused, and
        one that slipped in as the writer stopped fails, never left unanswered."""
        bound_s = self._write_bound_s + sum(BUSY_RETRY_DELAYS_S) + 5
        with self._background_lock:
            if not self._background_lock.wait_for(lambda: self._background == 0, timeout=bound_s):
                log.warning("todo_ends_unsettled", ends=self._background, waited_s=bound_s)
        self._closing.set()
        self._thread.join(timeout=self._write_bound_s + 5)
        if not self._thread.is_alive():
            late = StoreError("the worker is stopping: its state writer is closed")
            while True:
                try:
                    change = self._queue.get_nowait()
                except queue.Empty:
                    break
                if change.answer.set_running_or_notify_cancel():
                    change.answer.set_exception(late)
            self._conn.discard()
        self._engine.dispose()

    # -- the writer thread ------------------------------------------------------------------

    def _run(self) -> None:
        last_batch = 0
        while True:
            try:
                first = self._queue.get(timeout=IDLE_WAKE_S)
            except queue.Empty:
                if self._closing.is_set():
                    return
                continue
            batch = [first]
            # Under load (the last batch held several changes) wait a moment
            # for the other threads' changes, up to one per thread: a batch
            # of 8 costs little more than a batch of 1. A lone change, as at
            # a low rate, waits for nothing.
            linger_until = time.monotonic() + self._linger_s if last_batch > 1 else 0.0
            while len(batch) < self._max_batch:
                try:
                    batch.append(self._queue.get_nowait())
                    continue
                except queue.Empty:
                    pass
                remaining = linger_until - time.monotonic()
                if remaining <= 0 or len(batch) >= self._threads:
                    break
                try:
                    batch.append(self._queue.get(timeout=remaining))
                except queue.Empty:
                    break
            last_batch = len(batch)
            try:
                self._write(batch)
            except Exception as exc:  # the writer must outlive a bug: every worker thread waits on it
                log.exception("todo_states_crashed", changes=len(batch), error=f"{type(exc).__name__}: {exc}")
                failure = StoreError(f"the state writer failed on {len(batch)} changes: {type(exc).__name__}")
                failure.__cause__ = exc
                for request in batch:
                    if not request.answer.done():
                        request.answer.set_exception(failure)

    def _write(self, batch: list[_End]) -> None:
        # Withdrawn changes (their thread timed out) are dropped, never written.
        pending = [r for r in batch if r.answer.set_running_or_notify_cancel()]
        while pending:
            ends, pending = _split(pending)
            self._write_one(ends)

    def _write_one(self, ends: list[_End]) -> None:
        error: StoreError | None = None
        for delay_s in (0.0, *RETRY_DELAYS_S):
            if error is not None:
                log.warning("todo_ends_retried", ends=len(ends), error=str(error), retry_in_s=delay_s)
                time.sleep(delay_s)
            try:
                failpoints.hit("worker_before_end_commit")
                held, busy = self._transaction(ends)
            except Exception as exc:
                if refused_for_its_data(exc):
                    self._isolate(ends, exc)
                    return
                if not isinstance(exc, psycopg.Error | SQLAlchemyError):
                    raise
                self._conn.discard()
                error = StoreError(f"writing {len(ends)} ends of todos: {type(exc).__name__}: {exc}")
                error.__cause__ = exc
                continue
            for end in ends:
                todo_id = end.ending.run.todo.id
                end.answer.set_result(None if todo_id in busy else todo_id in held)
            return
        assert error is not None
        log.error("todo_ends_not_written", ends=len(ends), error=str(error))
        for end in ends:
            end.answer.set_exception(error)

    def _isolate(self, ends: list[_End], exc: BaseException) -> None:
        """The database refused the batch for the data of an end in it (an
        id out of range, a text it cannot store): that end alone is
        answered with :class:`ChangeRefused` and never written again, and the
        others are written without it, the batch halved until the end is
        alone (a few more commits, for a batch that has one)."""
        if len(ends) == 1:
            todo_id = ends[0].ending.run.todo.id
            reason = f"{type(exc).__name__}: {exc}"
            log.error("todo_state_refused", todo_id=todo_id, error=reason)
            refused = ChangeRefused(f"todo {todo_id}: the database refused its state change: {reason}")
            refused.__cause__ = exc
            ends[0].answer.set_exception(refused)
            return
        half = len(ends) // 2
        for part in (ends[:half], ends[half:]):
            self._write_one(part)

    def _transaction(self, ends: Sequence[_End]) -> tuple[set[int], set[int]]:
        pg = self._conn.get()
        with self._watched():
            return todos.end_runs(pg, [e.ending for e in ends], release=self._releases)

    @contextlib.contextmanager
    def _watched(self) -> Iterator[None]:
        """A transaction the watchdog cancels past the deadline."""
        with self._lock:
            self._batch_no += 1
            self._busy_until = time.monotonic() + self._deadline_s
        try:
            yield
        finally:
            with self._lock:
                self._busy_until = None

    def _watch(self) -> None:
        """Cancel a transaction past its deadline: a server that still ACKs
        but never answers would otherwise hold every worker thread. The
        cancelled batch fails and is written again on a new connection."""
        while not (self._closing.is_set() and not self._thread.is_alive()):
            time.sleep(min(1.0, self._deadline_s / 4))
            with self._lock:
                late = self._busy_until is not None and time.monotonic() > self._busy_until
                batch_no = self._batch_no
            pg = self._conn.current() if late else None
            if pg is None:
                continue
            with self._lock:
                still = self._batch_no == batch_no and self._busy_until is not None
            if not still:
                continue
            log.warning(
                "todo_states_cancelled", reason="no answer within the deadline", deadline_s=self._deadline_s
            )
            try:
                pg.cancel_safe(timeout=self._deadline_s)
            except (psycopg.Error, OSError) as exc:
                # The server is out of reach too: TCP's timeouts end the batch.
                log.warning("todo_states_cancel_failed", error=f"{type(exc).__name__}: {exc}")


# SQLSTATE classes of a change's own data: data exception (a text holding
# NUL, a number out of range) and integrity constraint violation.
DATA_ERROR_CLASSES = frozenset({"22", "23"})


def refused_for_its_data(exc: BaseException) -> bool:
    """Whether the database (or the driver, dumping the parameters) refused
    a statement for the data it was given: written again, it fails again.
    Anything else (a connection lost, a timeout, a cancel, a server shutting
    down) may pass, and is retried."""
    if isinstance(exc, psycopg.DataError | psycopg.IntegrityError | UnicodeError | OverflowError):
        return True
    if isinstance(exc, psycopg.Error):
        return (exc.sqlstate or "")[:2] in DATA_ERROR_CLASSES
    return False


def _split(batch: Sequence[_End]) -> tuple[list[_End], list[_End]]:
    """One statement changes each todo once: the ends of distinct todos, and
    what waits for the next batch, so that it meets the state the first end
    left (its run's token is gone then, and it is answered as discarded)."""
    ends: list[_End] = []
    later: list[_End] = []
    changed: set[int] = set()
    for request in batch:
        todo_id = request.ending.run.todo.id
        if todo_id in changed:
            later.append(request)
            continue
        changed.add(todo_id)
        ends.append(request)
    return ends, later
