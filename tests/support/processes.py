"""The suite's layer over the kit's process driver (``ingest.embedded.processes``):
strict processes, the planted secret, and what a clean exit looks like."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

from ingest.embedded import processes
from ingest.embedded.processes import SwitchboardProcess, wait_for

# Planted in every URL the processes get; it must never reach a log line.
# It is also the real password of the servers the suite starts itself
# (tests/support/servers.py), so it is made afresh for each run: the
# embedded servers accept no login without it.
SECRET = f"planted-s3cret-{secrets.token_hex(8)}"


def with_secret_db(url: str) -> str:
    # The suite's own servers' URLs carry SECRET already; a trusting server's
    # (from the environment) carries it unused.
    return url.replace("postgres@", f"postgres:{SECRET}@", 1)


def with_secret_redis(url: str) -> str:
    # The suite's own servers' URLs carry SECRET already; a nopass default
    # user (from the environment) accepts any password.
    if "@" in url:
        return url
    return url.replace("redis://", f"redis://default:{SECRET}@", 1)


class Processes(processes.Processes):
    """Starts switchboard processes for a test (with -X dev and warnings as
    errors, no SWITCHBOARD_* variable of the caller's) and reaps every one."""

    def __init__(self, tmp_path: Path) -> None:
        super().__init__(tmp_path, strict=True)

    def assert_no_secret_logged(self) -> None:
        assert SECRET not in self.logs_text()


def error_lines(result: subprocess.CompletedProcess[str]) -> list[str]:
    """What a command said on stderr, line by line, less asyncio's own
    warning that one step of a task took over 0.1 s: -X dev (as the suite
    runs every process) turns it on, and a loaded machine's imports inside
    the loop's first step trip it (seen in full runs, never the command's
    output)."""
    return [line for line in result.stderr.splitlines() if not _slow_step_in_dev_mode(line)]


def _slow_step_in_dev_mode(line: str) -> bool:
    return line.startswith('{"event": "Executing <') and " took " in line and '"level": "warning"' in line


def assert_clean_exit(proc: SwitchboardProcess, code: int) -> None:
    """Exit 0 means no task or thread outlived the run (the CLI checks both);
    -X dev and -W error make unclosed resources loud."""
    text = proc.raw_log()
    assert code == 0, f"exit {code}\n{text[-3000:]}"
    for bad in ("Traceback", "Exception ignored", "ResourceWarning", "tasks_leaked", "threads_leaked"):
        assert bad not in text, f"{bad!r} in {proc.log_path}:\n{text[-3000:]}"


def terminate_cleanly(proc: SwitchboardProcess) -> None:
    assert_clean_exit(proc, proc.terminate())


def stop_settled(
    running: Iterable[SwitchboardProcess],
    settled: Callable[[], bool],
    *,
    what: str,
    stop: Callable[[SwitchboardProcess], None] = terminate_cleanly,
) -> None:
    """Stop a converged run as an operator would: the ingesters first (each
    stores the batch it holds before it exits), then, once ``settled`` holds
    again, the others (the acker among them).

    With the ingesters running, ``settled`` can hold for a moment while one
    of them still holds entries the acker acked meanwhile: its own pending
    entries re-read after a restart or a broker or store error (a rewind),
    or entries taken over from a killed ingester.
    Storing them asks their acks again (a redelivered message's intent is
    re-armed: the broker may hold it again, and a second ack is harmless),
    so only a check after the last store proves every intent discharged. A
    CI run once stopped the acker inside that window and found 100 intents
    pending."""
    running = list(running)
    for proc in running:
        if proc.verb == "ingest":
            stop(proc)
    wait_for(settled, timeout_s=60, interval_s=0.2, what=f"{what}, the ingesters stopped")
    for proc in running:
        if proc.verb != "ingest":
            stop(proc)


def switchboard(
    *args: str, env: dict[str, str] | None = None, timeout_s: float = 60
) -> subprocess.CompletedProcess[str]:
    """One CLI command, run to its end, strict, without the caller's SWITCHBOARD_* variables."""
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("SWITCHBOARD_")}
    return subprocess.run(
        [sys.executable, *processes.STRICT_FLAGS, "-m", "ingest", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env={**base_env, **(env or {})},
    )
