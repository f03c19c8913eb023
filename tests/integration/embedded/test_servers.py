"""The embedded servers of the demo, the tests and the bench
(ingest/embedded/servers.py), started for real."""

from __future__ import annotations

import errno
import os
import pwd
import secrets
import shutil
import socket
import subprocess
import threading
from pathlib import Path

import psycopg
import pytest
import redis

from backhalf.db import libpq_url
from ingest.embedded import servers
from tests.support.db import scalar


def test_postgres_starts_from_binaries_only_their_owner_can_reach(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A clone in root's home directory (0700) holds the virtual environment,
    and so pgserver's binaries, where PostgreSQL's own user (when we run as
    root) cannot reach them. The server still starts, and its base
    directory, copy included, is gone after cleanup."""
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    original = servers.postgres_bindir()
    # The installation as pip lays it out: <package>/<installation>/bin, with
    # the libraries auditwheel vendored beside the package.
    site = home / "site-packages"
    installation, package = original.parent, original.parent.parent
    shutil.copytree(installation, site / package.name / installation.name, symlinks=True)
    if (vendored := package.parent / f"{package.name}.libs").is_dir():
        shutil.copytree(vendored, site / vendored.name, symlinks=True)
    bindir = site / package.name / installation.name / original.name
    monkeypatch.setattr(servers, "postgres_bindir", lambda: bindir)
    base = servers.temp_base("switchboard-test-private-")
    try:
        pg = servers.PostgresServer.create(base / "pg")
        try:
            pg.start()
            assert scalar(pg.create_database("reachable"), "SELECT 1") == 1
        finally:
            pg.cleanup()
        assert not (base / "pg").exists()
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.parametrize("kind", ["redis", "postgres"])
def test_a_port_taken_before_the_first_start_is_traded_for_another(kind: str) -> None:
    """free_port's answer is a moment old: another process may bind the port
    before the server does. The first start moves to a new port (the demo
    and the tests failed with "Address already in use" instead)."""
    base = servers.temp_base("switchboard-test-port-")
    try:
        server = (
            servers.RedisServer.create(base / "redis")
            if kind == "redis"
            else servers.PostgresServer.create(base / "pg")
        )
        taken = server.port
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as squatter:
            squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                squatter.bind(("127.0.0.1", taken))
                squatter.listen()
            except OSError as exc:
                # Another process (the other test worker) took it first:
                # taken all the same, which is the case under test.
                if exc.errno != errno.EADDRINUSE:
                    raise
            try:
                server.start()
                assert server.port != taken
                assert server.running
            finally:
                server.stop()
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _others_may(path: Path) -> int:
    """The permission bits ``path`` grants its group and other users."""
    return path.lstat().st_mode & 0o077


def test_the_servers_take_no_login_without_their_password_and_keep_their_files_private() -> None:
    """On a shared machine any local user can reach loopback: each server
    needs its generated password, which only the URLs handed out carry; and
    nothing the servers or the kit write (data, the AOF, the logs, the
    config with the password) is readable by anyone else."""
    with servers.embedded_servers("switchboard-test-private-") as owned:
        pg, rs = owned.postgres, owned.redis
        # The URLs handed out work, password included.
        with psycopg.connect(libpq_url(pg.url()), connect_timeout=5) as conn:
            assert conn.execute("SELECT current_user").fetchone() == ("postgres",)
        with redis.Redis.from_url(rs.url, socket_timeout=5) as r:
            r.xadd("orders", {"body": "{}"})  # something in the AOF
            assert r.xlen("orders") == 1
        # Without the password (or with another one) both refuse.
        for password in (None, "not-the-password"):
            with pytest.raises(
                psycopg.OperationalError, match=r"no password supplied|password authentication failed"
            ):
                psycopg.connect(
                    host="127.0.0.1", port=pg.port, user="postgres", password=password, connect_timeout=5
                ).close()
        anonymous = redis.Redis(host="127.0.0.1", port=rs.port, socket_timeout=5)
        with anonymous, pytest.raises(redis.AuthenticationError):
            anonymous.ping()
        wrong = redis.Redis(host="127.0.0.1", port=rs.port, password="not-the-password", socket_timeout=5)
        with wrong, pytest.raises(redis.AuthenticationError):
            wrong.ping()
        # Neither password is on a command line (which every local user can read) or in a log.
        for server in (pg, rs):
            assert server.password is not None
            assert server.password.encode() not in Path(f"/proc/{server.pid}/cmdline").read_bytes()
        logs = (pg.log_path.read_text(errors="replace"), rs.log_path.read_text(errors="replace"))
        assert not any(server.password in text for server in (pg, rs) for text in logs if server.password)
        # The files the issue found world-readable, and every other one.
        aof = list((rs.base_dir / "appendonlydir").iterdir())
        assert aof
        assert all(path.exists() for path in (pg.log_path, rs.log_path, rs.config_path))
        # Under root PostgreSQL runs as a user of its own, who must pass through
        # the two directories above its data directory (but may not list them).
        traversed = {owned.base, pg.base_dir} if os.geteuid() == 0 else set()
        checked = 0
        for path in [owned.base, *owned.base.rglob("*")]:
            if "pginstall" in path.relative_to(owned.base).parts:
                continue  # a copy of the PostgreSQL binaries, readable by design (see servers.py)
            allowed = 0o011 if path in traversed else 0
            assert _others_may(path) & ~allowed == 0, f"{path}: mode {path.lstat().st_mode:o}"
            checked += 1
        assert checked > 20  # pgdata's files were walked, not an empty folder


def _status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {k: v.strip() for k, _, v in (line.partition(":") for line in lines)}


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if _status(int(entry.name)).get("PPid") == str(pid):
                found.append(int(entry.name))
        except OSError:
            continue  # gone meanwhile
    return found


@pytest.mark.skipif(os.geteuid() != 0, reason="PostgreSQL changes user only when started by root")
def test_under_root_postgres_runs_as_a_user_of_its_own_not_nobody() -> None:
    """Issue 32, item 9: the shared 'nobody' could signal the postmaster and
    read the data directory from any process of its; the dedicated system
    user is no one else's, has no login shell and no supplementary group."""
    with servers.embedded_servers("switchboard-test-pguser-") as owned:
        pg = owned.postgres
        user = pwd.getpwnam(servers.PG_SYSTEM_USER)
        assert user.pw_uid not in (0, pwd.getpwnam("nobody").pw_uid)
        assert user.pw_gid != 0
        assert user.pw_shell.endswith("nologin")
        with psycopg.connect(libpq_url(pg.url()), connect_timeout=5) as conn:
            backend = conn.info.backend_pid
            for pid in (pg.pid, backend, *_children(pg.pid)):
                status = _status(pid)
                assert status["Uid"].split() == [str(user.pw_uid)] * 4, (pid, status["Uid"])
                assert status["Gid"].split() == [str(user.pw_gid)] * 4, (pid, status["Gid"])
                assert status["Groups"] == "", (pid, status["Groups"])
        for path in (pg.pgdata, *pg.pgdata.iterdir()):
            assert path.lstat().st_uid == user.pw_uid, path
        assert pg.base_dir.lstat().st_uid == 0  # the kit's own directory stays root's


@pytest.mark.skipif(os.geteuid() != 0, reason="creating a system user needs root")
def test_the_system_user_is_made_once_however_many_processes_ask_at_once() -> None:
    """Test sessions side by side may each find the user missing: one makes
    it, the others' useradd fails (user exists, or /etc/passwd locked), and
    every one of them goes on. A throwaway name, removed after."""
    name = f"sb-pg-test-{secrets.token_hex(3)}"
    errors: list[BaseException] = []

    def make() -> None:
        try:
            servers._useradd(name)
        except BaseException as exc:  # raised again in the test's thread below
            errors.append(exc)

    threads = [threading.Thread(target=make) for _ in range(4)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(servers.USERADD_TIMEOUT_S + 10)
        assert not any(t.is_alive() for t in threads)
        assert errors == []
        made = pwd.getpwnam(name)
        assert made.pw_uid != 0
        assert made.pw_dir == "/nonexistent"
    finally:
        subprocess.run(["userdel", name], capture_output=True, timeout=30, check=False)
