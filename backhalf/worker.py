"""One run of one todo, as a dramatiq worker thread does it.

The todo's state in PostgreSQL is the truth; dramatiq's message is only the
wake-up call (it carries the todo's id). A run:

1. **starts** the todo (``todos.start``): running, its attempt counted, a
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
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import structlog
from dramatiq.middleware import TimeLimitExceeded
from sqlalchemy import Engine

from backhalf import todos
from backhalf.db import wrap_driver_errors
from backhalf.errors import StoreError
from backhalf.queues import QueueConfig

log = structlog.get_logger(__name__)

# last_error and the todo_events detail keep this much of an error's text.
MAX_ERROR_CHARS = 2000
# A run's end recorded again after a database error, after these waits
# (well inside any lease: the margin is at least 2 s).
END_RUN_RETRY_DELAYS_S = (0.2, 0.5, 1.0)

Handler = Callable[[todos.Todo], Any]


class Runner:
    """Runs the todos of the queues it was given, on ``engine`` (sync)."""

    def __init__(self, engine: Engine, handlers: dict[str, tuple[QueueConfig, Handler]]) -> None:
        self._engine = engine
        self._handlers = handlers

    def run(self, queue_name: str, todo_id: int) -> None:
        """Do todo ``todo_id`` once, if it is still to be done. Raises only to
        ask dramatiq for a retry (an attempt failed and attempts are left) or
        when the database cannot record the outcome (dramatiq retries; the
        todo's lease decides whether that delivery runs)."""
        queue, handler = self._handlers[queue_name]
        bound = log.bind(todo_id=todo_id, queue=queue_name)
        with self._transaction(f"todo {todo_id}: starting it") as cur:
            started = todos.start(cur, todo_id, queue.lease_ms / 1000, queue.max_attempts)
        todo = started.todo
        if todo is None:
            bound.info("todo_skipped", status=started.found)
            return
        bound = bound.bind(attempt=todo.attempt)
        try:
            _call(handler, todo, queue.time_limit_ms / 1000)
        # dramatiq's TimeLimitExceeded is a BaseException; KeyboardInterrupt,
        # SystemExit and dramatiq's Shutdown are not the handler's failure.
        except (Exception, TimeLimitExceeded) as exc:
            self._failed(queue, started, exc, bound)
            if todo.attempt < queue.max_attempts:
                raise  # dramatiq's Retries runs it again after its backoff
            return
        held = self._end(started, "done", error=None, detail="done")
        if held:
            bound.info("todo_done")
        else:
            bound.warning("todo_result_discarded", reason="cancelled or rescued while it ran")

    def _failed(self, queue: QueueConfig, started: todos.Started, exc: BaseException, bound: Any) -> None:
        todo = started.todo
        assert todo is not None
        error = f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS]
        final = todo.attempt >= queue.max_attempts
        to_status = "failed" if final else "dispatched"
        detail = f"attempt {todo.attempt} of {queue.max_attempts} failed" + (
            "" if final else "; retried after backoff"
        )
        held = self._end(started, to_status, error=error, detail=detail)
        if not held:
            bound.warning("todo_result_discarded", reason="cancelled or rescued while it ran", error=error)
        elif final:
            bound.error("todo_failed", error=error, attempts=todo.attempt)
        else:
            bound.warning("todo_attempt_failed", error=error, max_attempts=queue.max_attempts)

    def close(self) -> None:
        self._engine.dispose()

    def _end(self, started: todos.Started, to_status: str, *, error: str | None, detail: str) -> bool:
        """``end_run``, tried again on a database error while the lease
        lasts (it is safe to repeat: the lease guards it), so a blip after a
        handler finished neither runs it again nor leaves it for the rescuer."""
        assert started.todo is not None
        what = f"todo {started.todo.id}: recording its run ({to_status})"
        for delay_s in END_RUN_RETRY_DELAYS_S:
            try:
                with self._transaction(what) as cur:
                    return todos.end_run(cur, started, to_status, error=error, detail=detail)
            except StoreError as exc:
                log.warning("todo_end_retried", todo_id=started.todo.id, error=str(exc), retry_in_s=delay_s)
                time.sleep(delay_s)
        with self._transaction(what) as cur:  # the last try: its failure goes to dramatiq
            return todos.end_run(cur, started, to_status, error=error, detail=detail)

    @contextmanager
    def _transaction(self, what: str) -> Iterator[psycopg.Cursor[Any]]:
        with wrap_driver_errors(StoreError, what), self._engine.begin() as conn:
            pg = conn.connection.driver_connection
            assert isinstance(pg, psycopg.Connection)
            with pg.cursor() as cur:
                yield cur


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
