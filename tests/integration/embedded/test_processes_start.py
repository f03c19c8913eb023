"""A stop signal that raises (the demo's) while the kit starts a process is
held back until the process is kept, so the clean-up finds and stops it; the
process itself starts with the stop signals deliverable."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

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
