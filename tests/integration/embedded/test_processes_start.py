"""A stop signal that raises (the demo's) while the kit starts a process is
held back until the process is kept, so the clean-up finds and stops it; the
process itself starts with the stop signals deliverable."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

from ingest.children import held_stop_signals
from ingest.embedded.processes import Processes, SwitchboardProcess


class Stopped(Exception):
    pass


def _blocked_signals(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigBlk:"):
            return int(line.split()[1], 16)
    raise AssertionError(f"no SigBlk in /proc/{pid}/status")


def test_a_stop_signal_landing_as_a_process_starts_waits_until_it_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    processes = Processes(tmp_path)
    started = SwitchboardProcess.__init__

    def start_then_signalled(self: SwitchboardProcess, *args: Any, **kwargs: Any) -> None:
        started(self, *args, **kwargs)
        # The signal lands after the fork, before Processes.start has kept
        # the process: the window the demo's SIGTERM once fell into.
        os.kill(os.getpid(), signal.SIGTERM)

    def on_signal(_signum: int, _frame: FrameType | None) -> None:
        raise Stopped

    monkeypatch.setattr(SwitchboardProcess, "__init__", start_then_signalled)
    previous = signal.signal(signal.SIGTERM, on_signal)
    try:
        with pytest.raises(Stopped):
            processes.start("status", tmp_path / "missing.toml", name="status")
        assert len(processes.all) == 1, "the process was started but not kept: nothing would stop it"
        (proc,) = processes.all
        stop_mask = (1 << (signal.SIGTERM - 1)) | (1 << (signal.SIGINT - 1))
        assert _blocked_signals(proc.pid) & stop_mask == 0  # its own stop signals work
        assert _blocked_signals(os.getpid()) & stop_mask == 0  # and ours again
    finally:
        signal.signal(signal.SIGTERM, previous)
        processes.kill_all()


def test_a_stop_signal_another_thread_receives_waits_too() -> None:
    """Blocking the signals in the starting thread holds back nothing where
    another thread runs: the kernel hands the signal to that thread, and
    Python runs the handler in the main thread at once (it failed so under
    pytest-xdist, whose workers run threads of their own). Sent to such a
    thread here, on purpose: the handler runs only after the block."""
    calls: list[int] = []
    seen_inside: list[int] = []
    release = threading.Event()
    other = threading.Thread(target=release.wait, args=(10,), name="other")
    other.start()  # before the block: it does not block the signals
    previous = signal.signal(signal.SIGTERM, lambda signum, _frame: calls.append(signum))
    try:
        with held_stop_signals():
            assert other.ident is not None
            signal.pthread_kill(other.ident, signal.SIGTERM)
            deadline = time.monotonic() + 1
            while time.monotonic() < deadline:  # bytecodes run: a handler due would run among them
                seen_inside += calls
        assert seen_inside == []
        assert calls == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)
        release.set()
        other.join(10)


def test_a_handler_raising_while_the_hold_ends_leaves_no_signal_blocked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A signal another thread took runs its Python handler between any two
    bytecodes: once the caller's raising handler is back, it may raise in
    the middle of the hold's clean-up. The stop signals must not stay
    blocked then (they did: every later SIGTERM of the process was ignored),
    and every handler must be back."""

    def on_signal(_signum: int, _frame: FrameType | None) -> None:
        raise Stopped

    real_signal = signal.signal
    raised: list[int] = []

    def restoring_then_raising(sig: int, handler: Any) -> Any:
        previous = real_signal(sig, handler)
        if handler is on_signal and not raised:
            raised.append(sig)
            raise Stopped  # as if that handler ran right after it was put back
        return previous

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    real_signal(signal.SIGTERM, on_signal)
    real_signal(signal.SIGINT, on_signal)
    try:
        monkeypatch.setattr(signal, "signal", restoring_then_raising)
        with pytest.raises(Stopped), held_stop_signals():
            pass
        monkeypatch.undo()
        stop_mask = (1 << (signal.SIGTERM - 1)) | (1 << (signal.SIGINT - 1))
        assert _blocked_signals(os.getpid()) & stop_mask == 0
        assert signal.getsignal(signal.SIGTERM) is on_signal
        assert signal.getsignal(signal.SIGINT) is on_signal
    finally:
        monkeypatch.undo()
        for sig, handler in before.items():
            real_signal(sig, handler)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT})
