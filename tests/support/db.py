"""Per-test databases cloned from one migrated template, and SQL helpers for
assertions on what reached PostgreSQL."""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

import psycopg
from psycopg import sql
from sqlalchemy.engine import make_url

from backhalf.db import libpq_url
from backhalf.housekeeping import migrate
from backhalf.lifecycle import todos

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


def unacked(db_url: str) -> int:
    """Inbox rows whose ack intent is not discharged."""
    return int(scalar(db_url, "SELECT count(*) FROM inbox WHERE ack_state <> 'acked'"))


def insert_todos(url: str, n: int, *, queue: str = "q", status: str = "pending") -> list[int]:
    """``n`` todos of ``queue`` in ``status``, their ids in order."""
    with psycopg.connect(libpq(url), autocommit=True) as conn:
        rows = conn.execute(
            "INSERT INTO todos (queue, idempotency_key, payload, status)"
            " SELECT %s, 'k' || g, '{}', %s FROM generate_series(1, %s::int) g RETURNING id",
            (queue, status, n),
        ).fetchall()
    return sorted(int(r[0]) for r in rows)


def claim(
    url: str, queues: Sequence[str] = ("q",), limit: int = 100, lease_s: float = 60
) -> list[todos.Claimed]:
    """A worker's claim (``claim_todos``), committed, on a connection of its own."""
    with psycopg.connect(libpq(url), autocommit=True) as pg:
        return todos.claim(pg, list(queues), limit, lease_s)


def claim_todo(url: str, todo_id: int, lease_s: float = 60) -> todos.Claimed:
    """Todo ``todo_id`` claimed alone by the workers' claim: the other
    claimable todos of its queue are held locked meanwhile, which the
    claim's SKIP LOCKED passes over, and left as they were."""
    with psycopg.connect(libpq(url)) as holder:
        row = holder.execute("SELECT queue FROM todos WHERE id = %s", (todo_id,)).fetchone()
        assert row is not None, f"no todo {todo_id}"
        holder.execute(
            "SELECT 1 FROM todos WHERE queue = %s AND id <> %s AND status IN ('pending', 'dispatched')"
            " FOR UPDATE",
            (row[0], todo_id),
        )
        runs = claim(url, [row[0]], 1, lease_s)
        holder.rollback()
    assert [r.todo.id for r in runs] == [todo_id], f"todo {todo_id} was not claimable"
    return runs[0]


def end(url: str, *endings: todos.Ending, release: bool = True) -> tuple[set[int], set[int]]:
    """Runs ended (``end_runs``), committed, on a connection of its own:
    (the todos whose run held them, those another transaction held)."""
    with psycopg.connect(libpq(url), autocommit=True) as pg:
        return todos.end_runs(pg, endings, release=release)


class Received(Protocol):
    def __call__(self, timeout_s: float, stop_after: int | None = None) -> list[str]: ...


@contextmanager
def listening(url: str, channel: str) -> Iterator[Received]:
    """LISTEN on ``channel`` on a connection of its own; yields
    ``received(timeout_s, stop_after)``: the payloads delivered within
    ``timeout_s``, or as soon as ``stop_after`` of them have been."""
    with psycopg.connect(libpq(url), autocommit=True) as conn:
        conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))

        def received(timeout_s: float, stop_after: int | None = None) -> list[str]:
            return [n.payload for n in conn.notifies(timeout=timeout_s, stop_after=stop_after)]

        yield received
