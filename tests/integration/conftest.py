"""Integration fixtures: an engine on the test's database with its adapters registered."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from backhalf import registry
from backhalf.db import DatabaseSettings, create_engine


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
