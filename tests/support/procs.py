"""Real ``switchboard`` processes for system tests: started with ``-X dev`` and
warnings as errors, logs kept as JSON lines, always reaped."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

PROCESS_TIMEOUT_S = 30.0


def wait_for(predicate: Callable[[], Any], *, timeout_s: float, what: str, interval_s: float = 0.05) -> Any:
    """Poll a condition until it holds; fail the test with ``what`` at the deadline.
    Waiting *for a condition* with a bound, never sleeping and hoping."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(interval_s)


class SwitchboardProcess:
    def __init__(
        self,
        verb: str,
        config: Path,
        log_path: Path,
        *,
        consumer: str | None = None,
        failpoints: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.verb = verb
        self.log_path = log_path
        argv = [sys.executable, "-X", "dev", "-W", "error", "-m", "ingest", "--config", str(config), verb]
        if consumer:
            argv += ["--consumer", consumer]
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("SWITCHBOARD_")}
        full_env.update(env or {})
        if failpoints:
            full_env["SWITCHBOARD_FAILPOINTS"] = failpoints
        self._log_file = log_path.open("ab")
        self.proc = subprocess.Popen(argv, stdout=self._log_file, stderr=subprocess.STDOUT, env=full_env)

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
