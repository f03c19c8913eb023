"""The shipped PostgreSQL roles (``ops/roles.sql``) on a database of a test's
own, for the least-privilege system tests.

The file is run as written, except that its role and policy names get a
prefix unique to the test run (roles are cluster-wide, and the suite may share
a server); the roles are dropped at the end. The database is created empty and
the file run (as the file says: the roles, no table grants yet);
:func:`migrate_and_grant` then runs ``switchboard migrate`` as the migrator
and the file again, for the grants and policies."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from psycopg import errors, sql
from sqlalchemy.engine import make_url

from backhalf.db import libpq_url
from tests.support import db
from tests.support.processes import switchboard

ROLES_SQL = Path(__file__).parents[2] / "ops" / "roles.sql"
ROLES = ("migrator", "ingester", "receiver", "acker", "worker", "operator", "viewer", "auditor")
# A test password, one for every login user: a constant, never a log line.
LOGIN_PASSWORD = "least-privilege-test-pw"
INSUFFICIENT_PRIVILEGE = "42501"


@dataclass(frozen=True)
class RoleDatabase:
    admin_url: str  # the superuser, on the test's database
    prefix: str  # replaces the file's "switchboard_"

    def role(self, name: str) -> str:
        return f"{self.prefix}_{name}"

    def login(self, name: str) -> str:
        """The login user of a role (the migrator logs in as itself)."""
        return self.role(name) if name == "migrator" else self.role(f"{name}_login")

    def url(self, name: str) -> str:
        parsed = make_url(self.admin_url).set(username=self.login(name), password=LOGIN_PASSWORD)
        return parsed.render_as_string(hide_password=False)


def roles_sql(prefix: str) -> str:
    """The file as written, its role (and policy) names prefixed for this run:
    every name the file gives starts with ``switchboard_``, no table's does."""
    return ROLES_SQL.read_text().replace("switchboard_", f"{prefix}_")


def run_roles_sql(url: str, prefix: str) -> None:
    with psycopg.connect(libpq_url(url), autocommit=True, connect_timeout=10) as conn:
        conn.execute(roles_sql(prefix))  # a whole file, no parameters


@contextlib.contextmanager
def role_database(maintenance_url: str) -> Iterator[RoleDatabase]:
    """An empty database of its own with the file run once (the roles, with
    the test password); dropped afterwards, with the roles."""
    prefix = f"sb{uuid.uuid4().hex[:10]}"
    url = db.create_test_database(maintenance_url, migrated=False)
    rdb = RoleDatabase(url, prefix)
    try:
        run_roles_sql(url, prefix)  # before migrate: the roles, no table grants yet
        with psycopg.connect(libpq_url(url), autocommit=True, connect_timeout=10) as conn:
            for name in ROLES:
                conn.execute(
                    sql.SQL("ALTER ROLE {} PASSWORD {}").format(
                        sql.Identifier(rdb.login(name)), sql.Literal(LOGIN_PASSWORD)
                    )
                )
        yield rdb
    finally:
        db.drop_test_database(maintenance_url, url)
        # The database held every object and grant of these roles: they can go now.
        with psycopg.connect(libpq_url(maintenance_url), autocommit=True, connect_timeout=10) as conn:
            for name in ROLES:
                for role in {rdb.login(name), rdb.role(name)}:
                    conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(role)))


def migrate_and_grant(rdb: RoleDatabase) -> None:
    """``switchboard migrate`` as the migrator, then the file again (the grants)."""
    migrated = switchboard("migrate", env={"SWITCHBOARD_DATABASE_URL": rdb.url("migrator")})
    assert migrated.returncode == 0, migrated.stdout + migrated.stderr
    run_roles_sql(rdb.admin_url, rdb.prefix)


def sqlstate(url: str, statement: str, params: dict[str, Any] | None = None) -> str | None:
    """The SQLSTATE the statement fails with as ``url``'s user, None if it succeeds."""
    with psycopg.connect(libpq_url(url), autocommit=True, connect_timeout=10) as conn:
        try:
            conn.execute(statement, params)
        except errors.Error as exc:
            return exc.sqlstate
    return None
