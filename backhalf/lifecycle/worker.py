"""One run of one todo, as a dramatiq worker thread does it.

The todo's state in PostgreSQL is the truth, and the todos table is the
workers' queue (DESIGN.md section 7b): a run comes with its claim, made by
the worker process's consumer (``ingest.processes.workers.worker_broker``), which
marked the todo running, counted the attempt and leased it. A run:

1. calls the handler with the :class:`backhalf.lifecycle.todos.Todo` (sync, or async
   run to completion in an event loop of its own), unless the claim was
   lost while it waited for a thread (cancelled, or rescued: its lease
   could not be extended);
2. **ends** the run: done, written in the background (the thread takes its
   next todo at once, and the end is committed with the other threads'
   in one batch); or, on an error, pending again to wait out its backoff,
   or failed once ``max_attempts`` runs were made, with ``last_error``,
   committed before the thread goes on. Only the run that holds the todo
   may end it: a todo cancelled or rescued meanwhile keeps its state, and
   this run's result is discarded.

Handlers run at least once: a worker killed mid-run, or before its end
commits, leaves the todo running until its lease lapses; then the rescuer
puts it back and it runs again.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any

import structlog
from dramatiq.common import compute_backoff
from dramatiq.middleware import TimeLimitExceeded

from backhalf import metrics, tracing
from backhalf.bounded_text import cut, storable
from backhalf.errors import ChangeRefused, StoreError
from backhalf.lifecycle import todos
from backhalf.lifecycle.queues import QueueConfig
from backhalf.lifecycle.state_writer import Settled, StateWriter
from backhalf.redaction import redact

log = structlog.get_logger(__name__)

# last_error and the todo_events detail keep this much of an error's text.
MAX_ERROR_CHARS = 2000

Handler = Callable[[todos.Todo], Any]


class Runner:
    """Runs the todos of the queues it was given; their ends go through
    ``writer``."""

    def __init__(self, writer: StateWriter, handlers: dict[str, tuple[QueueConfig, Handler]]) -> None:
        self._writer = writer
        self._handlers = handlers

    @property
    def writer(self) -> StateWriter:
        return self._writer

    def run(self, claim: todos.Claimed, *, lost: bool = False, settled: Settled | None = None) -> None:
        """Do the claimed todo once. ``lost``: its claim was found lost while
        it waited for a thread (not run). ``settled``: told once the run's
        end is committed or given up (the claim's lease is kept until
        then). Never raises for the handler's failure: its retry is the
        todo's, pending again after its backoff."""
        todo = claim.todo
        queue, handler = self._handlers[todo.queue]
        if lost:
            _bound(todo).info("todo_skipped", status="claim_lost")
            _tell(settled, False)
            return
        try:
            self._run(queue, handler, claim, settled)
        except BaseException as exc:
            # Not the handler's failure (dramatiq's Shutdown, a time limit
            # striking after the handler returned): the claim is let go
            # unless its end was handed over, and lapses into the rescuer's
            # hands if no end is written.
            _tell(settled, exc)
            raise

    def _run(
        self, queue: QueueConfig, handler: Handler, claim: todos.Claimed, settled: Settled | None
    ) -> None:
        todo = claim.todo
        began = time.perf_counter()
        if tracing.on():
            error = _traced_attempt(handler, claim, queue)
        else:
            error = _attempt(handler, todo, queue.time_limit_ms / 1000)
        if error is not None:
            if metrics.on():
                metrics.RUN_SECONDS.labels(todo.queue).observe(time.perf_counter() - began)
                metrics.ATTEMPTS_FAILED.labels(todo.queue).inc()
            # Let go before the end is written: a lease beat between its
            # commit and a later release would call the claim lost. An end
            # not written leaves the claim to lapse, as it must.
            _tell(settled, True)
            self._failed(queue, claim, error)
            return
        if metrics.on():
            metrics.RUN_SECONDS.labels(todo.queue).observe(time.perf_counter() - began)
        ending = todos.Ending(claim, "done", None, "done")

        def done(outcome: bool | BaseException) -> None:
            try:
                self._done(todo, outcome)
            finally:
                _tell(settled, outcome)

        self._writer.finish(ending, done)

    def _done(self, todo: todos.Todo, outcome: bool | BaseException) -> None:
        """A successful run's end, settled: counted, and logged if it went wrong
        (todo_events has the record of every success: a line per success
        would cost each todo a write to the log)."""
        if outcome is True:
            if metrics.on():
                metrics.FINISHED.labels(todo.queue, "done").inc()
        elif outcome is False:
            _bound(todo).warning("todo_result_discarded", reason="cancelled or rescued while it ran")
        else:
            # The todo stays running until its lease lapses; then the
            # rescuer puts it back and it runs again (at least once).
            _bound(todo).error("todo_end_not_written", error=f"{type(outcome).__name__}: {outcome}")

    def _failed(self, queue: QueueConfig, claim: todos.Claimed, exc: BaseException) -> None:
        todo = claim.todo
        bound = _bound(todo)
        error = stored_error(exc)
        final = todo.attempt >= queue.max_attempts
        delay_s = 0.0 if final else backoff_ms(queue, todo.attempt) / 1000
        detail = f"attempt {todo.attempt} of {queue.max_attempts} failed" + (
            "" if final else f"; retried after {delay_s:g} s"
        )
        ending = todos.Ending(claim, "failed" if final else "pending", error, detail, delay_s=delay_s)
        try:
            held = self._end(ending)
        except StoreError as exc_db:
            # Its lease lapses once the worker stops extending it (the claim
            # is settled): the rescuer counts the attempt and puts it back.
            bound.error("todo_end_not_written", error=str(exc_db), handler_error=error)
            return
        if not held:
            bound.warning("todo_result_discarded", reason="cancelled or rescued while it ran", error=error)
        elif final:
            if metrics.on():
                metrics.FINISHED.labels(queue.name, "failed").inc()
            bound.error("todo_failed", error=error, attempts=todo.attempt)
        else:
            bound.warning("todo_attempt_failed", error=error, max_attempts=queue.max_attempts,
                          retry_in_s=delay_s)  # fmt: skip

    def _end(self, ending: todos.Ending) -> bool:
        """End the run; if the database refuses the end for its data, end it
        once more with an error saying so (the todo keeps a readable
        reason, and its run is not left holding it until its lease ends)."""
        try:
            return self._writer.end(ending)
        except ChangeRefused as exc:
            error = storable(f"the database refused this run's outcome as written: {exc}")[:MAX_ERROR_CHARS]
            return self._writer.end(
                todos.Ending(ending.run, ending.to_status, error, ending.detail, delay_s=ending.delay_s)
            )

    def close(self) -> None:
        self._writer.close()


