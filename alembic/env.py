"""Alembic environment: migrations run against ``schema``'s metadata.

Run through ``switchboard migrate`` (which passes the database URL in
``config.attributes``) or plain ``alembic`` with ``SWITCHBOARD_DATABASE_URL``.
Each run holds an advisory lock so two deploys cannot migrate at once, and
runs under statement and lock timeouts so a blocked DDL fails instead of
queueing every other session behind it. The advisory lock is waited for
within its own bound (``lock_wait_ms`` in ``config.attributes``, else
``MIGRATION_LOCK_WAIT_MS``): past it, :class:`MigrationLocked` names the
session that holds it.
"""

from __future__ import annotations

import os
import re

import sqlalchemy as sa

from alembic import context
from backhalf.housekeeping.migrate import MIGRATION_LOCK_WAIT_MS, MigrationLocked
from schema import metadata

# Arbitrary constant shared by every switchboard migrator ("swbd" in ASCII).
MIGRATION_LOCK_ID = 0x73776264
STATEMENT_TIMEOUT_MS = 60_000
LOCK_TIMEOUT_MS = 10_000
LOCK_NOT_AVAILABLE = "55P03"  # lock_timeout passed
# The session holding the migration lock (a bigint key below 2**32: classid
# 0, objid the key, objsubid 1), in this database.
_HOLDER = sa.text(
    "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted AND classid = 0"
    " AND objid = :id AND objsubid = 1"
    " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
)

config = context.config
# The history's partitions, and todos' (migration 0017): todos_live (with
# its own indexes) and todos_done's.
_PARTITION = re.compile(
    r"^((inbox|events|todo_events|todos_done)_p[0-9]{6}|todos_live|todos_done|todos_done_late"
    r"|ix_todos_live_[a-z_]+|uq_todos_queue_key_active)(_|$)"
)


def _url() -> str:
    url = config.attributes.get("database_url") or os.environ.get("SWITCHBOARD_DATABASE_URL")
    if not url:
        raise RuntimeError("no database URL: set SWITCHBOARD_DATABASE_URL or use `switchboard migrate`")
    return str(url)


def run_migrations_offline() -> None:
    context.configure(url=_url(), target_metadata=metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connectable = config.attributes.get("connection")
    if connectable is None:
        engine = sa.create_engine(_url(), poolclass=sa.pool.NullPool, connect_args={"connect_timeout": 10})
        with engine.connect() as connection:
            _migrate(connection)
        engine.dispose()
    else:
        _migrate(connectable)


def _set(connection: sa.Connection, setting: str, value: int) -> None:
    connection.execute(sa.text("SELECT set_config(:s, :v, false)"), {"s": setting, "v": str(value)})


def _lock(connection: sa.Connection) -> None:
    """Take the migration lock, waiting at most the lock wait; then the DDL's
    lock timeout. Another holder past the wait: :class:`MigrationLocked`,
    raised outside the driver's error (whose "canceling statement due to
    lock timeout" would name neither the lock nor its holder)."""
    # At least 1 ms: a lock_timeout of 0 would wait for ever.
    wait_ms = max(1, int(config.attributes.get("lock_wait_ms", MIGRATION_LOCK_WAIT_MS)))
    _set(connection, "statement_timeout", max(STATEMENT_TIMEOUT_MS, wait_ms + 1_000))
    _set(connection, "lock_timeout", wait_ms)
    connection.commit()  # the settings outlive a failed attempt's rollback
    try:
        connection.execute(sa.text("SELECT pg_advisory_lock(:id)"), {"id": MIGRATION_LOCK_ID})
    except sa.exc.OperationalError as exc:
        if getattr(exc.orig, "sqlstate", None) != LOCK_NOT_AVAILABLE:
            raise
        connection.rollback()
    else:
        _set(connection, "statement_timeout", STATEMENT_TIMEOUT_MS)
        _set(connection, "lock_timeout", LOCK_TIMEOUT_MS)
        connection.commit()
        return
    holders = connection.execute(_HOLDER, {"id": MIGRATION_LOCK_ID}).scalars().all()
    connection.rollback()
    raise MigrationLocked(wait_ms / 1000, holders[0] if holders else None)


def _not_a_partition(name: str | None, type_: str, parent_names: object) -> bool:
    """The history tables' partitions (and their indexes) are made and
    dropped by ``backhalf.housekeeping.partitions``, not by migrations: the schema's
    metadata names only the partitioned tables (``todos``' two partitions
    are migration 0017's, in its own DDL)."""
    return not (name is not None and _PARTITION.match(name))


def _migrate(connection: sa.Connection) -> None:
    _lock(connection)
    try:
        context.configure(
            connection=connection,
            target_metadata=metadata,
            include_name=_not_a_partition,
            transaction_per_migration=True,
            compare_type=True,
            compare_server_default=True,
        )
        with context.begin_transaction():
            context.run_migrations()
        connection.commit()
    finally:
        connection.execute(sa.text("SELECT pg_advisory_unlock(:id)"), {"id": MIGRATION_LOCK_ID})
        connection.commit()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
