"""``stream_groups``: the first record of a group's start wins, only entry ids
are stored, failures name the adapter and group, and a database migrated
before the table existed stops the ingester at registration."""

from __future__ import annotations

import asyncio

import pytest
import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine

from backhalf.db import DatabaseSettings, create_engine
from backhalf.db_errors import DatabaseUnusable
from backhalf.errors import StoreError
from backhalf.housekeeping import migrate
from backhalf.writes.stream_groups import GroupStartLedger, StreamGroup
from ingest.processes.intake import register_adapters
from ingest.processes.pull.ingester import pull_registrations
from tests.support import db
from tests.support.in_process import settings
from tests.support.servers import ServerUrls

GROUP = StreamGroup("127.0.0.1:6379/0", "orders", "switchboard")


async def test_the_first_record_wins_even_when_two_race(engine: AsyncEngine, db_url: str) -> None:
    ledger = GroupStartLedger(engine, deadline_ms=10_000)
    assert await ledger.recorded(GROUP, adapter="orders") is None
    starts = await asyncio.gather(
        *(ledger.record(GROUP, f"{n}-0", adapter=f"ingester-{n}") for n in range(1, 5))
    )
    assert len(set(starts)) == 1  # every racer was told the one start on record
    assert await ledger.record(GROUP, "999-0", adapter="restarted") == starts[0]
    assert db.query(db_url, "SELECT start_id FROM stream_groups") == [(starts[0],)]
    other = GROUP._replace(group="audit")  # another group of the stream: its own record
    assert await ledger.record(other, "0", adapter="audit") == "0"


async def test_only_entry_ids_are_stored(engine: AsyncEngine) -> None:
    with pytest.raises(IntegrityError, match="ck_stream_groups_start_id"):
        async with engine.begin() as conn:
            await conn.execute(
                sa.text(
                    "INSERT INTO stream_groups (broker, stream, group_name, adapter, start_id)"
                    " VALUES (:b, :s, :g, :a, :start)"
                ),
                {"b": GROUP.broker, "s": GROUP.stream, "g": GROUP.group, "a": "orders", "start": "$"},
            )


async def test_a_database_failure_is_a_store_error_naming_adapter_and_group() -> None:
    away = create_engine(DatabaseSettings(url="postgresql://u@127.0.0.1:1/sb", connect_timeout_s=2))
    try:
        ledger = GroupStartLedger(away, deadline_ms=5_000)
        with pytest.raises(StoreError, match="adapter orders: recording start 5-0 of group switchboard"):
            await ledger.record(GROUP, "5-0", adapter="orders")
        with pytest.raises(StoreError, match="adapter orders: reading the recorded start"):
            await ledger.recorded(GROUP, adapter="orders")
    finally:
        await away.dispose()


async def test_a_database_without_the_table_stops_the_ingester_at_registration(
    servers: ServerUrls, redis_url: str
) -> None:
    url = db.create_test_database(servers.database, migrated=False)
    try:
        migrate.upgrade(url, "0001")
        s = settings(url, redis_url, {"name": "orders", "source": "orders"})
        engine = create_engine(s.database)
        try:
            with pytest.raises(DatabaseUnusable, match="run `switchboard migrate`"):
                await register_adapters(engine, s, asyncio.Event(), pull_registrations(s))
        finally:
            await engine.dispose()
    finally:
        db.drop_test_database(servers.database, url)
