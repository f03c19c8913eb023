"""A real RabbitMQ broker on loopback, owned by Python.

No wheel ships RabbitMQ: this runs the Erlang broker of the system's package
(Debian's ``rabbitmq-server``; ``find_rabbitmq`` says whether it is there and
why not) as our child, as :mod:`ingest.embedded.nats_server` runs
nats-server: free ports, a private base directory (umask 077) holding the
config, the Mnesia database, the logs and the Erlang cookie, every wait
bounded, and every process dying with us. Never the system's service: not
systemd, not Debian's ``rabbitmq-script-wrapper`` (which changes to the
``rabbitmq`` user), so it runs the same as root or as anyone else.

The processes: ``epmd`` (Erlang's port mapper) on a port of its own
(``ERL_EPMD_PORT``), our child in the foreground, so it never meets the
system's epmd on 4369 and we hold its pid; and the broker, started through
the package's ``rabbitmq-server`` script with ``RABBITMQ_ALLOW_INPUT`` (the
script then ``exec``\\s the VM instead of waiting on it in a shell that traps
signals) and ``-noinput``, so the child's pid is ``beam.smp``'s own: SIGTERM
stops the broker cleanly, SIGKILL is a crash. The VM's helpers
(``erl_child_setup``, ``inet_gethost``) exit with it; ``stop`` and ``kill``
SIGKILL any that did not. ``-start_epmd false`` (``ERL_AFLAGS``, so for every
Erlang VM the broker starts too) means no VM ever starts an epmd of its own
behind our back. Each server has a node name of its own (``sb-<random>@localhost``),
AMQP, distribution and epmd ports of its own, all on 127.0.0.1, so two
servers (the suite's two workers) run side by side.

Access: users, the vhost ``/``, permissions and any queues come from a
definitions file the broker loads at boot (``load_definitions``; no slow
``rabbitmqctl`` calls), with passwords stored as salted SHA-256 hashes, so
no file holds a password and the broker never sees one but in a login. With
definitions to load, RabbitMQ seeds no ``guest`` user. The one user
``switchboard`` (every permission on ``/``) has a generated password; a
caller adds users of its own (``AmqpUser``: the least-privilege tests).
The password never goes into a log line or an exception's text.

Readiness: the broker listens on its AMQP port (its own socket, read from
``/proc``: no other process that took the port meanwhile) and answers the
protocol header with Connection.Start. Measured on this project's 2-core
machine (RabbitMQ 3.10.8, Erlang 25): the first start (a new database,
every feature flag enabled) takes 5 to 9 s, most often about 6 s (up to
13 s in a few runs); a restart (stop, then start
on the same database) 6 to 9 s; a SIGTERM stop 1 to 2.5 s; ``kill`` 30 ms.
Most of a start is the VM's and RabbitMQ's own boot, not this module's:
leaving the unused plugins out of the code path saved nothing.

``queue_counts`` reads a queue's figures from the broker itself
(``erl_call``, about 5 ms; ``rabbitmqctl eval`` when the Erlang package
lacks erl_call), unacked messages included, which AMQP does not tell;
``rabbitmqctl`` runs the CLI against the node (about 2 s a call: the CLI
boots a VM of its own), with the node's epmd and cookie and never an epmd
of its own (a bare ``rabbitmqctl`` starts ``epmd -daemon`` on 4369, which
outlives it).

TLS: a server made with ``tls`` (``AmqpTls``: certificate, key, CA file)
also listens for ``amqps://`` on a port of its own, ``tls_port``; clients'
certificates are not asked for. Readiness then waits for both listeners.

What RabbitMQ 3.10 does that a caller may not expect: ``consumer_timeout``
is checked on the channel's tick, once a minute by default, so a server
made with one also ticks every second (``channel_tick_interval`` in
``advanced.config``); a quorum queue's ``x-delivery-limit`` counts the
returns (nacks with requeue, or a channel closed with the message unacked),
after which the message is dropped or dead-lettered (``x-delivery-limit: 1``:
delivered twice); and a quorum queue counts a channel that holds a
``basic.get``'s message unacked as a consumer (its passive declare's
consumer_count too), a classic queue does not.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import struct
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

from ingest.children import die_with_parent, reap
from ingest.embedded.servers import (
    _PRIVATE_UMASK,
    PORT_ATTEMPTS,
    PortTaken,
    _log_size,
    _log_tail,
    _private_dir,
    _private_file,
    _SignalledServer,
    free_port,
    generate_password,
    log_since,
    spawn,
)

RABBITMQ_USER = "switchboard"
VHOST = "/"
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0
EPMD_TIMEOUT_S = 10.0
PROBE_TIMEOUT_S = 0.5
QUERY_TIMEOUT_S = 30.0
# A server given a consumer_timeout checks it this often (ms), not once a minute.
CHANNEL_TICK_MS = 1000
# The VM's helpers, after the VM itself has gone: how long they may take to follow.
_HELPERS_TIMEOUT_S = 5.0

# AMQP 0-9-1's protocol header, and the start of the server's answer: a
# method frame (1) on channel 0, then after its size, Connection.Start (10, 10).
AMQP_HEADER = b"AMQP\x00\x00\x09\x01"
_FRAME_METHOD, _CONNECTION_START = 1, (10, 10)

# Where the packages put the broker's own start script (not Debian's
# /usr/sbin/rabbitmq-server, which is the su wrapper).
_SERVER_SCRIPTS = (
    Path("/usr/lib/rabbitmq/bin/rabbitmq-server"),
    Path("/usr/local/lib/rabbitmq/bin/rabbitmq-server"),
)
_WRAPPER = "rabbitmq-script-wrapper"
# The caller's variables that would reconfigure the broker or its VM.
_FOREIGN_ENV = ("RABBITMQ_", "ERL_")
_FOREIGN_NAMES = ("NOTIFY_SOCKET", "detached")  # the script's systemd and detached modes

# "2026-12-03 00:33:59.847903+00:00 [error] <0.674.0> text" (RabbitMQ 3.9+).
_RABBIT_LINE = re.compile(r"^\S+ \S+ \[(?P<level>[a-z]+)\] <[\d.]+> (?P<text>.*)$")
_IN_USE = ("eaddrinuse", "address already in use", "in use by another node")


class RabbitMqMissing(RuntimeError):
    """The broker's programs are not installed; the text says which is missing."""


