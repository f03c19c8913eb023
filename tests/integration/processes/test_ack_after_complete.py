"""``ack_after = "complete"`` against real PostgreSQL: a stored message's ack
waits for its todo's end, and every way a todo ends releases it to the
acker, including an end that races the store of a message deduped to it."""

from __future__ import annotations

import asyncio
import threading

import psycopg
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from backhalf.db import DatabaseSettings, create_sync_engine, driver_connection
from backhalf.db_errors import is_transient
from backhalf.errors import StoreError
from backhalf.lifecycle import todos
from backhalf.lifecycle.state_writer import StateWriter
from backhalf.records import AckTarget, InboxRecord, Provenance, StoreBatch
from backhalf.writes import acks
from backhalf.writes.store import store
from tests.support.db import claim_todo, end, libpq, query, scalar

PULLED = Provenance(family="queue", trust_mode="queue", verified=False, verify_detail="redis acl: default")


@pytest.fixture
def registered() -> tuple[tuple[str, str], ...]:
    return (("orders", "stream"), ("jobs", "list"))


def entry(n: int, payload: str | None = '{"n": 1}', *, deliveries: int = 1) -> InboxRecord:
    entry_id = f"{n}-0"
    error = None if payload is not None else "invalid JSON"
    return InboxRecord(
        f"redis:orders:{entry_id}",
        entry_id,
        b"{}",
        payload,
        error,
        ack_ref=entry_id,
        deliveries=deliveries,
    )


def stream_batch(*records: InboxRecord) -> StoreBatch:
    return StoreBatch(
        "orders",
        "orders",
        "c1",
        "complete",
        AckTarget("xack", "orders", "switchboard", by_cursor=True),
        PULLED,
        records,
    )


def list_batch(processing: str, body: bytes = b'{"job": 1}') -> StoreBatch:
    record = InboxRecord("redis:jobs:" + "ab" * 32, None, body, body.decode(), ack_key=processing)
    return StoreBatch(
        "jobs", "jobs", "c1", "complete", AckTarget("lrem", processing, None, by_body=True), PULLED, [record]
    )


async def claim(engine: AsyncEngine, adapter: str = "orders") -> list[int]:
    """What the acker would claim now (rolled back: a look, not an ack)."""
    async with engine.connect() as conn, conn.begin() as tx:
        claimed = [c.inbox_id for c in await acks.claim(conn, [adapter], 100)]
        await tx.rollback()
    return claimed


def run_to(db_url: str, todo_id: int, to_status: str) -> None:
    """A worker's run of the todo, from its claim to ``to_status`` (pending:
    a retry, due again at once)."""
    run = claim_todo(db_url, todo_id)
    assert end(db_url, todos.Ending(run, to_status, None, to_status)) == ({todo_id}, set())


async def test_the_ack_waits_for_the_todo_and_is_owed_once_it_is_done(
    engine: AsyncEngine, db_url: str
) -> None:
    async with engine.begin() as conn:
        await store(conn, stream_batch(entry(1), entry(2)))
    (todo_1, todo_2) = [r[0] for r in query(db_url, "SELECT id FROM todos ORDER BY id")]
    assert query(db_url, "SELECT waiting_for FROM ack_queue ORDER BY inbox_id") == [(todo_1,), (todo_2,)]
    assert await claim(engine) == []
    run_to(db_url, todo_1, "pending")  # a retry is no end
    assert await claim(engine) == []
    run_to(db_url, todo_1, "done")
    (inbox_1,) = query(db_url, "SELECT id FROM inbox WHERE todo_id = %(t)s", {"t": todo_1})[0]
    assert await claim(engine) == [inbox_1]
    run_to(db_url, todo_2, "failed")  # failed is an end too
    assert len(await claim(engine)) == 2


async def test_cancel_and_the_rescuers_failure_release_the_ack(engine: AsyncEngine, db_url: str) -> None:
    async with engine.begin() as conn:
        await store(conn, stream_batch(entry(1), entry(2)))
    (todo_1, todo_2) = [r[0] for r in query(db_url, "SELECT id FROM todos ORDER BY id")]
    async with engine.begin() as conn:
        assert await todos.cancel(conn, [todo_1], "cancelled by an operator") == [todo_1]
    claim_todo(db_url, todo_2)
    query(
        db_url, "UPDATE todos SET lease_until = now() - interval '1 second' WHERE id = %(t)s", {"t": todo_2}
    )
    async with engine.begin() as conn:
        pg = await driver_connection(conn)
        async with pg.cursor() as cur:
            # Its worker died on its last attempt: failed, which is an end.
            assert await todos.rescue(cur, [("orders", 1)], 10) == [(todo_2, "orders", "failed")]
    assert len(await claim(engine)) == 2
    assert scalar(db_url, "SELECT count(*) FROM ack_queue WHERE waiting_for IS NOT NULL") == 0


