"""Child processes that do not outlive the process that started them.

A server or ``switchboard`` process the kit starts is SIGKILLed by the kernel
when its parent dies, however it dies (kill -9 included), so nothing is left
running, re-parented to init. Linux only (``prctl(PR_SET_PDEATHSIG)``, set in
the child between fork and exec, after any change of user, which would clear
it); elsewhere the children are stopped by the usual clean-up alone. A
child told to end is waited for, and killed if it will not, by :func:`reap`.

The kernel sends the signal when the *thread* that forked the child ends, not
the process: a child started from a worker thread would be killed when that
thread exits. So it is armed only for children started from the main thread.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from types import FrameType
from typing import Any

from ingest.signals import STOP_SIGNALS

_PR_SET_PDEATHSIG = 1


def _load_prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl: Callable[..., int] = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return prctl


_PRCTL = _load_prctl()


def die_with_parent() -> dict[str, Any]:
    """``Popen`` keyword arguments that have the child SIGKILLed when this
    process dies; none off Linux or off the main thread."""
    if _PRCTL is None or threading.current_thread() is not threading.main_thread():
        return {}
    prctl, parent, sigkill = _PRCTL, os.getpid(), int(signal.SIGKILL)

    def arm() -> None:  # runs in the child, before exec
        prctl(_PR_SET_PDEATHSIG, sigkill, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the signal was armed
            os.kill(os.getpid(), sigkill)
        # The child starts with the stop signals deliverable, whatever the
        # parent held while it started it (held_stop_signals).
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)

    return {"preexec_fn": arm}


@contextlib.contextmanager
def held_stop_signals() -> Iterator[None]:
    """SIGTERM and SIGINT held back (blocked) while a child is started and
    recorded, then delivered: a stop handler that raises (the demo's) can
    otherwise land between the fork and the caller keeping the child, which
    no clean-up would then stop. Only where ``die_with_parent`` arms the
    child, which unblocks them again in the child before exec."""
    if _PRCTL is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    # Blocking them in this thread is not enough where other threads run (a
    # test runner's worker has some): the kernel hands a process's signal to
    # a thread that does not block it, and Python then runs the handler in
    # this thread at once. So the handlers are swapped too: what arrives is
    # noted, and raised again once the child is kept.
    arrived: list[int] = []

    def hold(signum: int, _frame: FrameType | None) -> None:
        arrived.append(signum)

    handlers = {sig: signal.signal(sig, hold) for sig in STOP_SIGNALS}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        # The mask first, and whatever happens: a signal another thread took
        # runs its Python handler between any two bytecodes here, and once
        # the caller's handler is back, that handler may raise (the demo's
        # does). Restored after the handlers, such a raise left the stop
        # signals blocked for good (seen in the suite: every later SIGTERM
        # of that process was ignored). One still pending goes to ``hold``.
        try:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        finally:
            _restore_handlers(handlers)
        for signum in dict.fromkeys(arrived):
            signal.raise_signal(signum)


def _restore_handlers(handlers: Mapping[signal.Signals, Any]) -> None:
    """Put every handler back, even if a signal's handler raises midway
    (the first such error is raised once all are back)."""
    error: BaseException | None = None
    for sig, handler in handlers.items():
        for _attempt in range(3):  # a raising handler runs once per signal pending
            try:
                signal.signal(sig, handler)
                break
            except BaseException as exc:  # noqa: BLE001 - raised between bytecodes: put this one back still
                error = error or exc
    if error is not None:
        raise error


def end_with_parent(parent: int, sig: signal.Signals = signal.SIGKILL) -> None:
    """Have the kernel send ``sig`` to this process when ``parent`` (the pid
    that forked it) dies: for processes forked without exec (dramatiq's
    worker processes, armed as they import their broker), so a main process
    killed outright leaves no worker consuming on its own. A parent already
    gone by the time this runs gets ``sig`` at once. Linux only; elsewhere
    nothing."""
    if _PRCTL is None:
        return
    if os.getppid() != parent:
        if _exists(parent):
            return  # forked by another process (a fork server): nothing to arm against
        os.kill(os.getpid(), int(sig))  # it died before the signal could be armed
    _PRCTL(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    if os.getppid() != parent:  # it died while the signal was armed
        os.kill(os.getpid(), int(sig))


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def reap(proc: subprocess.Popen[Any] | None, timeout_s: float) -> None:
    """Wait for a child (told to end already); SIGKILL it if it outlives ``timeout_s``."""
    if proc is None:
        return
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