@dataclass(frozen=True)
class RabbitMqBinaries:
    server: Path  # the package's rabbitmq-server script
    rabbitmqctl: Path
    epmd: Path
    erl_call: Path | None  # fast queries; rabbitmqctl eval without it


def _resolve_server(candidate: Path) -> Path | None:
    if not os.access(candidate, os.X_OK):
        return None
    if candidate.resolve().name == _WRAPPER:  # Debian's su wrapper: its sibling is the script
        sibling = candidate.resolve().parent / "rabbitmq-server"
        return sibling if sibling.resolve().name != _WRAPPER and os.access(sibling, os.X_OK) else None
    return candidate


def find_rabbitmq() -> RabbitMqBinaries:
    """The broker's programs, or ``RabbitMqMissing`` saying what is missing
    (Debian: ``apt-get install rabbitmq-server``)."""
    on_path = shutil.which("rabbitmq-server")
    candidates = [*_SERVER_SCRIPTS, *([Path(on_path)] if on_path else [])]
    server = next((found for c in candidates if (found := _resolve_server(c)) is not None), None)
    if server is None:
        raise RabbitMqMissing(
            "no rabbitmq-server (looked in /usr/lib/rabbitmq/bin and on PATH):"
            " apt-get install rabbitmq-server"
        )
    rabbitmqctl = server.parent / "rabbitmqctl"
    if not os.access(rabbitmqctl, os.X_OK):
        raise RabbitMqMissing(f"no rabbitmqctl beside {server}")
    erl = shutil.which("erl")
    if erl is None:
        raise RabbitMqMissing("no erl (Erlang) on PATH, which rabbitmq-server runs: install erlang-base")
    erl_bin = Path(erl).resolve().parent  # /usr/bin/erl -> /usr/lib/erlang/bin/erl
    epmd = shutil.which("epmd") or next(
        (
            str(p)
            for p in (erl_bin / "epmd", *erl_bin.parent.glob("erts-*/bin/epmd"))
            if os.access(p, os.X_OK)
        ),
        None,
    )
    if epmd is None:
        raise RabbitMqMissing(f"no epmd on PATH or beside {erl_bin / 'erl'}")
    erl_call = next(
        (
            p
            for p in (erl_bin / "erl_call", *sorted(erl_bin.parent.glob("lib/erl_interface-*/bin/erl_call")))
            if os.access(p, os.X_OK)
        ),
        None,
    )
    return RabbitMqBinaries(server, rabbitmqctl, Path(epmd), erl_call)


