"""What every Redis mode shares (ingest/adapters/redis/common.py), against a
real server."""

from __future__ import annotations

import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from ingest.adapters.redis.common import connect
from ingest.embedded.processes import wait_for
from ingest.embedded.servers import redis_binary


@pytest.fixture
def unix_socket() -> Iterator[Path]:
    """A Valkey listening on a unix socket only (a short path: the limit is 107 bytes)."""
    with tempfile.TemporaryDirectory(prefix="sb-sock-") as base:
        sock = Path(base) / "r.sock"
        server = subprocess.Popen(
            [str(redis_binary()), "--port", "0", "--unixsocket", str(sock), "--save", "", "--dir", base],
            stdout=subprocess.DEVNULL,
        )
        try:
            wait_for(sock.exists, timeout_s=10, what="the unix socket")
            yield sock
        finally:
            server.terminate()
            server.wait(timeout=10)


async def test_a_unix_socket_url_connects(unix_socket: Path) -> None:
    """unix:// is an accepted broker URL; the TCP-only keepalive option made
    every call fail with a TypeError before (review of issue 13)."""
    client = connect(f"unix://{unix_socket}?db=0", block_ms=100)
    try:
        await client.xadd("orders", {"body": b"{}"})
        assert await client.xlen("orders") == 1
    finally:
        await client.aclose()
    with redis.Redis(unix_socket_path=str(unix_socket), socket_timeout=5) as r:
        assert r.xlen("orders") == 1