async def test_a_rejected_message_has_no_todo_to_wait_for(engine: AsyncEngine, db_url: str) -> None:
    async with engine.begin() as conn:
        await store(conn, stream_batch(entry(1, None)))
    assert scalar(db_url, "SELECT count(*) FROM todos") == 0
    assert len(await claim(engine)) == 1


async def test_a_redelivery_after_the_todo_ended_is_acked_at_once(engine: AsyncEngine, db_url: str) -> None:
    """Acked once its todo was done, then delivered again (its group was
    recreated): no new todo, and its ack is owed now, not waiting forever."""
    async with engine.begin() as conn:
        await store(conn, stream_batch(entry(1)))
    todo_id = scalar(db_url, "SELECT id FROM todos")
    run_to(db_url, todo_id, "done")
    async with engine.begin() as conn:
        assert len(await acks.claim(conn, ["orders"], 10)) == 1
    async with engine.begin() as conn:
        await store(conn, stream_batch(entry(1, deliveries=2)))
    assert scalar(db_url, "SELECT count(*) FROM todos") == 1
    assert query(db_url, "SELECT waiting_for FROM ack_queue") == [(None,)]


async def test_a_redelivery_while_the_todo_runs_keeps_waiting(engine: AsyncEngine, db_url: str) -> None:
    async with engine.begin() as conn:
        await store(conn, stream_batch(entry(1)))
    todo_id = scalar(db_url, "SELECT id FROM todos")
    async with engine.begin() as conn:
        await store(conn, stream_batch(entry(1, deliveries=2)))
    assert query(db_url, "SELECT waiting_for FROM ack_queue") == [(todo_id,)]
    assert await claim(engine) == []


async def test_a_redelivery_of_a_retried_todo_waits_for_its_new_end(engine: AsyncEngine, db_url: str) -> None:
    """Acked once its todo failed, then the todo retried by an operator
    (active again) and the entry delivered again: its ack waits for the
    todo's new end (read FOR SHARE, still active), not owed at once."""
    async with engine.begin() as conn:
        await store(conn, stream_batch(entry(1)))
    todo_id = scalar(db_url, "SELECT id FROM todos")
    run_to(db_url, todo_id, "failed")
    async with engine.begin() as conn:
        assert len(await acks.claim(conn, ["orders"], 10)) == 1
        assert await todos.retry(conn, [todo_id], "retried by an operator") == [todo_id]
    async with engine.begin() as conn:
        await store(conn, stream_batch(entry(1, deliveries=2)))
    assert query(db_url, "SELECT waiting_for FROM ack_queue") == [(todo_id,)]
    assert await claim(engine) == []


async def test_a_redelivery_racing_its_todos_end_is_owed_at_once(engine: AsyncEngine, db_url: str) -> None:
    """The todo (active again after a retry) ends while a redelivery of its
    entry is being stored: the store waits for the end's row lock (FOR
    SHARE). The end moved the todo to the finished todos' partition, so
    the store's lock fails with a serialization failure, a transient error
    the poll loop retries (it never counts against the message); the retry
    reads the todo as ended and queues the ack as owed now. A plain read
    would see it active in the statement's snapshot, queue it waiting, and
    the end's release, already run, would never see it."""
    async with engine.begin() as conn:
        await store(conn, stream_batch(entry(1)))
    todo_id = scalar(db_url, "SELECT id FROM todos")
    run_to(db_url, todo_id, "failed")
    async with engine.begin() as conn:
        await acks.claim(conn, ["orders"], 10)
        await todos.retry(conn, [todo_id], "retried by an operator")
    run = claim_todo(db_url, todo_id)
    ender = psycopg.connect(libpq(db_url))
    try:
        held, _ = todos.end_runs(ender, [todos.Ending(run, "done", None, "done")])  # committed
        assert held == {todo_id}
        # The same end, as a transaction still open: the lock the store meets.
        query(db_url, "UPDATE todos SET status = 'running' WHERE id = %(t)s", {"t": todo_id})
        ender.execute("UPDATE todos SET status = 'done' WHERE id = %s", (todo_id,))
        storing = asyncio.ensure_future(
            _store_in_own_transaction(engine, stream_batch(entry(1, deliveries=2)))
        )
        for _ in range(200):
            waiting = scalar(db_url, "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'")
            if waiting:
                break
            await asyncio.sleep(0.025)
        assert waiting, "the store never waited for the end's lock"
        ender.commit()
        with pytest.raises(StoreError) as raced:
            await asyncio.wait_for(storing, timeout=10)
    finally:
        ender.close()
    assert isinstance(raced.value.__cause__, psycopg.errors.SerializationFailure)
    assert is_transient(raced.value)
    assert query(db_url, "SELECT count(*) FROM ack_queue") == [(0,)], "the failed store left nothing"
    await _store_in_own_transaction(engine, stream_batch(entry(1, deliveries=2)))  # the poll loop's retry
    assert query(db_url, "SELECT waiting_for FROM ack_queue") == [(None,)]


