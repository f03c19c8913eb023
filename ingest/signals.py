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
* At exit, once the last exit callback has run, stop signals still handled
  here are ignored (:func:`_ignore_while_finalizing`): CPython's finalization
  resets every Python-level handler to the default action while it still has
  a second or so of work to do, and a signal then would kill the process.
"""

from __future__ import annotations

import atexit
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
    """Record stop signals that arrive while the process is still importing;
    and, from the interpreter's finalization on, ignore those still handled here."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, _record)
    # Registered before the heavy imports register theirs, so run after them
    # (exit callbacks run last registered, first run).
    atexit.register(_ignore_while_finalizing)


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


def _ignore_while_finalizing() -> None:
    """Ignore the stop signals this module still handles, for what is left of the exit.

    After the exit callbacks, ``Py_FinalizeEx`` flushes stdio and then
    (``_PySignal_Fini``) puts back the default action of every signal with a
    Python-level handler, before the garbage collection and module teardown
    that follow (about a second for ``ingest`` under ``-X dev``): a second
    SIGTERM or SIGINT in that stretch killed the process (exit -15 or -2 to
    its supervisor) although its graceful stop had finished (issue 23). An
    ignored signal is left ignored there. Nothing is left to stop by then
    but the interpreter's own teardown, so the exit code stays that of the
    run; a teardown that hangs is for SIGKILL, as any hang is. Up to here
    (threads joined, exit callbacks) a second signal still exits 130.
    Handlers not installed here (short commands' default ones, the demo's)
    are left as they are."""
    for sig in STOP_SIGNALS:
        if getattr(signal.getsignal(sig), "__module__", None) == __name__:
            signal.signal(sig, signal.SIG_IGN)


def _after_the_loop(stop: asyncio.Event) -> Callable[[int, FrameType | None], None]:
    def handler(signum: int, _frame: FrameType | None) -> None:
        if stop.is_set():
            os._exit(EXIT_FORCED)  # no logging here: the loggers may be gone
        _requested.append(signum)

    return handler
