"""The history in partitions (issue 45): periods begun, old partitions
dropped whole, the dedup across partitions and past the horizon, and what
is owed kept. Real store, real upkeep (``ingest.processes.ack.partitions``),
real PostgreSQL; ages are made by moving rows' timestamps back, the only
thing faked."""

from __future__ import annotations

from datetime import timedelta

import psycopg
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from backhalf.db import DatabaseSettings
from backhalf.housekeeping import partitions
from backhalf.lifecycle.queues import QueueConfig
from backhalf.records import AckTarget, InboxRecord, Provenance, StoreBatch
from backhalf.writes.store import store
from ingest.config import AckerSettings, Settings
from ingest.processes.ack.partitions import upkeep_once
from schema.tables import PARTITIONED_TABLES
from tests.support.db import libpq, query, scalar

PULLED = Provenance(family="queue", trust_mode="queue", verified=False, verify_detail="redis acl: t")
HISTORY = ("inbox", "events", "todo_events")


def rec(entry_id: str, payload: str = '{"n": 1}') -> InboxRecord:
    return InboxRecord(
        idempotency_key=f"redis:orders:{entry_id}",
        source_message_id=entry_id,
        body=payload.encode(),
        payload=payload,
        error=None,
        ack_ref=entry_id,
    )


def batch(*records: InboxRecord) -> StoreBatch:
    return StoreBatch(
        adapter="orders",
        queue="orders",
        consumer="c1",
        ack_after="store",
        ack=AckTarget("xack", "orders", "switchboard", by_cursor=True),
        provenance=PULLED,
        records=records,
    )


async def _store(engine: AsyncEngine, *records: InboxRecord) -> None:
    async with engine.begin() as conn:
        await store(conn, batch(*records))


def _age(db_url: str, days: float) -> None:
    """Every row so far written ``days`` ago, acked, its todo done."""
    with psycopg.connect(libpq(db_url), autocommit=True) as conn:
        back = {"back": timedelta(days=days)}
        conn.execute(
            "UPDATE inbox SET stored_at = stored_at - %(back)s, ack_state = 'acked', acked_at = now()", back
        )
        conn.execute("UPDATE events SET received_at = received_at - %(back)s", back)
        conn.execute("UPDATE todo_events SET created_at = created_at - %(back)s", back)
        conn.execute("UPDATE todos SET status = 'done'")


def _partition_of(db_url: str, table: str, key_column: str, key: str) -> list[str]:
    return [
        str(name)
        for (name,) in query(
            db_url,
            f"SELECT tableoid::regclass::text FROM {table} WHERE {key_column} = %(k)s ORDER BY id",
            {"k": key},
        )
    ]


def _settings(keep_days: float | None, done_days: float | None = None) -> Settings:
    return Settings(
        database=DatabaseSettings(url="postgresql://unused"),
        adapters=(),
        acker=AckerSettings(partition_hours=1, retain_history_days=keep_days),
        queues={"orders": QueueConfig(name="orders", handler="m:f", retain_done_days=done_days)},
    )


async def test_a_new_period_lands_in_the_next_partition_and_dedups_against_the_old(
    engine: AsyncEngine, db_url: str
) -> None:
    await _store(engine, rec("1-0"), rec("2-0"))
    _age(db_url, 2)
    done = await upkeep_once(engine, _settings(30))
    assert done.begun == dict.fromkeys(HISTORY, 1)
    assert done.dropped == {}
    # Partitions ahead of the new current one.
    assert {t: sorted(n) for t, n in done.made.items()} == {key: [2] for key in PARTITIONED_TABLES}
    await _store(engine, rec("3-0"), rec("1-0"))  # a new entry, and a redelivery of an old one
    assert _partition_of(db_url, "inbox", "idempotency_key", "redis:orders:3-0") == ["inbox_p000001"]
    assert _partition_of(db_url, "inbox", "idempotency_key", "redis:orders:1-0") == ["inbox_p000000"]
    # The redelivery met its row in the old partition: counted, asked to
    # be acked again, no second row, event or todo.
    assert query(
        db_url, "SELECT deliveries, ack_state FROM inbox WHERE idempotency_key = 'redis:orders:1-0'"
    ) == [(2, "pending")]
    assert scalar(db_url, "SELECT count(*) FROM todos WHERE idempotency_key = 'redis:orders:1-0'") == 1
    assert scalar(db_url, "SELECT count(*) FROM events WHERE idempotency_key = 'redis:orders:1-0'") == 1
    event_id = scalar(db_url, "SELECT id FROM events WHERE idempotency_key = 'redis:orders:3-0'")
    assert partitions.number_of(event_id) == 1


