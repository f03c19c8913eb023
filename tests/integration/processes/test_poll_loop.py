"""The poll loop with the in-memory adapter over real PostgreSQL: the runtime
flag, failure handling and a clean stop."""

from __future__ import annotations

import asyncio
import gc
import json
from dataclasses import replace

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from backhalf.writes import registry
from ingest.adapters.base import Delivery
from ingest.adapters.memory import MemoryAdapter
from ingest.config import IngestSettings, from_mapping
from ingest.errors import BrokerError
from ingest.lifecycle import leftover_tasks
from ingest.processes.pull.poll import PollLoop
from tests.support.db import query, scalar

FAST = IngestSettings(enabled_refresh_ms=50, backoff_initial_ms=10, backoff_max_ms=50, shutdown_timeout_s=5)


@pytest.fixture
def registered() -> tuple[tuple[str, str], ...]:
    return (("mem", "stream"),)


def config(db_url: str):  # type: ignore[no-untyped-def]
    raw = {"database": {"url": db_url}, "adapters": [{"name": "mem", "source": "mem", "batch_size": 10}]}
    return from_mapping(raw, {}).adapters[0]


async def wait_until(predicate, timeout_s: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    async with asyncio.timeout(timeout_s):
        while not predicate():  # noqa: ASYNC110 - polling the database, not an event
            await asyncio.sleep(0.02)


async def test_loop_stores_everything_then_stops_cleanly(engine: AsyncEngine, db_url: str) -> None:
    adapter = MemoryAdapter("mem", [f'{{"n": {i}}}'.encode() for i in range(35)])
    stop = asyncio.Event()
    task = asyncio.create_task(PollLoop(adapter, config(db_url), engine, FAST, stop).run())
    await wait_until(lambda: scalar(db_url, "SELECT count(*) FROM todos") == 35)
    stop.set()
    async with asyncio.timeout(5):
        await task
    assert leftover_tasks() == []
    assert query(db_url, "SELECT count(*), count(DISTINCT idempotency_key) FROM todos") == [(35, 35)]


async def test_disabled_adapter_does_not_read_and_resumes_when_enabled(
    engine: AsyncEngine, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    checks: list[bool] = []
    real_is_enabled = registry.is_enabled

    async def counting_is_enabled(conn, name):  # type: ignore[no-untyped-def]
        checks.append(await real_is_enabled(conn, name))  # still the real query
        return checks[-1]

    monkeypatch.setattr(registry, "is_enabled", counting_is_enabled)
    query(db_url, "UPDATE adapters SET enabled = false WHERE name = 'mem'")
    adapter = MemoryAdapter("mem", [b'{"n": 1}'])
    stop = asyncio.Event()
    task = asyncio.create_task(PollLoop(adapter, config(db_url), engine, FAST, stop).run())
    try:
        # The flag is re-read several times; the broker is never asked.
        await wait_until(lambda: len(checks) >= 5)
        assert adapter.reads == 0
        assert not any(checks)
        assert scalar(db_url, "SELECT count(*) FROM inbox") == 0
        query(db_url, "UPDATE adapters SET enabled = true WHERE name = 'mem'")
        await wait_until(lambda: scalar(db_url, "SELECT count(*) FROM todos") == 1)
    finally:
        stop.set()
        await task


async def test_store_failure_backs_off_and_redelivers_from_pending(engine: AsyncEngine, db_url: str) -> None:
    # A real database fault: a trigger that fails every todo insert until dropped.
    query(
        db_url,
        """CREATE FUNCTION fail_todo() RETURNS trigger LANGUAGE plpgsql AS
           $$ BEGIN RAISE EXCEPTION 'todo insert refused by test'; END $$;
           CREATE TRIGGER fail_todo BEFORE INSERT ON todos FOR EACH ROW EXECUTE FUNCTION fail_todo();""",
    )
    adapter = MemoryAdapter("mem", [b'{"n": 1}', b'{"n": 2}'])
    stop = asyncio.Event()
    task = asyncio.create_task(PollLoop(adapter, config(db_url), engine, FAST, stop).run())
    try:
        await wait_until(lambda: adapter.reads >= 4)  # retried, from the pending set
        assert scalar(db_url, "SELECT count(*) FROM inbox") == 0  # the whole batch rolled back
        assert set(adapter.pending) == {"1-0", "2-0"}
        # Off the event loop: DROP TRIGGER waits for the loop's transaction
        # to end, which a blocked event loop would never let it do.
        await asyncio.to_thread(query, db_url, "DROP TRIGGER fail_todo ON todos")
        await wait_until(lambda: scalar(db_url, "SELECT count(*) FROM todos") == 2)
    finally:
        stop.set()
        await task
    assert query(db_url, "SELECT count(*), count(DISTINCT idempotency_key) FROM todos") == [(2, 2)]


async def test_a_batch_over_max_batch_bytes_is_stored_in_several_transactions(
    engine: AsyncEngine, db_url: str
) -> None:
    bodies = [json.dumps({"n": i, "pad": "x" * 100}).encode() for i in range(10)]
    adapter = MemoryAdapter("mem", bodies)
    settings = replace(FAST, max_batch_bytes=1000)  # about three messages per transaction
    stop = asyncio.Event()
    task = asyncio.create_task(PollLoop(adapter, config(db_url), engine, settings, stop).run())
    try:
        await wait_until(lambda: scalar(db_url, "SELECT count(*) FROM todos") == 10)
    finally:
        stop.set()
        await task
    # One batch of ten (batch_size 10), committed in chunks: several transactions.
    assert adapter.reads >= 1
    assert scalar(db_url, "SELECT count(DISTINCT xmin::text) FROM todos") >= 3
    assert query(db_url, "SELECT count(DISTINCT idempotency_key) FROM inbox") == [(10,)]


class _FailingRead(MemoryAdapter):
    """A read that fails once its caller has been cancelled meanwhile."""

    async def read(self, max_count: int) -> list[Delivery]:
        raise BrokerError("adapter mem: reading mem: Connection closed by server.")


async def test_a_read_failing_as_its_caller_is_cancelled_is_not_left_unretrieved(
    engine: AsyncEngine, db_url: str
) -> None:
    # Seen in CI: at stop the prefetch was cancelled just as its read failed
    # (Redis closed the connection); the read's error was never retrieved,
    # and asyncio logged it with a traceback at garbage collection.
    loop = asyncio.get_running_loop()
    reported: list[dict[str, object]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    try:
        poll = PollLoop(_FailingRead("mem", []), config(db_url), engine, FAST, asyncio.Event())
        caller = asyncio.create_task(poll._read_unless_stopped(10))
        await asyncio.sleep(0)  # the caller waits on the read; the read fails as the cancel lands
        caller.cancel()
        await asyncio.wait({caller})
        assert caller.cancelled()
        del caller, poll  # the read task goes with the caller's frame
        for _ in range(3):
            gc.collect()
            await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(previous)
    assert [c for c in reported if "never retrieved" in str(c.get("message"))] == []


class _Redelivering(MemoryAdapter):
    """Its second message comes as a third delivery (a suspect, stored
    alone); the others as first ones."""

    async def read(self, max_count: int) -> list[Delivery]:
        batch = await super().read(max_count)
        return [d._replace(deliveries=3) if d.message_id == "2-0" else d for d in batch]


@pytest.mark.parametrize("ordered", [True, False])
async def test_an_ordered_adapters_messages_after_a_suspect_are_stored_after_it(
    engine: AsyncEngine, db_url: str, ordered: bool
) -> None:
    """A redelivered suspect is stored alone after the batch (issue 27's
    review): an ordered adapter's (an SQS FIFO queue's) later messages go
    with it, one by one in order, instead of committing before it."""
    adapter = _Redelivering("mem", [f'{{"n": {i}}}'.encode() for i in range(1, 6)])
    adapter.ordered = ordered
    stop = asyncio.Event()
    task = asyncio.create_task(PollLoop(adapter, config(db_url), engine, FAST, stop).run())
    await wait_until(lambda: scalar(db_url, "SELECT count(*) FROM inbox") == 5)
    stop.set()
    async with asyncio.timeout(5):
        await task
    stored = [json.loads(bytes(b))["n"] for (b,) in query(db_url, "SELECT body FROM inbox ORDER BY id")]
    # Unordered, the suspect (n 2) comes last, after the batch around it.
    assert stored == ([1, 2, 3, 4, 5] if ordered else [1, 3, 4, 5, 2])
