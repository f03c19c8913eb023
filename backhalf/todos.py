"""Writes to ``todos`` and ``todo_events``: every one is defined here.

A todo is created in one way only, the ``todos_create_cte`` block of
``queries.sql``: insert it, or dedup to the active todo with the same
(queue, key) (``uq_todos_queue_key_active``), and log a created todo's
'pending' row in ``todo_events`` in the same statement. The store embeds the
block in its one-round-trip write, with :func:`creating`'s parameters; inbox
replay runs it alone through :func:`create`. The store's undo of todos it
created for messages stored already is :func:`delete_created`. The workers'
state transitions (each with its ``todo_events`` row, in the same
transaction) belong here too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import psycopg
from sqlalchemy.ext.asyncio import AsyncConnection

from backhalf import queries

# ``todo_events.detail`` of a todo's 'pending' row: who created it.
CREATED_BY_STORE = "created"
CREATED_BY_REPLAY = "created by replay"


def creating(queue: str, detail: str) -> dict[str, str]:
    """The parameters of ``todos_create_cte``, in every statement that embeds it."""
    return {"queue": queue, "todo_detail": detail}


async def create(conn: AsyncConnection, *, queue: str, key: str, payload: str, detail: str) -> int:
    """Create one todo, or dedup to the active one with its key; return its id.

    ``payload`` is JSON text, cast in SQL (never re-encoded). Run through
    SQLAlchemy, in the caller's transaction, so a driver error surfaces as
    SQLAlchemy's, as the Core statements around it raise them.
    """
    result = await conn.exec_driver_sql(
        queries.CREATE_TODO, {"key": key, "payload": payload, **creating(queue, detail)}
    )
    return int(result.scalar_one())


async def delete_created(cur: psycopg.AsyncCursor[Any], todo_ids: Sequence[int]) -> None:
    """Delete todos a store created, with their log rows, in its transaction."""
    await cur.execute(queries.DELETE_TODOS, {"ids": list(todo_ids)})