async def test_partitions_past_the_history_go_whole_and_their_keys_with_them(
    engine: AsyncEngine, db_url: str
) -> None:
    await _store(engine, rec("1-0"), rec("2-0"))
    _age(db_url, 10)
    # One pass begins partition 1; partition 0, all of it past the history,
    # goes in the next (never in the pass that moved the ids away from it:
    # a store may still be writing ids drawn before).
    begun = await upkeep_once(engine, _settings(7))
    assert begun.begun == dict.fromkeys(HISTORY, 1)
    assert begun.dropped == {}
    done = await upkeep_once(engine, _settings(7))
    assert done.dropped == {key: [0] for key in HISTORY}
    await _store(engine, rec("3-0"))
    names = {n for (n,) in query(db_url, "SELECT relname::text FROM pg_class WHERE relname ~ '_p000000$'")}
    assert names == {"todos_done_p000000"}  # finished todos kept for ever: no retain_done_days
    assert scalar(db_url, "SELECT count(*) FROM inbox") == 1
    assert scalar(db_url, "SELECT count(*) FROM inbox_keys") == 1
    # Past the horizon a redelivery is a new message (docs/operating.md).
    await _store(engine, rec("1-0"))
    assert scalar(db_url, "SELECT count(*) FROM inbox WHERE idempotency_key = 'redis:orders:1-0'") == 1
    assert scalar(db_url, "SELECT count(*) FROM todos WHERE idempotency_key = 'redis:orders:1-0'") == 2


async def test_an_inbox_partition_with_an_ack_owed_is_kept_until_it_is_acked(
    engine: AsyncEngine, db_url: str
) -> None:
    await _store(engine, rec("1-0"), rec("2-0"))
    _age(db_url, 10)
    with psycopg.connect(libpq(db_url), autocommit=True) as conn:
        conn.execute(
            "UPDATE inbox SET ack_state = 'pending', acked_at = NULL WHERE idempotency_key LIKE '%%1-0'"
        )
    await upkeep_once(engine, _settings(7))  # begins partition 1
    done = await upkeep_once(engine, _settings(7))
    assert done.dropped == {"events": [0], "todo_events": [0]}
    assert scalar(db_url, "SELECT count(*) FROM inbox_p000000") == 2
    assert scalar(db_url, "SELECT count(*) FROM inbox_keys") == 2
    # Once acked, it goes (the owed partition is looked at again within the hour: not this test's).
    with psycopg.connect(libpq(db_url), autocommit=True) as conn:
        conn.execute("UPDATE inbox SET ack_state = 'acked', acked_at = now()")
    again = await upkeep_once(engine, _settings(7))
    assert again.dropped == {"inbox": [0]}
    assert scalar(db_url, "SELECT count(*) FROM inbox_keys") == 0


