"""The trail search (:mod:`ingest.actions.trail`), the one ``switchboard
trace`` and the console's search box both call: every form of a search finds
the same row, and what is said when nothing matches. Also the read models'
redaction of a todo's stored error, which every front end shows."""

from __future__ import annotations

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from backhalf.reads import attention_views, todo_views
from ingest.actions import trail
from tests.support import db

ENTRY = "1700000000000-0"
KEY = f"redis:orders:{ENTRY}"
SECRET = "hunter2-in-a-url"


@pytest.fixture
def registered() -> tuple[tuple[str, str], ...]:
    return (("orders", "stream"),)


def stored_message(db_url: str, *, status: str = "pending", error: str | None = None) -> tuple[int, int]:
    """An ``orders`` stream message stored with its todo: (inbox id, todo id)."""
    db.query(db_url, """UPDATE adapters SET settings = '{"source": "orders"}'::jsonb WHERE name = 'orders'""")
    todo_id = int(
        db.scalar(
            db_url,
            "INSERT INTO todos (queue, idempotency_key, payload, status, last_error)"
            " VALUES ('orders', %(k)s, '{}'::jsonb, %(s)s, %(e)s) RETURNING id",
            {"k": KEY, "s": status, "e": error},
        )
    )
    inbox_id = int(
        db.scalar(
            db_url,
            "INSERT INTO inbox (adapter, idempotency_key, source_message_id, body, ack_kind, ack_state,"
            " status, todo_id) VALUES ('orders', %(k)s, %(m)s, '{}', 'xack', 'acked', 'stored', %(t)s)"
            " RETURNING id",
            {"k": KEY, "m": ENTRY, "t": todo_id},
        )
    )
    return inbox_id, todo_id


async def test_every_form_of_a_search_finds_the_same_row(engine: AsyncEngine, db_url: str) -> None:
    inbox_id, todo_id = stored_message(db_url)
    for query in (KEY, ENTRY, f"inbox:{inbox_id}", f"todo:{todo_id}", f"  {KEY}  "):
        found = await trail.find(engine, query)
        assert [t.inbox.id for t in found.trails] == [inbox_id], query
        assert found.trails[0].transport == "redis"
        assert found.trails[0].source == "orders"
        assert found.trails[0].todo is not None
        assert found.trails[0].todo.id == todo_id
    # A bare number is an inbox id and a todo id at once.
    assert [t.inbox.id for t in (await trail.find(engine, str(inbox_id))).trails] == [inbox_id]
    assert [t.inbox.id for t in (await trail.find(engine, str(todo_id))).trails] == [inbox_id]


@pytest.mark.parametrize(
    ("query", "missing"),
    [
        ("redis:orders:1-0", "no inbox row has the idempotency key 'redis:orders:1-0'"),
        ("1-0", "no stream adapter's inbox holds entry id '1-0'"),
        ("inbox:999999", "inbox row 999999 does not exist"),
        ("todo:999999", "no inbox row holds todo 999999"),
        ("999999", "no inbox row 999999, and no todo 999999 with an inbox row"),
        # Larger than any bigint: no row, and no database error.
        ("inbox:99999999999999999999", "inbox row 99999999999999999999 does not exist"),
        ("todo:99999999999999999999", "no inbox row holds todo 99999999999999999999"),
    ],
)
async def test_a_search_that_finds_nothing_says_what_it_looked_for(
    engine: AsyncEngine, db_url: str, query: str, missing: str
) -> None:
    stored_message(db_url)
    found = await trail.find(engine, query)
    assert (found.trails, found.missing) == ((), missing)


async def test_a_pending_todo_says_why_it_waits_and_a_finished_one_does_not(
    engine: AsyncEngine, db_url: str
) -> None:
    inbox_id, _ = stored_message(db_url)
    (waiting,) = (await trail.find(engine, f"inbox:{inbox_id}")).waiting
    assert waiting is not None
    assert "orders" in waiting
    db.query(db_url, "UPDATE todos SET status = 'done'")
    assert (await trail.find(engine, f"inbox:{inbox_id}")).waiting == (None,)


async def test_a_stored_error_is_shown_redacted_by_every_read_model(engine: AsyncEngine, db_url: str) -> None:
    # A row written before errors were redacted on write holds a credential.
    error = f"connect failed: postgresql://app:{SECRET}@db.internal/orders"
    inbox_id, todo_id = stored_message(db_url, status="failed", error=error)
    async with engine.connect() as conn:
        shown = [
            (await trail.find(engine, f"inbox:{inbox_id}")).trails[0].todo,
            await todo_views.get_todo(conn, todo_id),
            *(await todo_views.list_todos(conn, todo_views.TodoQuery(limit=10))),
            (await attention_views.failed_todos(conn)).newest,
        ]
    errors = [getattr(row, "last_error", None) for row in shown]
    assert len(errors) == 4
    assert all(e is not None and "db.internal" in e for e in errors), errors
    assert not any(SECRET in (e or "") for e in errors), errors
