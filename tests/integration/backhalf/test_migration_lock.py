"""Issue 32, item 9: migrate waits for another migrate's advisory lock
within a bound, then says who holds it (a real second session holds it)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import psycopg
import pytest

from backhalf.housekeeping import migrate
from backhalf.housekeeping.migrate import MigrationLocked
from tests.support import db
from tests.support.servers import ServerUrls

MIGRATION_LOCK_ID = 0x73776264  # alembic/env.py's


@pytest.fixture
def fresh_url(servers: ServerUrls) -> Iterator[str]:
    url = db.create_test_database(servers.database, migrated=False)
    yield url
    db.drop_test_database(servers.database, url)


@pytest.fixture
def holder(fresh_url: str) -> Iterator[psycopg.Connection[tuple[int]]]:
    """Another session holding the migration lock (as a running migrate does)."""
    with psycopg.connect(db.libpq(fresh_url), autocommit=True, connect_timeout=10) as conn:
        conn.execute("SELECT pg_advisory_lock(%s)", (MIGRATION_LOCK_ID,))
        yield conn


def _tables(url: str) -> int:
    return int(db.scalar(url, "SELECT count(*) FROM information_schema.tables WHERE table_name = 'inbox'"))


def test_a_held_lock_is_waited_for_within_the_bound_then_named(
    fresh_url: str, holder: psycopg.Connection[tuple[int]]
) -> None:
    start = time.monotonic()
    with pytest.raises(MigrationLocked) as caught:
        migrate.upgrade(fresh_url, lock_wait_s=1.0)
    waited = time.monotonic() - start
    assert 1.0 <= waited < 5.0, waited  # the bound, not the 10 s DDL lock timeout nor for ever
    assert caught.value.holder_pid == holder.info.backend_pid
    message = str(caught.value)
    assert "another migrate" in message
    assert f"pid {holder.info.backend_pid}" in message
    assert "\n" not in message
    # Raised outside the driver's error: the CLI's explanation is this line,
    # not "canceling statement due to lock timeout".
    assert caught.value.__context__ is None
    assert caught.value.__cause__ is None
    assert _tables(fresh_url) == 0  # nothing migrated


def test_a_lock_released_within_the_wait_is_taken_and_the_migration_runs(
    fresh_url: str, holder: psycopg.Connection[tuple[int]]
) -> None:
    released = threading.Timer(
        0.5, lambda: holder.execute("SELECT pg_advisory_unlock(%s)", (MIGRATION_LOCK_ID,))
    )
    released.start()
    try:
        migrate.upgrade(fresh_url, lock_wait_s=30.0)
    finally:
        released.join(10)
    assert _tables(fresh_url) == 1
    # The lock is released after the run: another migrate takes it at once.
    migrate.upgrade(fresh_url, lock_wait_s=0.5)
