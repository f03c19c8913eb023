"""The engine's sessions: ``synchronous_commit`` is pinned to at least ``on``
(issue 11 item 4), so a commit the acker acknowledges survives a crash."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import text

from backhalf.db import DatabaseSettings, create_engine
from tests.support.servers import private_postgres


@pytest.fixture
def server_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """A PostgreSQL of our own whose postgresql.conf sets ``synchronous_commit``
    to the test's parameter; yields its URL."""
    with private_postgres(f"synchronous_commit = {request.param}") as server:
        yield server.url()


async def session_synchronous_commit(url: str) -> tuple[str, str]:
    """``synchronous_commit`` in a transaction of the engine's first
    connection, then of a second one opened while the first is checked out."""
    engine = create_engine(DatabaseSettings(url=url))
    try:
        async with engine.begin() as first:
            first_value = (await first.execute(text("SHOW synchronous_commit"))).scalar_one()
            async with engine.begin() as second:
                second_value = (await second.execute(text("SHOW synchronous_commit"))).scalar_one()
        # A checked-in connection was rolled back on return: the pin holds.
        async with engine.begin() as again:
            assert (await again.execute(text("SHOW synchronous_commit"))).scalar_one() == first_value
        return first_value, second_value
    finally:
        await engine.dispose()


@pytest.mark.parametrize(
    ("server_url", "expected"),
    [("off", "on"), ("local", "on"), ("remote_apply", "remote_apply")],
    indirect=["server_url"],
)
async def test_sessions_pin_synchronous_commit_unless_stronger(server_url: str, expected: str) -> None:
    assert await session_synchronous_commit(server_url) == (expected, expected)
