"""How the long-running verbs (``ingest``, ``ack``) run: on one event loop
until SIGTERM or SIGINT, checking that nothing they started is left alive,
and a database that refuses for good as one line and ``EXIT_DATABASE``."""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import Awaitable, Callable

import structlog

from backhalf import db_errors
from ingest.cli import errors as cli_errors
from ingest.config import Settings
from ingest.exit_codes import EXIT_DATABASE, EXIT_FAILURE, EXIT_OK
from ingest.lifecycle import leftover_tasks
from ingest.signals import stop_on_signals

log = structlog.get_logger("switchboard")

Body = Callable[[asyncio.Event], Awaitable[None]]


def run_until_stopped(verb: str, settings: Settings, body: Body) -> int:
    """Run ``body`` until stopped; a permanent database error at start-up is
    one line naming the database, as the short commands' are."""
    try:
        return _run(body)
    except db_errors.DatabaseUnusable as exc:
        target = cli_errors.database_target(settings)
        print(f"switchboard {verb}: {exc.problem.message} [{target}]", file=sys.stderr)
        problem = exc.problem
        # The message is the whole story: no traceback.
        log.error("database_unusable", kind=problem.kind, sqlstate=problem.sqlstate, error=str(exc))  # noqa: TRY400
        return EXIT_DATABASE


def _run(body: Body) -> int:
    async def main() -> int:
        stop = asyncio.Event()
        with stop_on_signals(stop):
            await body(stop)
        leaked = leftover_tasks()
        if leaked:
            log.error("tasks_leaked", tasks=leaked)
            return EXIT_FAILURE
        return EXIT_OK

    code = asyncio.run(main())
    threads = [t.name for t in threading.enumerate() if t is not threading.main_thread() and t.is_alive()]
    if threads:
        log.error("threads_leaked", threads=threads)
        return EXIT_FAILURE
    return code
