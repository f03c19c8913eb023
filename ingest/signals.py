"""Stop signals, handled in one place and turned into a stop request.

Self-contained on purpose: the console entry point (``ingest.entry``) installs
:func:`record_early` before the heavy imports, so this module imports nothing
heavy at its top, and no other module of ``ingest`` is imported by it but the
exit codes.

* Before the event loop runs, a SIGTERM or SIGINT is only recorded.
* Inside :func:`stop_on_signals`, the first one sets the stop event (also if
  one was recorded early); a second one exits at once with ``EXIT_FORCED``.
* Short commands restore the default handlers (:func:`restore_default_handlers`),
  so Ctrl-C acts at once as usual.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import TYPE_CHECKING

from ingest.exit_codes import EXIT_FORCED

if TYPE_CHECKING:
    import asyncio

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)

_requested: list[int] = []


def _record(signum: int, _frame: FrameType | None) -> None:
    _requested.append(signum)


def record_early() -> None:
    """Record stop signals that arrive while the process is still importing."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, _record)


def stop_requested_early() -> bool:
    return bool(_requested)


def restore_default_handlers() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)


@contextmanager
def stop_on_signals(stop: asyncio.Event) -> Iterator[None]:
    """First SIGTERM/SIGINT sets ``stop``; a second one exits at once.

    The loop's handlers are removed on exit; what comes after (asyncio.run's
    teardown, the leak checks, the interpreter's shutdown) gets a plain
    handler instead, never the default action: a signal then is a second one
    if a stop was requested (exit ``EXIT_FORCED``, as during the run), and
    is only recorded otherwise, the process being on its way out already."""
    import asyncio

    import structlog

    log = structlog.get_logger(__name__)
    loop = asyncio.get_running_loop()

    def on_signal(signum: int) -> None:
        if stop.is_set():
            log.warning("forced_exit", signal=signal.Signals(signum).name)
            os._exit(EXIT_FORCED)
        log.info("stop_requested", signal=signal.Signals(signum).name)
        stop.set()

    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, on_signal, sig)
    if stop_requested_early():  # signalled while still importing
        log.info("stop_requested", signal="before start-up finished")
        stop.set()
    try:
        yield
    finally:
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)
            signal.signal(sig, _after_the_loop(stop))


def _after_the_loop(stop: asyncio.Event) -> Callable[[int, FrameType | None], None]:
    def handler(signum: int, _frame: FrameType | None) -> None:
        if stop.is_set():
            os._exit(EXIT_FORCED)  # no logging here: the loggers may be gone
        _requested.append(signum)

    return handler