def rabbitmq_missing() -> str | None:
    """Why no broker can be started here, or None when it can."""
    try:
        find_rabbitmq()
    except RabbitMqMissing as exc:
        return str(exc)
    return None


@dataclass(frozen=True)
class AmqpUser:
    """A user the broker loads at boot, with permissions on one vhost
    (regular expressions over resource names; "" grants nothing)."""

    name: str
    password: str = field(repr=False)
    configure: str = ""
    write: str = ""
    read: str = ""
    vhost: str = VHOST
    tags: tuple[str, ...] = ()


@dataclass(frozen=True)
class AmqpQueue:
    """A queue the broker declares at boot (``arguments``: e.g.
    ``{"x-queue-type": "quorum"}``)."""

    name: str
    durable: bool = True
    arguments: Mapping[str, Any] = field(default_factory=dict)
    vhost: str = VHOST


@dataclass(frozen=True)
class AmqpTls:
    """A TLS listener beside the plain one (``amqps://``), on a port of its
    own: the server's certificate, its key and the CA file the broker sends
    with its chain (readable by the broker). Clients' certificates are not
    asked for."""

    certfile: Path
    keyfile: Path
    cacertfile: Path

    def conf(self, port: int) -> str:
        return (
            f"listeners.ssl.default = 127.0.0.1:{port}\n"
            f"ssl_options.cacertfile = {self.cacertfile}\n"
            f"ssl_options.certfile = {self.certfile}\n"
            f"ssl_options.keyfile = {self.keyfile}\n"
            "ssl_options.verify = verify_none\n"
            "ssl_options.fail_if_no_peer_cert = false\n"
        )


def password_hash(password: str) -> str:
    """RabbitMQ's ``rabbit_password_hashing_sha256``: base64(salt + sha256(salt + password)),
    with a 4-byte random salt."""
    salt = secrets.token_bytes(4)
    return base64.b64encode(salt + hashlib.sha256(salt + password.encode()).digest()).decode()


def _definitions(users: Sequence[AmqpUser], queues: Sequence[AmqpQueue]) -> dict[str, Any]:
    vhosts = dict.fromkeys([VHOST, *(u.vhost for u in users), *(q.vhost for q in queues)])
    return {
        "users": [
            {
                "name": u.name,
                "password_hash": password_hash(u.password),
                "hashing_algorithm": "rabbit_password_hashing_sha256",
                "tags": list(u.tags),
                "limits": {},
            }
            for u in users
        ],
        "vhosts": [{"name": v} for v in vhosts],
        "permissions": [
            {"user": u.name, "vhost": u.vhost, "configure": u.configure, "write": u.write, "read": u.read}
            for u in users
        ],
        "queues": [
            {
                "name": q.name,
                "vhost": q.vhost,
                "durable": q.durable,
                "auto_delete": False,
                "arguments": dict(q.arguments),
            }
            for q in queues
        ],
        "exchanges": [],
        "bindings": [],
    }


def _listens(pid: int, port: int) -> bool:
    """True when process ``pid`` itself holds the listening socket on
    127.0.0.1:``port`` (Linux's /proc); True where /proc cannot tell."""
    if not Path("/proc/net/tcp").exists():
        return True
    try:
        table = Path("/proc/net/tcp").read_text().splitlines()[1:]
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:  # gone
        return False
    wanted = f"0100007F:{port:04X}"
    inodes = {fields[9] for line in table if (fields := line.split())[1] == wanted and fields[3] == "0A"}
    for fd in fds:
        with contextlib.suppress(OSError):
            if (target := os.readlink(fd)).startswith("socket:[") and target[8:-1] in inodes:
                return True
    return False


