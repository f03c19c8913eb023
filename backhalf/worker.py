"""One run of one todo, as a dramatiq worker thread does it.

The todo's state in PostgreSQL is the truth; dramatiq's message is only the
wake-up call (it carries the todo's id). A run:

1. **starts** the todo of the actor's queue (``todos.start``; a todo of
   another queue is refused, as is any message whose start the database
   refuses for its data, never retried): running, its attempt counted, a
   lease of ``time_limit_ms + lease_margin_ms``; or skips the message if the
   todo is not to run (done, failed, cancelled, running under a live lease:
   a redelivery or a rescued copy), so no message ever runs a finished todo
   again;
2. calls the handler with the :class:`backhalf.todos.Todo` (sync, or async
   run to completion in an event loop of its own);
3. **ends** the run: done; or, on an error, dispatched again for dramatiq's
   retry (after its backoff) or failed once ``max_attempts`` runs were made,
   with ``last_error``. Only the run that holds the todo may end it: a todo
   cancelled or rescued meanwhile keeps its state, and this run's result is
   discarded.

Handlers run at least once: a worker killed mid-run leaves the todo running
until its lease expires, then the rescuer dispatches it again.

Starts and ends are written by the process's :class:`StateWriter` (one
group commit for every thread's changes). Where the worker's broker claims
at fetch (ingest.processes.worker_claims), the start was made already, for
the whole fetched batch in one statement, and the run comes with its
:class:`Claim`; a claim that waited in the prefetch longer than half the
lease margin has its lease extended before the handler runs. Where the
broker can hold its ack of the message (``hold``), a successful run's end
is written in the background and the ack released once it is committed
(a crash before that leaves the todo running: rescued and run again, at
least once); a failed run's end is committed before the run returns, as
dramatiq's retry must find the todo dispatched.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import structlog
from dramatiq.middleware import TimeLimitExceeded

from backhalf import metrics, todos
from backhalf.bounded_text import cut, storable
from backhalf.errors import ChangeRefused
from backhalf.queues import QueueConfig
from backhalf.redaction import redact
from backhalf.state_writer import StateWriter

log = structlog.get_logger(__name__)

# last_error and the todo_events detail keep this much of an error's text.
MAX_ERROR_CHARS = 2000

Handler = Callable[[todos.Todo], Any]
# Holds the broker's ack of the message being run, returning what releases it.
Hold = Callable[[], Callable[[], None]]


class Claim(NamedTuple):
    """A start made when the message was fetched, and when (monotonic)."""

    started: todos.Started
    at: float


class Runner:
    """Runs the todos of the queues it was given; their state changes go
    through ``writer``."""

    def __init__(self, writer: StateWriter, handlers: dict[str, tuple[QueueConfig, Handler]]) -> None:
        self._writer = writer
        self._handlers = handlers

    @property
    def writer(self) -> StateWriter:
        return self._writer

    def run(
        self, queue_name: str, todo_id: int, claim: Claim | None = None, hold: Hold | None = None
    ) -> None:
        """Do todo ``todo_id`` once, if it is still to be done (``claim``: its
        start, made at fetch). Raises only to ask dramatiq for a retry (an
        attempt failed and attempts are left) or when the database cannot
        record the outcome (dramatiq retries; the todo's lease decides
        whether that delivery runs)."""
        queue, handler = self._handlers[queue_name]
        bound = log.bind(todo_id=todo_id, queue=queue_name)
        started = self._started(queue, todo_id, claim, bound)
        if started is None:
            return
        todo = started.todo
        assert todo is not None
        bound = bound.bind(attempt=todo.attempt)
        began = time.perf_counter()
        try:
            _call(handler, todo, queue.time_limit_ms / 1000)
        # dramatiq's TimeLimitExceeded is a BaseException; KeyboardInterrupt,
        # SystemExit and dramatiq's Shutdown are not the handler's failure.
        except (Exception, TimeLimitExceeded) as exc:
            if metrics.on():
                metrics.RUN_SECONDS.labels(queue_name).observe(time.perf_counter() - began)
                metrics.ATTEMPTS_FAILED.labels(queue_name).inc()
            self._failed(queue, started, exc, bound)
            if todo.attempt < queue.max_attempts:
                raise  # dramatiq's Retries runs it again after its backoff
            return
        if metrics.on():
            metrics.RUN_SECONDS.labels(queue_name).observe(time.perf_counter() - began)
        ending = todos.Ending(started, "done", None, "done")
        if hold is None:
            self._done(queue_name, bound, self._end(ending))
            return
        release = hold()

        def settled(outcome: bool | BaseException) -> None:
            try:
                self._done(queue_name, bound, outcome)
            finally:
                release()

        try:
            self._writer.finish(ending, settled)
        except BaseException:
            # Not handed over (dramatiq's time limit struck in between): the
            # ack is not held for an end that will never settle.
            release()
            raise

    def _started(
        self, queue: QueueConfig, todo_id: int, claim: Claim | None, bound: Any
    ) -> todos.Started | None:
        """The run's start: its claim (its lease extended if it waited long),
        or a start made now. None when it is not to run (said in the log)."""
        if claim is None:
            try:
                started = self._writer.start(todo_id, queue.name, queue.lease_ms / 1000, queue.max_attempts)
            except ChangeRefused as exc:
                # Never retried: the same message would be refused again.
                refused(queue.name, "start_refused", bound, error=str(exc))
                return None
        elif claim.started.todo is not None and claim.started.todo.id != todo_id:
            # Not this message's claim (a bookkeeping slip): never run another todo.
            bound.error("claim_mismatch", claimed=claim.started.todo.id)
            return None
        else:
            started = claim.started
        if started.todo is None:
            if started.found == todos.FOREIGN:
                refused(queue.name, "todo_of_another_queue", bound)
            else:
                bound.info("todo_skipped", status=started.found)
            return None
        waited_s = 0.0 if claim is None else time.monotonic() - claim.at
        # The claim's lease began at fetch: a message that waited behind
        # slow runs gets it again from now, so the lease covers its whole run.
        # False: rescued or cancelled while it waited. None (its row held by
        # another transaction a moment): run on the lease it has.
        waited_long = waited_s > queue.lease_margin_ms / 2000
        if waited_long and self._writer.extend([(started, queue.lease_ms / 1000)]) == [False]:
            bound.info("todo_skipped", status="claim_lost", waited_s=round(waited_s, 3))
            return None
        return started

    def _done(self, queue_name: str, bound: Any, outcome: bool | BaseException) -> None:
        """A successful run's end, settled: counted and logged."""
        if outcome is True:
            if metrics.on():
                metrics.FINISHED.labels(queue_name, "done").inc()
            # Debug: a line per success would cost each todo a write to the
            # log; todo_events has the record of every one.
            bound.debug("todo_done")
        elif outcome is False:
            bound.warning("todo_result_discarded", reason="cancelled or rescued while it ran")
        else:
            # The todo stays running until its lease expires; then the
            # rescuer dispatches it and it runs again (at least once).
            bound.error("todo_end_not_written", error=f"{type(outcome).__name__}: {outcome}")

    def _failed(self, queue: QueueConfig, started: todos.Started, exc: BaseException, bound: Any) -> None:
        todo = started.todo
        assert todo is not None
        error = stored_error(exc)
        final = todo.attempt >= queue.max_attempts
        to_status = "failed" if final else "dispatched"
        detail = f"attempt {todo.attempt} of {queue.max_attempts} failed" + (
            "" if final else "; retried after backoff"
        )
        held = self._end(todos.Ending(started, to_status, error, detail))
        if not held:
            bound.warning("todo_result_discarded", reason="cancelled or rescued while it ran", error=error)
        elif final:
            if metrics.on():
                metrics.FINISHED.labels(queue.name, "failed").inc()
            bound.error("todo_failed", error=error, attempts=todo.attempt)
        else:
            bound.warning("todo_attempt_failed", error=error, max_attempts=queue.max_attempts)

    def _end(self, ending: todos.Ending) -> bool:
        """End the run; if the database refuses the end for its data, end it
        once more with an error saying so (the todo keeps a readable
        reason, and its run is not left holding it until its lease ends)."""
        try:
            return self._writer.end(ending)
        except ChangeRefused as exc:
            error = storable(f"the database refused this run's outcome as written: {exc}")[:MAX_ERROR_CHARS]
            return self._writer.end(todos.Ending(ending.run, ending.to_status, error, ending.detail))

    def close(self) -> None:
        self._writer.close()