def backoff_ms(queue: QueueConfig, attempt: int) -> int:
    """The wait before attempt ``attempt + 1``: dramatiq's exponential
    backoff with jitter (``min_backoff_ms`` doubled per attempt, capped at
    ``max_backoff_ms``), as its Retries middleware computed it."""
    _, delay_ms = compute_backoff(attempt - 1, factor=queue.min_backoff_ms, max_backoff=queue.max_backoff_ms)
    return int(min(delay_ms, queue.max_backoff_ms))


def _bound(todo: todos.Todo) -> Any:
    """The run's logger, bound only when there is something to say: a bind
    per run cost every todo a copy of the context."""
    return log.bind(todo_id=todo.id, queue=todo.queue, attempt=todo.attempt)


def _tell(settled: Settled | None, outcome: bool | BaseException) -> None:
    if settled is not None:
        settled(outcome)


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


def _attempt(handler: Handler, todo: todos.Todo, time_limit_s: float) -> BaseException | None:
    """Call the handler once: None, or what it raised, which is the attempt's failure."""
    try:
        _call(handler, todo, time_limit_s)
    # dramatiq's TimeLimitExceeded is a BaseException; KeyboardInterrupt,
    # SystemExit and dramatiq's Shutdown are not the handler's failure:
    # they end the run unended, and the rescuer puts the todo back.
    # An async handler's own CancelledError (a BaseException) is its
    # failure too, not a stop of the worker's.
    except (Exception, TimeLimitExceeded, asyncio.CancelledError) as exc:  # noqa: BLE001 - whatever it raised is the attempt's failure
        return exc
    return None


def _traced_attempt(handler: Handler, claim: todos.Claimed, queue: QueueConfig) -> BaseException | None:
    """:func:`_attempt` inside its ``switchboard run`` span, a child of the
    todo's trace context; the handler's own spans are the run's children."""
    todo = claim.todo
    with tracing.run_span(
        todo_id=todo.id, queue=todo.queue, attempt=todo.attempt, context=claim.trace_context,
    ) as span:  # fmt: skip
        error = _attempt(handler, todo, queue.time_limit_ms / 1000)
        if error is None:
            span.ended("done")
        else:
            outcome = "failed" if todo.attempt >= queue.max_attempts else "retry"
            span.ended(outcome, type(error).__name__, stored_error(error))
    return error


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
