"""The ingester's counters against what reached PostgreSQL, through the
poll loop over real PostgreSQL with the in-memory adapter: a batch whose
later chunk fails still counts the chunk that committed, and its
redelivery counts as deduplicated, not stored again."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import pytest
from prometheus_client import REGISTRY
from sqlalchemy.ext.asyncio import AsyncEngine

from backhalf import metrics
from ingest.adapters.memory import MemoryAdapter
from ingest.processes.pull.poll import PollLoop
from tests.integration.processes.test_poll_loop import FAST, config, wait_until
from tests.support.db import query, scalar


@pytest.fixture
def registered() -> tuple[tuple[str, str], ...]:
    return (("mem", "stream"),)


def counted(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, {"adapter": "mem", **labels}) or 0.0


NAMES = {
    "stored": ("switchboard_messages_stored_total", {}),
    "inbox_dedup": ("switchboard_messages_deduplicated_total", {"layer": "inbox"}),
    "invalid_json": ("switchboard_messages_rejected_total", {"reason": "invalid_json"}),
    "todos": ("switchboard_todos_created_total", {}),
    "consumed": ("switchboard_messages_consumed_total", {}),
}


def snapshot() -> dict[str, float]:
    return {k: counted(name, **labels) for k, (name, labels) in NAMES.items()}


async def test_a_failed_chunk_leaves_the_committed_ones_counted(engine: AsyncEngine, db_url: str) -> None:
    metrics.switch_on()  # as a process with [metrics] port does
    before = snapshot()
    # Fails the todo of n = 2 until dropped: the batch's second chunk.
    query(
        db_url,
        """CREATE FUNCTION fail_two() RETURNS trigger LANGUAGE plpgsql AS
           $$ BEGIN IF NEW.payload->>'n' = '2' THEN RAISE EXCEPTION 'refused by test'; END IF;
              RETURN NEW; END $$;
           CREATE TRIGGER fail_two BEFORE INSERT ON todos FOR EACH ROW EXECUTE FUNCTION fail_two();""",
    )
    bodies = [json.dumps({"n": n, "pad": "x" * 300}).encode() for n in (1, 2)] + [b"{bad json"]
    adapter = MemoryAdapter("mem", bodies)
    settings = replace(FAST, max_batch_bytes=400)  # one message per transaction
    stop = asyncio.Event()
    task = asyncio.create_task(PollLoop(adapter, config(db_url), engine, settings, stop).run())
    try:
        await wait_until(lambda: adapter.reads >= 3)  # the batch failed, was read again, failed again
        assert scalar(db_url, "SELECT count(*) FROM inbox") == 1  # n = 1's chunk committed
        assert snapshot()["stored"] - before["stored"] == 1
        # Off the event loop: DROP TRIGGER waits for the loop's transaction
        # to end, which a blocked event loop would never let it do.
        await asyncio.to_thread(query, db_url, "DROP TRIGGER fail_two ON todos")
        await wait_until(lambda: scalar(db_url, "SELECT count(*) FROM inbox") == 3)
    finally:
        stop.set()
        async with asyncio.timeout(10):
            await task
    after = snapshot()
    delta = {k: after[k] - before[k] for k in after}
    assert scalar(db_url, "SELECT count(*) FROM inbox") == delta["stored"] == 3
    assert scalar(db_url, "SELECT count(*) FROM todos") == delta["todos"] == 2
    assert (
        scalar(db_url, "SELECT count(*) FROM inbox WHERE status = 'rejected'") == delta["invalid_json"] == 1
    )
    # n = 1 was delivered again with every retry of the batch, and deduplicated each time.
    extra = scalar(db_url, "SELECT sum(deliveries) - count(*) FROM inbox")
    assert delta["inbox_dedup"] == extra >= 1
    assert delta["consumed"] >= 3 + extra  # every delivery read, failed batches' included