async def test_a_role_that_does_not_own_the_tables_is_told_not_failed(db_url: str) -> None:
    """The shipped acker role owns no table: it may not make a partition,
    and its pass says so instead of failing (ops/roles.sql)."""
    guest = "sb_partition_guest"
    with psycopg.connect(libpq(db_url), autocommit=True) as conn:
        conn.execute(f"CREATE ROLE {guest}")
        conn.execute(f"GRANT SELECT ON ALL TABLES IN SCHEMA public TO {guest}")
        conn.execute(f"GRANT SELECT, USAGE ON ALL SEQUENCES IN SCHEMA public TO {guest}")
        try:
            async with await psycopg.AsyncConnection.connect(
                libpq(db_url), autocommit=True, options=f"-c role={guest}"
            ) as pg:
                done = await partitions.upkeep(pg, period=timedelta(hours=1), keep=None)
        finally:
            conn.execute(f"REVOKE ALL ON ALL TABLES IN SCHEMA public FROM {guest}")
            conn.execute(f"REVOKE ALL ON ALL SEQUENCES IN SCHEMA public FROM {guest}")
            conn.execute(f"DROP ROLE {guest}")
    # Partition 1 was made by the migration; 2, ahead, was refused.
    assert done.refused == list(PARTITIONED_TABLES)
    assert done.made == {}


async def test_without_a_history_retention_one_partition_holds_it_all(
    engine: AsyncEngine, db_url: str
) -> None:
    await _store(engine, rec("1-0"))
    _age(db_url, 40)
    done = await upkeep_once(engine, _settings(None))
    assert (done.begun, done.dropped) == ({}, {})
    await _store(engine, rec("2-0"))
    assert _partition_of(db_url, "inbox", "idempotency_key", "redis:orders:2-0") == ["inbox_p000000"]


def _age_todos(db_url: str, days: float, where: str = "true") -> None:
    with psycopg.connect(libpq(db_url), autocommit=True) as conn:
        conn.execute(
            "UPDATE todos SET created_at = created_at - %(back)s, updated_at = updated_at - %(back)s"
            f" WHERE {where}",
            {"back": timedelta(days=days)},
        )


async def test_finished_todos_go_with_their_partition_and_unfinished_ones_stay(
    engine: AsyncEngine, db_url: str
) -> None:
    await _store(engine, rec("1-0"), rec("2-0"), rec("3-0"), rec("4-0"))
    with psycopg.connect(libpq(db_url), autocommit=True) as conn:
        conn.execute("UPDATE todos SET status = 'done' WHERE idempotency_key LIKE '%%1-0'")
        conn.execute("UPDATE todos SET status = 'cancelled' WHERE idempotency_key LIKE '%%2-0'")
        conn.execute("UPDATE todos SET status = 'failed' WHERE idempotency_key LIKE '%%3-0'")
    _age_todos(db_url, 10)
    assert {n for (n,) in query(db_url, "SELECT tableoid::regclass::text FROM todos")} == {
        "todos_live",
        "todos_done_p000000",
    }
    begun = await upkeep_once(engine, _settings(30, done_days=7))
    assert begun.begun == {"todos_done": 1}
    assert begun.dropped == {}
    await _store(engine, rec("5-0"))  # a new period's todo
    done = await upkeep_once(engine, _settings(30, done_days=7))
    assert done.dropped == {"todos_done": [0]}
    # The failed and the pending todo are live: kept, whatever their age.
    assert query(db_url, "SELECT idempotency_key, status FROM todos ORDER BY id") == [
        ("redis:orders:3-0", "failed"),
        ("redis:orders:4-0", "pending"),
        ("redis:orders:5-0", "pending"),
    ]
    # The pending one finishes after its period's partition went: it lands
    # in the late partition, and goes once it is as old.
    with psycopg.connect(libpq(db_url), autocommit=True) as conn:
        conn.execute(
            "UPDATE todos SET status = 'done', updated_at = now() WHERE idempotency_key LIKE '%%4-0'"
        )
    assert _partition_of(db_url, "todos", "idempotency_key", "redis:orders:4-0") == [partitions.LATE_TODOS]
    kept = await upkeep_once(engine, _settings(30, done_days=7))
    assert kept.late_deleted == 0
    _age_todos(db_url, 8, "status = 'done'")
    late = await upkeep_once(engine, _settings(30, done_days=7))
    assert late.late_deleted == 1
    assert scalar(db_url, "SELECT count(*) FROM todos WHERE idempotency_key LIKE '%%4-0'") == 0


