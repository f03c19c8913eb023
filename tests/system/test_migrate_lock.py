"""Issue 32, item 9: `switchboard migrate` while another session holds the
migration lock gives up after --lock-wait with one line naming the holder,
and exits 1 (it used to print the driver's "canceling statement due to
lock timeout" after the DDL's 10 s, naming neither)."""

from __future__ import annotations

import time

import psycopg
import pytest

from ingest.exit_codes import EXIT_CONFIG, EXIT_FAILURE
from tests.support import db
from tests.support.processes import SECRET, error_lines, switchboard
from tests.support.servers import ServerUrls

pytestmark = pytest.mark.system
MIGRATION_LOCK_ID = 0x73776264  # alembic/env.py's


def test_migrate_gives_up_on_a_held_lock_with_one_line_naming_its_holder(servers: ServerUrls) -> None:
    url = db.create_test_database(servers.database, migrated=False)
    try:
        env = {"SWITCHBOARD_DATABASE_URL": url}
        with psycopg.connect(db.libpq(url), autocommit=True, connect_timeout=10) as holder:
            holder.execute("SELECT pg_advisory_lock(%s)", (MIGRATION_LOCK_ID,))
            start = time.monotonic()
            result = switchboard("migrate", "--lock-wait", "1", env=env, timeout_s=60)
            took = time.monotonic() - start
            pid = holder.info.backend_pid
        assert result.returncode == EXIT_FAILURE, result.stderr
        lines = error_lines(result)
        assert len(lines) == 1, result.stderr
        assert lines[0].startswith("switchboard migrate: another migrate (PostgreSQL backend pid ")
        assert f"pid {pid}) holds the migration lock: gave up after 1 s" in lines[0]
        assert SECRET not in result.stderr + result.stdout
        assert took < 30  # the interpreter's start, and the one-second wait
        # Released: the same command migrates.
        done = switchboard("migrate", "--lock-wait", "1", env=env, timeout_s=60)
        assert done.returncode == 0, done.stderr
    finally:
        db.drop_test_database(servers.database, url)


@pytest.mark.parametrize("value", ["0", "-1", "nan", "soon"])
def test_a_lock_wait_that_is_no_positive_number_is_refused(value: str) -> None:
    result = switchboard(
        "migrate", "--lock-wait", value, env={"SWITCHBOARD_DATABASE_URL": "postgresql://x@h/d"}
    )
    assert result.returncode == EXIT_CONFIG
    assert "--lock-wait: must be seconds" in result.stderr
