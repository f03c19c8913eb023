"""Alembic environment: migrations run against ``schema``'s metadata.

Run through ``switchboard migrate`` (which passes the database URL in
``config.attributes``) or plain ``alembic`` with ``SWITCHBOARD_DATABASE_URL``.
Each run holds an advisory lock so two deploys cannot migrate at once, and
runs under statement and lock timeouts so a blocked DDL fails instead of
queueing every other session behind it.
"""

from __future__ import annotations

import os

import sqlalchemy as sa

from alembic import context
from schema import metadata

# Arbitrary constant shared by every switchboard migrator ("swbd" in ASCII).
MIGRATION_LOCK_ID = 0x73776264
STATEMENT_TIMEOUT_MS = 60_000
LOCK_TIMEOUT_MS = 10_000

config = context.config


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


def _migrate(connection: sa.Connection) -> None:
    connection.execute(
        sa.text("SELECT set_config('statement_timeout', :v, false)"), {"v": str(STATEMENT_TIMEOUT_MS)}
    )
    connection.execute(sa.text("SELECT set_config('lock_timeout', :v, false)"), {"v": str(LOCK_TIMEOUT_MS)})
    connection.execute(sa.text("SELECT pg_advisory_lock(:id)"), {"id": MIGRATION_LOCK_ID})
    connection.commit()
    try:
        context.configure(
            connection=connection,
            target_metadata=metadata,
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