def stored_error(exc: BaseException) -> str:
    """What ``last_error`` and the log keep of a handler's error: cut first
    (it may be a megabyte, echoing the input), then redacted (a client
    library's error may carry its connection string, password included),
    then storable by PostgreSQL (no NUL, no unpaired surrogate): whatever
    the error holds, its todo records it."""
    try:
        text = f"{type(exc).__name__}: {exc}"
    except Exception:  # noqa: BLE001 - an exception whose __str__ raises is still an error
        text = f"{type(exc).__name__}: (its message could not be printed)"
    return storable(redact(cut(text, MAX_ERROR_CHARS)))[:MAX_ERROR_CHARS]


def refused(queue_name: str, reason: str, bound: Any, **fields: Any) -> None:
    """A message for this queue's actor that runs no handler and is not
    retried: logged and counted (``switchboard_worker_messages_refused_total``)."""
    bound.warning("message_refused", reason=reason, **fields)
    if metrics.on():
        metrics.MESSAGES_REFUSED.labels(queue_name, reason).inc()


def _call(handler: Handler, todo: todos.Todo, time_limit_s: float) -> None:
    """A sync handler in this thread; an async one to completion in an event
    loop of its own (dramatiq's worker threads run none), under the time
    limit: dramatiq's TimeLimit cannot stop a thread waiting in the loop's
    selector, asyncio's timeout can."""
    result = handler(todo)
    if inspect.isawaitable(result):
        asyncio.run(_awaited(result, time_limit_s))


async def _awaited(awaitable: Any, time_limit_s: float) -> Any:
    async with asyncio.timeout(time_limit_s):
        return await awaitable
