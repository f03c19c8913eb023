"""Per-test databases cloned from one migrated template, and SQL helpers for
assertions on what reached PostgreSQL."""

from __future__ import annotations

import uuid
from typing import Any

import psycopg
from psycopg import sql
from sqlalchemy.engine import make_url

from backhalf import migrate
from backhalf.db import libpq_url

TEMPLATE = "switchboard_template"

libpq = libpq_url  # the tests' short name for it, which they import from here


def with_database(url: str, name: str) -> str:
    return make_url(url).set(database=name).render_as_string(hide_password=False)


def create_template(admin_url: str) -> None:
    with psycopg.connect(libpq(admin_url), autocommit=True, connect_timeout=10) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(TEMPLATE)))
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(TEMPLATE)))
    migrate.upgrade(with_database(admin_url, TEMPLATE))


def create_test_database(admin_url: str, *, migrated: bool = True) -> str:
    name = f"t_{uuid.uuid4().hex[:16]}"
    with psycopg.connect(libpq(admin_url), autocommit=True, connect_timeout=10) as conn:
        if migrated:
            stmt = sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                sql.Identifier(name), sql.Identifier(TEMPLATE)
            )
        else:
            stmt = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
        conn.execute(stmt)
    return with_database(admin_url, name)


def drop_test_database(admin_url: str, url: str) -> None:
    name = make_url(url).database
    assert name is not None
    with psycopg.connect(libpq(admin_url), autocommit=True, connect_timeout=10) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def query(url: str, statement: str, params: dict[str, Any] | None = None) -> list[tuple[Any, ...]]:
    with psycopg.connect(libpq(url), autocommit=True, connect_timeout=10) as conn:
        cur = conn.execute(statement, params)
        return cur.fetchall() if cur.description is not None else []


def scalar(url: str, statement: str, params: dict[str, Any] | None = None) -> Any:
    rows = query(url, statement, params)
    return rows[0][0] if rows else None


def acked(db_url: str) -> int:
    """Inbox rows whose ack has been discharged."""
    return int(scalar(db_url, "SELECT count(*) FROM inbox WHERE ack_state = 'acked'"))


def insert_todos(url: str, n: int, *, queue: str = "q", status: str = "dispatched") -> list[int]:
    """``n`` todos of ``queue`` in ``status``, their ids in order."""
    with psycopg.connect(libpq(url), autocommit=True) as conn:
        rows = conn.execute(
            "INSERT INTO todos (queue, idempotency_key, payload, status)"
            " SELECT %s, 'k' || g, '{}', %s FROM generate_series(1, %s::int) g RETURNING id",
            (queue, status, n),
        ).fetchall()
    return sorted(int(r[0]) for r in rows)
