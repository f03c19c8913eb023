"""A todo that finishes moves from ``todos_live`` to a partition of
``todos_done`` (decision 0007). A statement that waited for its row lock
meanwhile gets a serialization failure (40001) from PostgreSQL instead of
the row's new version; the statements that lock todos ask again, in a new
snapshot, and see the todo finished. Real PostgreSQL, a real lock wait: the
end is held open until the locking statement waits for it."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import psycopg
from sqlalchemy.ext.asyncio import AsyncEngine

from backhalf.lifecycle import todos
from backhalf.reads import todo_views
from ingest.embedded.processes import wait_for
from tests.support.db import insert_todos, libpq, scalar


def _waiting_for_a_lock(db_url: str) -> bool:
    return bool(scalar(db_url, "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"))


async def test_an_operators_lock_sees_a_todo_that_finished_while_it_waited(
    engine: AsyncEngine, db_url: str
) -> None:
    (todo_id,) = insert_todos(db_url, 1, queue="orders", status="running")
    with psycopg.connect(libpq(db_url)) as ender:
        ender.execute("UPDATE todos SET status = 'done' WHERE id = %s", (todo_id,))  # held open

        async def lock() -> todo_views.TodoRow | None:
            async with engine.begin() as conn:
                return await todo_views.lock_todo(conn, todo_id)

        locking = asyncio.ensure_future(lock())
        await asyncio.to_thread(
            wait_for, lambda: _waiting_for_a_lock(db_url), timeout_s=10, what="the lock to wait for the end"
        )
        ender.commit()
        state = await asyncio.wait_for(locking, timeout=10)
    assert state is not None
    assert (state.id, state.status) == (todo_id, "done")


def test_a_locking_statement_asks_again_when_its_row_moved(db_url: str) -> None:
    (todo_id,) = insert_todos(db_url, 1, queue="orders", status="running")
    found: list[Any] = []
    failed: list[BaseException] = []
    with psycopg.connect(libpq(db_url)) as ender:
        ender.execute("UPDATE todos SET status = 'done' WHERE id = %s", (todo_id,))

        def lock() -> None:
            try:
                with psycopg.connect(libpq(db_url), autocommit=True) as pg:
                    found.extend(
                        todos._fetch_retrying_moved(
                            pg, "SELECT id, status FROM todos WHERE id = %(id)s FOR UPDATE", {"id": todo_id}
                        )
                    )
            except BaseException as exc:  # reported below, on the test's thread
                failed.append(exc)

        locker = threading.Thread(target=lock)
        locker.start()
        wait_for(lambda: _waiting_for_a_lock(db_url), timeout_s=10, what="the lock to wait for the end")
        ender.commit()
        locker.join(timeout=10)
    assert not failed, failed
    assert found == [(todo_id, "done")]
