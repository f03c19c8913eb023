"""Integration fixtures: an engine on the test's database with its adapters registered."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from backhalf.db import DatabaseSettings, create_engine, create_sync_engine
from backhalf.lifecycle.state_writer import StateWriter
from backhalf.writes import registry


@pytest.fixture
def registered() -> tuple[tuple[str, str], ...]:
    """(name, mode) of the adapters ``engine`` registers; modules override it."""
    return (("orders", "stream"),)


@pytest.fixture
async def engine(db_url: str, registered: tuple[tuple[str, str], ...]) -> AsyncIterator[AsyncEngine]:
    eng = create_engine(DatabaseSettings(url=db_url))
    async with eng.begin() as conn:
        for name, mode in registered:
            await registry.register(
                conn, name=name, family="queue", transport="redis", mode=mode, settings={}
            )
    yield eng
    await eng.dispose()


@pytest.fixture
def writer(db_url: str) -> Iterator[StateWriter]:
    """A worker process's state writer on the test's database, closed after."""
    w = StateWriter(
        create_sync_engine(DatabaseSettings(url=db_url), pool_size=1), deadline_ms=10_000, threads=4
    )
    yield w
    w.close()