def _answers_amqp(port: int) -> bool:
    """True when 127.0.0.1:``port`` answers AMQP 0-9-1's header with Connection.Start."""
    reply = _exchange(port, AMQP_HEADER, 11)
    if reply is None:
        return False
    kind, channel, _size, class_id, method_id = struct.unpack(">BHIHH", reply)
    return kind == _FRAME_METHOD and channel == 0 and (class_id, method_id) == _CONNECTION_START


def _answers_epmd(port: int) -> bool:
    """True when 127.0.0.1:``port`` answers epmd's NAMES_REQ with its own port."""
    reply = _exchange(port, b"\x00\x01n", 4)
    return reply is not None and bool(struct.unpack(">I", reply)[0] == port)


def _exchange(port: int, request: bytes, size: int) -> bytes | None:
    """The first ``size`` bytes 127.0.0.1:``port`` answers ``request`` with;
    None when it closes before. OSError (a timeout among them) as the socket
    raises it."""
    with socket.create_connection(("127.0.0.1", port), timeout=PROBE_TIMEOUT_S) as sock:
        sock.sendall(request)
        reply = b""
        while len(reply) < size:
            chunk = sock.recv(size - len(reply))
            if not chunk:
                return None
            reply += chunk
    return reply


def _rabbit_reason(text: str) -> str:
    """The broker's own error lines in ``text`` (its log, or what the VM
    printed before the log was set up), on one line: an error spread over
    several log lines (an Erlang term) is joined, each cut to 300 characters."""
    reasons: list[str] = []
    continued = False
    for line in text.splitlines():
        if (m := _RABBIT_LINE.match(line)) is not None:
            serious = m["level"] in ("error", "critical", "alert", "emergency")
            if serious and continued and m["text"][:1].isspace():
                reasons[-1] += " " + m["text"].strip()
            elif serious:
                reasons.append(m["text"].strip())
            continued = serious
        elif line.strip().startswith(("ERROR", "Error", "BOOT FAILED", "epmd:", '{"init terminating')):
            reasons.append(line.strip())
            continued = False
    if not reasons:
        reasons = [line.strip() for line in text.splitlines() if line.strip()][-1:]
    cut = [" ".join(r.split())[:300] for r in reasons if r.strip()]
    # The first error says what went wrong, the crash reports after it how
    # the VM went down: the first, and the next two that call themselves errors.
    chosen = cut[:1] + [r for r in cut[1:] if "error" in r.lower()][:2]
    return "; ".join(dict.fromkeys(chosen)) or "nothing in its logs"


def _descendants(pid: int) -> list[tuple[int, str]]:
    """The processes below ``pid`` (Linux's /proc), each with its start time."""
    children: dict[int, list[int]] = {}
    started: dict[int, str] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
            children.setdefault(int(fields[1]), []).append(int(entry.name))
            started[int(entry.name)] = fields[19]
    found, todo = [], list(children.get(pid, []))
    while todo:
        child = todo.pop()
        found.append((child, started[child]))
        todo += children.get(child, [])
    return found


def _alive(pid: int, started: str) -> bool:
    """``pid`` is still the process that started at ``started``, and not a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return False
    return fields[0] != "Z" and fields[19] == started


def _kill_leftovers(helpers: list[tuple[int, str]]) -> None:
    """SIGKILL the VM's helpers that outlived it; wait (bounded) until they are gone."""
    deadline = time.monotonic() + _HELPERS_TIMEOUT_S
    while left := [(pid, t) for pid, t in helpers if _alive(pid, t)]:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the broker's helper processes {[pid for pid, _ in left]} outlived it")
        for pid, _ in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.02)