async def _store_in_own_transaction(engine: AsyncEngine, batch: StoreBatch) -> None:
    async with engine.begin() as conn:
        await store(conn, batch)


async def test_list_copies_merge_into_the_waiting_row(engine: AsyncEngine, db_url: str) -> None:
    """A second copy of a body on the same processing list merges into its
    pending row while the todo runs: one todo, one LREM of both copies, and
    list recovery counts both as stored."""
    for _ in range(2):
        async with engine.begin() as conn:
            await store(conn, list_batch("jobs:processing:c1"))
    assert scalar(db_url, "SELECT count(*) FROM todos") == 1
    assert query(db_url, "SELECT ack_copies FROM inbox") == [(2,)]
    async with engine.begin() as conn:
        (intent,) = await acks.lock_pending_copies(conn, "jobs", "jobs:processing:c1")
    assert intent.copies == 2
    assert await claim(engine, "jobs") == []
    run_to(db_url, scalar(db_url, "SELECT id FROM todos"), "done")
    assert len(await claim(engine, "jobs")) == 1


async def test_an_end_racing_a_store_deduped_to_its_todo_still_releases_it(
    engine: AsyncEngine, db_url: str
) -> None:
    """A copy of the body on another processing list is stored (deduped to
    the running todo, so it holds the todo locked) while the run ends. The
    worker's end does not wait for the lock: answered busy, it is written
    once the store has committed, and its release, a statement after it,
    sees the new row. A release made before the end would find the todo
    still running and release nothing; the new row would wait forever."""
    async with engine.begin() as conn:
        await store(conn, list_batch("jobs:processing:c1"))
    todo_id = scalar(db_url, "SELECT id FROM todos")
    writer = StateWriter(
        create_sync_engine(DatabaseSettings(url=db_url), pool_size=1), deadline_ms=10_000, threads=2
    )
    try:
        run = claim_todo(db_url, todo_id)
        conn = await engine.connect()
        try:
            tx = await conn.begin()
            await store(conn, list_batch("jobs:processing:c2"))  # uncommitted, holds the todo
            ended: list[bool] = []
            ender = threading.Thread(
                target=lambda: ended.append(writer.end(todos.Ending(run, "done", None, "done")))
            )
            ender.start()
            for _ in range(400):
                if writer.busy_answers:
                    break
                await asyncio.sleep(0.025)
            assert writer.busy_answers, "the end never met the store's lock"
            await tx.commit()
        finally:
            await conn.close()
        ender.join(timeout=10)
    finally:
        writer.close()
    assert ended == [True]
    assert scalar(db_url, "SELECT count(*) FROM ack_queue WHERE waiting_for IS NOT NULL") == 0
    assert len(await claim(engine, "jobs")) == 2


async def test_the_rescuer_releases_acks_a_worker_left_waiting(engine: AsyncEngine, db_url: str) -> None:
    """A worker whose config knew of no adapter acking on complete ended the
    todo without releasing its ack (release=False): the rescuer's sweep
    releases it, and leaves alone an ack whose todo still runs."""
    async with engine.begin() as conn:
        await store(conn, stream_batch(entry(1), entry(2)))
    (todo_1, _todo_2) = [r[0] for r in query(db_url, "SELECT id FROM todos ORDER BY id")]
    run = claim_todo(db_url, todo_1)
    assert end(db_url, todos.Ending(run, "done", None, "done"), release=False) == ({todo_1}, set())
    assert await claim(engine) == []
    async with engine.begin() as conn:
        pg = await driver_connection(conn)
        async with pg.cursor() as cur:
            assert await todos.release_orphaned_acks(cur, 100) == 1
    (inbox_1,) = query(db_url, "SELECT id FROM inbox WHERE todo_id = %(t)s", {"t": todo_1})[0]
    assert await claim(engine) == [inbox_1]
