"""The console's last-hour figures (backhalf.reads.console_views) are the audit
view's (``audit_adapter_minutes``) for the rows of the window, found by a
binary search over the inbox ids, gaps and all."""

from __future__ import annotations

from datetime import datetime, timedelta

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from backhalf.db import create_engine
from backhalf.reads import console_views
from ingest.config import from_mapping
from tests.integration.backhalf import test_audit_views as audit
from tests.support import db


async def _connect(url: str) -> tuple[AsyncEngine, AsyncConnection]:
    engine = create_engine(from_mapping({"database": {"url": url}}, {}).database)
    return engine, await engine.connect()


def _window(url: str) -> timedelta:
    """From five minutes before the filled rows' first minute to now."""
    now: datetime = db.scalar(url, "SELECT now()")
    return now - audit.T + timedelta(minutes=5)


async def test_the_figures_are_the_audit_views_for_the_window(db_url: str) -> None:
    # Rows stored long before the window (ids grow with time: they come
    # first): never read, never counted.
    db.query(db_url, "INSERT INTO adapters (name, transport, mode) VALUES ('old', 'redis', 'list')")
    for i in range(5):
        audit._inbox(db_url, adapter="old", key=f"old{i}", deliveries=4, status="rejected",
                     stored_at=audit.T - timedelta(days=10), acked_at=None)  # fmt: skip
    filled = audit.fill(db_url)
    window = _window(filled)
    engine, conn = await _connect(filled)
    try:
        got = await console_views.recent_minutes(conn, window)
    finally:
        await conn.close()
        await engine.dispose()
    view = db.query(
        filled,
        "SELECT * FROM audit_adapter_minutes WHERE minute >= %(t)s ORDER BY minute, adapter",
        {"t": audit.T},
    )
    assert [tuple(vars_of(m)) for m in got] == [tuple(row) for row in view]
    assert sum(m.consumed for m in got) == 5  # the five rows of the window, not the old ones
    assert {m.adapter for m in got} == {"orders", "jobs"}


def vars_of(m: console_views.MinuteFigures) -> list[object]:
    return [getattr(m, name) for name in console_views.MinuteFigures.__dataclass_fields__]


async def test_the_window_starts_at_its_first_row_whatever_the_gaps(db_url: str) -> None:
    db.query(db_url, "INSERT INTO adapters (name, transport, mode) VALUES ('orders', 'redis', 'stream')")
    for i in range(40):
        audit._inbox(db_url, adapter="orders", key=f"k{i}", deliveries=1,
                     stored_at=audit.T + timedelta(minutes=i), acked_at=None)  # fmt: skip
    ids = [r[0] for r in db.query(db_url, "SELECT id FROM inbox ORDER BY id")]
    # Gaps, among them the row just before the window and its first row's neighbours.
    db.query(db_url, "DELETE FROM inbox WHERE id = ANY(%(ids)s)", {"ids": ids[3:9] + ids[19:21] + ids[22:25]})
    left = [r[0] for r in db.query(db_url, "SELECT id FROM inbox ORDER BY id")]
    engine, conn = await _connect(db_url)
    try:
        for first_minute in (0, 1, 10, 19, 21, 25, 39):
            cutoff = sa.literal(audit.T + timedelta(minutes=first_minute) - timedelta(seconds=1))
            expected = next(i for i in left if i >= ids[first_minute])
            assert await console_views.window_start_id(conn, cutoff) == expected, first_minute
        past_all = sa.literal(audit.T + timedelta(days=1))
        assert await console_views.window_start_id(conn, past_all) is None
        db.query(db_url, "DELETE FROM inbox")
        assert await console_views.window_start_id(conn, sa.literal(audit.T)) is None
    finally:
        await conn.close()
        await engine.dispose()