def _erl_binary(text: str) -> str:
    """``text`` as an Erlang binary literal of its UTF-8 bytes (no quoting to get wrong)."""
    return "<<" + ",".join(str(b) for b in text.encode()) + ">>"


class RabbitMqServer(_SignalledServer):
    """One RabbitMQ node and its epmd, in the foreground as our children."""

    _label, _serving_as = "RabbitMQ", "answering AMQP"
    _poll_s = 0.1

    def __init__(
        self,
        base_dir: Path,
        binaries: RabbitMqBinaries,
        password: str,
        *,
        port: int,
        dist_port: int,
        epmd_port: int,
        tls: AmqpTls | None = None,
    ) -> None:
        self.base_dir, self.binaries, self.password = base_dir, binaries, password
        self.port, self.dist_port, self.epmd_port = port, dist_port, epmd_port
        self.tls = tls
        self.tls_port: int | None = free_port() if tls is not None else None
        self._conf = ""  # rabbitmq.conf but the TLS listener (see _write_config)
        self.node = f"sb-{secrets.token_hex(4)}@localhost"
        self.config_path = base_dir / "rabbitmq.conf"
        self.advanced_config_path = base_dir / "advanced.config"
        self.definitions_path = base_dir / "definitions.json"
        self.log_path = base_dir / "rabbitmq.log"  # the broker's log
        self.console_path = base_dir / "console.log"  # what the VM prints (before its log is set up)
        self.epmd_log_path = base_dir / "epmd.log"
        self._proc: subprocess.Popen[bytes] | None = None
        self._epmd: subprocess.Popen[bytes] | None = None

    @classmethod
    def create(
        cls,
        base_dir: Path,
        *,
        password: str | None = None,
        users: Sequence[AmqpUser] = (),
        queues: Sequence[AmqpQueue] = (),
        consumer_timeout_ms: int | None = None,
        conf: str = "",
        tls: AmqpTls | None = None,
    ) -> RabbitMqServer:
        """Write the config, definitions and cookie for free ports in
        ``base_dir`` (created 0700); not started. ``users`` and ``queues``
        join the ``switchboard`` user in the definitions; ``consumer_timeout_ms``
        is the broker's ``consumer_timeout``; ``conf``: lines appended to
        rabbitmq.conf; ``tls``: a TLS listener too, on ``tls_port``."""
        binaries = find_rabbitmq()
        base_dir = Path(base_dir).resolve()
        _private_dir(base_dir)
        server = cls(
            base_dir,
            binaries,
            password or generate_password(),
            port=free_port(),
            dist_port=free_port(),
            epmd_port=free_port(),
            tls=tls,
        )
        everything = AmqpUser(RABBITMQ_USER, server.password, ".*", ".*", ".*", tags=("administrator",))
        with _private_file(server.definitions_path, "w") as f:  # password hashes
            json.dump(_definitions([everything, *users], queues), f, indent=1)
        lines = [
            "# ingest.embedded.rabbitmq_server: the listener comes from the environment",
            f"load_definitions = {server.definitions_path}",
            "log.console = false",
            "log.file.level = info",
        ]
        advanced = []
        if consumer_timeout_ms is not None:
            lines.append(f"consumer_timeout = {consumer_timeout_ms}")
            advanced.append(f"{{channel_tick_interval, {min(CHANNEL_TICK_MS, consumer_timeout_ms)}}}")
        server._conf = "\n".join(lines) + "\n" + (conf.rstrip("\n") + "\n" if conf else "")
        server._write_config()
        with _private_file(server.advanced_config_path, "w") as f:
            f.write(f"[{{rabbit, [{', '.join(advanced)}]}}].\n")
        with _private_file(base_dir / "enabled_plugins", "w") as f:
            f.write("[].\n")
        with _private_file(base_dir / "rabbitmq-env.conf", "w"):
            pass  # in place of /etc/rabbitmq/rabbitmq-env.conf
        cookie = base_dir / ".erlang.cookie"  # Erlang reads it from $HOME, 0400 or 0600
        with _private_file(cookie, "w") as f:
            f.write(secrets.token_hex(20))
        cookie.chmod(0o400)
        return server

    def _write_config(self) -> None:
        """rabbitmq.conf: what ``create`` made, and the TLS listener on its
        port of the moment (the plain one comes from the environment)."""
        tls = self.tls.conf(self.tls_port) if self.tls is not None and self.tls_port is not None else ""
        with _private_file(self.config_path, "w") as f:
            f.write(self._conf + tls)

    def __repr__(self) -> str:
        return f"RabbitMqServer(node={self.node!r}, port={self.port}, base_dir={str(self.base_dir)!r})"

    @property
    def url(self) -> str:
        """The ``switchboard`` user's URL on vhost ``/``, password included:
        redact it before showing it (``display_url``)."""
        return self.url_as(RABBITMQ_USER, self.password)

    @property
    def display_url(self) -> str:
        """``url`` without the password, to show."""
        return f"amqp://{RABBITMQ_USER}@127.0.0.1:{self.port}/"

    def url_as(self, user: str, password: str) -> str:
        return f"amqp://{quote(user, safe='')}:{quote(password, safe='')}@127.0.0.1:{self.port}/"

    def tls_url_as(self, user: str, password: str) -> str:
        """``amqps://`` to the TLS listener (a server made with ``tls``)."""
        if self.tls_port is None:
            raise RuntimeError(f"{self!r} has no TLS listener")
        return f"amqps://{quote(user, safe='')}:{quote(password, safe='')}@127.0.0.1:{self.tls_port}/"

    @property
    def epmd_pid(self) -> int | None:
        return self._epmd.pid if self._epmd is not None and self._epmd.poll() is None else None

    def _env(self) -> dict[str, str]:
        env = {
            k: v for k, v in os.environ.items() if not k.startswith(_FOREIGN_ENV) and k not in _FOREIGN_NAMES
        }
        return env | {
            "HOME": str(self.base_dir),  # the cookie; Erlang needs a HOME, root's included
            "ERL_EPMD_PORT": str(self.epmd_port),
            "ERL_AFLAGS": "-start_epmd false",
        }

    def _broker_env(self) -> dict[str, str]:
        base = self.base_dir
        return self._env() | {
            "RABBITMQ_ALLOW_INPUT": "true",  # the script execs the VM (-noinput is our argument)
            "RABBITMQ_NODENAME": self.node,
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": "-kernel inet_dist_use_interface {127,0,0,1}",
            "RABBITMQ_CONF_ENV_FILE": str(base / "rabbitmq-env.conf"),
            "RABBITMQ_CONFIG_FILE": str(self.config_path),
            "RABBITMQ_ADVANCED_CONFIG_FILE": str(self.advanced_config_path),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(base / "enabled_plugins"),
            "RABBITMQ_MNESIA_BASE": str(base / "mnesia"),
            "RABBITMQ_LOG_BASE": str(base / "log"),
            "RABBITMQ_LOGS": str(self.log_path),
        }

    def start(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Start epmd (if it is not running) and the broker, and wait until
        the broker answers AMQP on its port. On the first start only, ports
        taken meanwhile are traded for others (a restart keeps them: clients
        know them)."""
        if self.running:
            return
        self._start_epmd()
        self._start_serving(timeout_s)

    def _log_mark(self) -> tuple[int, int]:
        return _log_size(self.log_path), _log_size(self.console_path)

    def _spawn(self) -> subprocess.Popen[bytes]:
        with _private_file(self.console_path) as console:
            return spawn(
                [str(self.binaries.server), "-noinput"],
                self.base_dir,
                stdout=console,
                stderr=subprocess.STDOUT,
                env=self._broker_env(),
            )

    def _take_other_ports(self) -> None:
        self.port, self.dist_port = free_port(), free_port()
        if self.tls is not None:
            self.tls_port = free_port()
            self._write_config()

    def _serving(self, proc: subprocess.Popen[bytes]) -> bool:
        # The TLS listener, if any, starts beside the plain one: wait for both.
        tls_up = self.tls_port is None or _listens(proc.pid, self.tls_port)
        return _listens(proc.pid, self.port) and tls_up and _answers_amqp(self.port)

    def _exit_reason(self, mark: tuple[int, int]) -> tuple[bool, str]:
        said = log_since(self.log_path, mark[0]) + "\n" + log_since(self.console_path, mark[1])
        return any(s in said.lower() for s in _IN_USE), _rabbit_reason(said)

    def _where(self) -> str:
        return f"127.0.0.1:{self.port} (node {self.node})"

    def _tails(self) -> str:
        return (
            f"{self.log_path}:\n{_log_tail(self.log_path)}\n"
            f"{self.console_path}:\n{_log_tail(self.console_path, 15)}"
        )

    def _start_epmd(self) -> None:
        """Our own epmd, in the foreground, on ``epmd_port``: an epmd that
        finds its port taken says so and exits at once; on the first start
        it then moves to another port."""
        if self.epmd_pid is not None:
            return
        for attempt in range(1, PORT_ATTEMPTS + 1):
            offset = _log_size(self.epmd_log_path)
            with _private_file(self.epmd_log_path) as log:
                self._epmd = subprocess.Popen(  # noqa: S603 - the system's epmd, fixed arguments
                    [str(self.binaries.epmd), "-port", str(self.epmd_port), "-address", "127.0.0.1", "-d"],
                    cwd=self.base_dir,
                    env=self._env(),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    umask=_PRIVATE_UMASK,
                    **die_with_parent(),
                )
            deadline = time.monotonic() + EPMD_TIMEOUT_S
            while self._epmd.poll() is None:
                with contextlib.suppress(OSError):
                    if _listens(self._epmd.pid, self.epmd_port) and _answers_epmd(self.epmd_port):
                        return
                if time.monotonic() > deadline:
                    self._stop_epmd()
                    raise RuntimeError(
                        f"epmd not answering on 127.0.0.1:{self.epmd_port} after {EPMD_TIMEOUT_S}s;"
                        f" {self.epmd_log_path}:\n{_log_tail(self.epmd_log_path)}"
                    )
                time.sleep(0.02)
            said = log_since(self.epmd_log_path, offset)
            self._epmd = None
            if "already" in said and not self._started and attempt < PORT_ATTEMPTS:
                self.epmd_port = free_port()
                continue
            raise (PortTaken if "already" in said else RuntimeError)(
                f"epmd could not start on 127.0.0.1:{self.epmd_port}: {_rabbit_reason(said)}\n"
                f"{self.epmd_log_path}:\n{_log_tail(self.epmd_log_path)}"
            )

    def _stop_epmd(self) -> None:
        if self._epmd is not None and self._epmd.poll() is None:
            self._epmd.terminate()
        reap(self._epmd, 10)
        self._epmd = None

    def _end_broker(self, sig: signal.Signals, timeout_s: float) -> None:
        """Signal the VM, wait for it (SIGKILL after ``timeout_s``), then see
        its helpers gone."""
        if self._proc is None:
            return
        helpers = _descendants(self._proc.pid) if self._proc.poll() is None else []
        if self._proc.poll() is None:
            self._proc.send_signal(sig)
        reap(self._proc, timeout_s)
        self._proc = None
        _kill_leftovers(helpers)

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Stop the broker (SIGTERM: it closes its queues and message
        stores), SIGKILL if it outlives ``timeout_s``; then its epmd."""
        self._end_broker(signal.SIGTERM, timeout_s)
        self._stop_epmd()

    def kill(self) -> None:
        """SIGKILL the broker, like a crash; epmd stays (the node's entry
        goes with its connection)."""
        self._end_broker(signal.SIGKILL, 10)

    def restart(self) -> None:
        """Stop the broker and start it again on the same database and ports
        (durable queues and their persistent messages survive); epmd stays."""
        self._end_broker(signal.SIGTERM, STOP_TIMEOUT_S)
        self.start()

    def evaluate(self, expression: str, timeout_s: float = QUERY_TIMEOUT_S) -> str:
        """Run an Erlang expression (ending in ``.``) on the broker's node;
        the term it returns, as Erlang prints it."""
        env = self._env()
        if self.binaries.erl_call is not None:
            command = [str(self.binaries.erl_call), "-sname", self.node, "-e"]
            stdin: str | None = expression + "\n"
        else:
            command = [str(self.binaries.rabbitmqctl), "-n", self.node, "-q", "eval", expression]
            stdin = None
        try:
            done = subprocess.run(  # noqa: S603 - Erlang's own programs, arguments built here
                command, input=stdin, capture_output=True, text=True, timeout=timeout_s, env=env, check=False
            )
        except subprocess.TimeoutExpired as exc:
            raise RuntimeError(
                f"{Path(command[0]).name} on node {self.node} timed out after {timeout_s}s"
            ) from exc
        out = done.stdout.strip()
        if self.binaries.erl_call is not None and out.startswith("{ok, ") and out.endswith("}"):
            return out[5:-1]
        if self.binaries.erl_call is None and done.returncode == 0:
            return out
        said = out or done.stderr.strip()
        raise RuntimeError(f"{Path(command[0]).name} on node {self.node} (exit {done.returncode}): {said}")

    def rabbitmqctl(self, *args: str, timeout_s: float = QUERY_TIMEOUT_S) -> str:
        """Run ``rabbitmqctl -n NODE ARGS`` against the broker (its epmd and
        cookie: never starting an epmd of its own); what it printed. About
        2 s each (the CLI's own VM boots): ``evaluate`` is the fast way to ask."""
        command = [str(self.binaries.rabbitmqctl), "-n", self.node, *args]
        try:
            done = subprocess.run(  # noqa: S603 - the package's rabbitmqctl, arguments given by the caller
                command, capture_output=True, text=True, timeout=timeout_s, env=self._env(), check=False
            )
        except subprocess.TimeoutExpired as exc:
            raise RuntimeError(
                f"rabbitmqctl {args[:1]} on node {self.node} timed out after {timeout_s}s"
            ) from exc
        if done.returncode != 0:
            said = (done.stderr.strip() or done.stdout.strip()).splitlines()[-3:]
            raise RuntimeError(
                f"rabbitmqctl {' '.join(args[:1])} on node {self.node} (exit {done.returncode}): {said}"
            )
        return done.stdout

    def queue_counts(self, name: str, vhost: str = VHOST) -> tuple[int, int, int]:
        """(ready, unacked, consumers) of queue ``name``, from the queue
        itself (a quorum queue's from its Raft state: the figures its
        metrics show lag by seconds). ``LookupError`` when there is no such queue."""
        resource = f"rabbit_misc:r({_erl_binary(vhost)}, queue, {_erl_binary(name)})"
        expression = (
            f"case rabbit_amqqueue:lookup({resource}) of"
            " {ok, Q} -> case amqqueue:get_type(Q) of"
            " rabbit_quorum_queue ->"
            " {ok, {_, O}, _} = ra:local_query(amqqueue:get_pid(Q), fun rabbit_fifo:overview/1),"
            " {maps:get(num_ready_messages, O), maps:get(num_checked_out, O), maps:get(num_consumers, O)};"
            " _ -> [{_, R}, {_, U}, {_, C}] = rabbit_amqqueue:info(Q,"
            " [messages_ready, messages_unacknowledged, consumers]), {R, U, C} end;"
            " {error, not_found} -> not_found end."
        )
        out = self.evaluate(expression)
        if out == "not_found":
            raise LookupError(f"no queue {name!r} in vhost {vhost!r} on node {self.node}")
        match = re.fullmatch(r"\{(\d+),\s*(\d+),\s*(\d+)\}", out)
        if match is None:
            raise RuntimeError(f"unexpected answer for queue {name!r} on node {self.node}: {out}")
        ready, unacked, consumers = (int(g) for g in match.groups())
        return ready, unacked, consumers


def rabbitmq_server(base_dir: Path, **options: Any) -> contextlib.AbstractContextManager[RabbitMqServer]:
    """A :meth:`RabbitMqServer.create` (``options`` as it takes them),
    started in ``base_dir``; cleaned up on exit."""
    return RabbitMqServer.create(base_dir, **options).started()