async def test_a_todos_partition_is_kept_while_one_of_its_todos_finished_lately(
    engine: AsyncEngine, db_url: str
) -> None:
    await _store(engine, rec("1-0"), rec("2-0"))
    with psycopg.connect(libpq(db_url), autocommit=True) as conn:
        conn.execute("UPDATE todos SET status = 'done'")
    _age_todos(db_url, 10)
    # Made ten days ago, the second finished an hour ago (a long backoff).
    with psycopg.connect(libpq(db_url), autocommit=True) as conn:
        conn.execute(
            "UPDATE todos SET updated_at = now() - interval '1 hour' WHERE idempotency_key LIKE '%%2-0'"
        )
    await upkeep_once(engine, _settings(30, done_days=7))  # begins partition 1
    done = await upkeep_once(engine, _settings(30, done_days=7))
    assert done.dropped == {}
    assert scalar(db_url, "SELECT count(*) FROM todos_done_p000000") == 2


async def test_a_todo_that_finished_between_the_check_and_the_detach_is_kept(
    engine: AsyncEngine, db_url: str
) -> None:
    """The check reads a partition before its detach: a todo of its period
    finishing in between is in the detached table with a recent finish. It
    moves to the late partition; the others go with the table."""
    await _store(engine, rec("1-0"), rec("2-0"))
    with psycopg.connect(libpq(db_url), autocommit=True) as conn:
        conn.execute("UPDATE todos SET status = 'done'")
    _age_todos(db_url, 10)
    with psycopg.connect(libpq(db_url), autocommit=True) as conn:
        conn.execute("UPDATE todos SET updated_at = now() WHERE idempotency_key LIKE '%%2-0'")  # the race
    async with (
        await psycopg.AsyncConnection.connect(libpq(db_url), autocommit=True) as pg,
        pg.cursor() as cur,
    ):
        assert await partitions._retire(cur, pg, "todos_done", 0, timedelta(days=7))
    assert query(db_url, "SELECT idempotency_key, tableoid::regclass::text FROM todos") == [
        ("redis:orders:2-0", partitions.LATE_TODOS)
    ]
    assert scalar(db_url, "SELECT count(*) FROM pg_class WHERE relname = 'todos_done_p000000'") == 0


async def test_the_dedup_holds_for_a_todo_in_flight_across_the_move(engine: AsyncEngine, db_url: str) -> None:
    """A redelivery of a message whose todo is live dedups to it; once it
    finished (moved to todos_done), a message with the same key (a list
    body sent again) makes a new one."""
    body = InboxRecord(
        idempotency_key="redis:jobs:abc",
        source_message_id=None,
        body=b"{}",
        payload="{}",
        error=None,
        ack_ref="",
    )
    await _store(engine, body)
    await _store(engine, body)
    assert scalar(db_url, "SELECT count(*) FROM todos WHERE idempotency_key = 'redis:jobs:abc'") == 1
    with psycopg.connect(libpq(db_url), autocommit=True) as conn:
        conn.execute("UPDATE todos SET status = 'done'")
    await _store(engine, body)
    assert query(db_url, "SELECT status FROM todos WHERE idempotency_key = 'redis:jobs:abc' ORDER BY id") == [
        ("done",),
        ("pending",),
    ]


@pytest.mark.parametrize("table", PARTITIONED_TABLES)
def test_partition_names_and_bounds(table: str) -> None:
    assert partitions.partition_name(table, 3) == f"{table}_p000003"
    assert partitions.number_of(partitions.first_id(3)) == 3
    assert partitions.number_of(partitions.first_id(3) - 1) == 2
