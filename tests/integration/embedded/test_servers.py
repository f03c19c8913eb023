"""The embedded servers of the demo, the tests and the bench
(ingest/embedded/servers.py), started for real."""

from __future__ import annotations

import shutil
import socket
from pathlib import Path

import pytest

from ingest.embedded import servers
from tests.support.db import scalar


def test_postgres_starts_from_binaries_only_their_owner_can_reach(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A clone in root's home directory (0700) holds the virtual environment,
    and so pgserver's binaries, where 'nobody' (PostgreSQL's user when we run
    as root) cannot reach them. The server still starts, and its base
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
            squatter.bind(("127.0.0.1", taken))
            squatter.listen()
            try:
                server.start()
                assert server.port != taken
                assert server.running
            finally:
                server.stop()
    finally:
        shutil.rmtree(base, ignore_errors=True)
