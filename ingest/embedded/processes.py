"""Real ``switchboard`` processes, driven from Python: the one process driver of
the demo, the system tests and the benchmarks.

Each process is ``python -m ingest --config <file> <verb>``, its output (JSON
log lines) kept in a file, and it is always waited for. Every wait is bounded:
``wait_for`` polls a condition until a deadline, never sleeping and hoping.
A process started from the main thread is SIGKILLed if this one dies
(``ingest.children``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from ingest.children import die_with_parent, held_stop_signals

PROCESS_TIMEOUT_S = 30.0

# -X dev (asyncio debug mode, loud unclosed resources) and warnings as errors,
# as the test suite runs every switchboard process.
STRICT_FLAGS = ("-X", "dev", "-W", "error")


class WaitTimedOut(TimeoutError, AssertionError):
    """A bounded wait ran out. A TimeoutError to a program; to pytest, a failed
    assertion (the condition a test waited for never held)."""


def wait_for(predicate: Callable[[], Any], *, timeout_s: float, what: str, interval_s: float = 0.05) -> Any:
    """Poll a condition every ``interval_s`` until it holds and return its value;
    raise ``WaitTimedOut`` naming ``what`` at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise WaitTimedOut(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(interval_s)


class SwitchboardProcess:
    """One ``switchboard <verb>`` child process with its log file.

    ``strict`` runs it with ``STRICT_FLAGS``. The caller's ``SWITCHBOARD_*``
    variables are left out of its environment, so only the config file (and
    ``env``, ``failpoints``) configure it: an exported production
    ``SWITCHBOARD_DATABASE_URL`` would otherwise override the config's.
    ``command`` runs another installation's ``switchboard`` (a wheel's, from
    ``cwd``, without the variables in ``drop_env``) instead of this
    interpreter's ``-m ingest``.
    """

    def __init__(
        self,
        verb: str,
        config: Path,
        log_path: Path,
        *,
        consumer: str | None = None,
        failpoints: str | None = None,
        env: Mapping[str, str] | None = None,
        strict: bool = False,
        command: Sequence[str] | None = None,
        cwd: Path | None = None,
        drop_env: Collection[str] = (),
        args: Sequence[str] = (),
    ) -> None:
        self.verb = verb
        self.log_path = log_path
        argv = list(command or [sys.executable, *(STRICT_FLAGS if strict else ()), "-m", "ingest"])
        argv += ["--config", str(config), verb]
        if consumer:
            argv += ["--consumer", consumer]
        argv += args
        full_env = {
            k: v for k, v in os.environ.items() if not k.startswith("SWITCHBOARD_") and k not in drop_env
        }
        full_env.update(env or {})
        if failpoints:
            full_env["SWITCHBOARD_FAILPOINTS"] = failpoints
        self._log_file = log_path.open("ab")
        self.proc = subprocess.Popen(  # noqa: S603 - our own interpreter and package
            argv, stdout=self._log_file, stderr=subprocess.STDOUT, env=full_env, cwd=cwd, **die_with_parent()
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """kill -9: no cleanup of any kind runs."""
        if self.alive():
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=PROCESS_TIMEOUT_S)
        self._log_file.close()

    def signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def wait(self, timeout_s: float = PROCESS_TIMEOUT_S) -> int:
        code = self.proc.wait(timeout=timeout_s)
        self._log_file.close()
        return code

    def terminate(self, timeout_s: float = PROCESS_TIMEOUT_S) -> int:
        """SIGTERM once the process can take it gracefully: its first log line
        ("starting") comes after its signal handlers are in place. Before the
        interpreter reaches our code, SIGTERM kills with the default action."""
        wait_for(
            lambda: not self.alive() or '"starting"' in self.raw_log(),
            timeout_s=timeout_s,
            what=f"{self.log_path.name} to start",
        )
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
        return self.wait(timeout_s)

    def stop(self, timeout_s: float = PROCESS_TIMEOUT_S) -> int:
        """``terminate``, and SIGKILL if the process has not exited by then; the exit code."""
        try:
            return self.terminate(timeout_s)
        except (WaitTimedOut, subprocess.TimeoutExpired):
            self.kill()
            return self.proc.returncode

    def ensure_dead(self) -> None:
        if self.alive():
            self.proc.kill()
            self.proc.wait(timeout=PROCESS_TIMEOUT_S)
        self._log_file.close()

    def logs(self) -> list[dict[str, Any]]:
        out = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                out.append({"event": "<raw>", "raw": line})
        return out

    def events(self, name: str) -> list[dict[str, Any]]:
        return [e for e in self.logs() if e.get("event") == name]

    def raw_log(self) -> str:
        return self.log_path.read_text(errors="replace")


def wait_ready(proc: SwitchboardProcess, timeout_s: float = 30) -> None:
    """Until the process has installed its signal handlers and is working: a
    SIGTERM before the interpreter has even started our code kills it outright."""
    event = {"ingest": "poll_loop_started", "worker": "worker_ready"}.get(proc.verb, "listening")
    wait_for(lambda: proc.events(event), timeout_s=timeout_s, what=f"{proc.log_path.name}: {event}")


class Processes:
    """Starts switchboard processes with their logs in ``log_dir`` (one file per
    name and incarnation, ``<name>.<n>.log``) and keeps every one, to reap."""

    def __init__(self, log_dir: Path, *, strict: bool = False) -> None:
        self._log_dir = log_dir
        self._strict = strict
        self.all: list[SwitchboardProcess] = []

    def start(
        self,
        verb: str,
        config: Path,
        *,
        name: str,
        failpoints: str | None = None,
        env: Mapping[str, str] | None = None,
        args: Sequence[str] = (),
    ) -> SwitchboardProcess:
        """An ingester is started with ``name`` as its consumer name; ``args``
        follow the verb (``web``'s ``--listen``)."""
        incarnation = sum(1 for p in self.all if p.log_path.name.startswith(f"{name}."))
        # A stop signal that raises (the demo's) waits until the process is
        # kept in ``all``, where the clean-up finds it.
        with held_stop_signals():
            proc = SwitchboardProcess(
                verb,
                config,
                self._log_dir / f"{name}.{incarnation}.log",
                consumer=name if verb == "ingest" else None,
                failpoints=failpoints,
                env=env,
                strict=self._strict,
                args=args,
            )
            self.all.append(proc)
        return proc

    def logs_text(self) -> str:
        return "".join(p.raw_log() for p in self.all)

    def stop_all(self, timeout_s: float = PROCESS_TIMEOUT_S) -> None:
        """``stop`` every process still running."""
        for proc in self.all:
            if proc.alive():
                proc.stop(timeout_s)

    def kill_all(self) -> None:
        """``ensure_dead`` every process."""
        for proc in self.all:
            proc.ensure_dead()
