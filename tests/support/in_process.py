"""The ingester and acker in the test's own event loop (integration tests):
settings from plain adapter tables, the pipeline as a context that checks
nothing is left running, and a bounded wait."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import AsyncIterator, Callable
from typing import Any

from ingest.config import Settings, from_mapping
from ingest.processes.ack.acker import run_acker
from ingest.processes.pull.ingester import run_ingester

JOBS = "jobs"


def settings(db_url: str, redis_url: str, *adapters: dict[str, Any]) -> Settings:
    return from_mapping(
        {
            "database": {"url": db_url},
            "redis": {"url": redis_url},
            "adapters": list(adapters),
            "acker": {"poll_interval_ms": 100},
            "ingest": {"backoff_initial_ms": 20, "backoff_max_ms": 200},
        },
        {},
    )


def list_adapter(**kw: Any) -> dict[str, Any]:
    return {"name": JOBS, "mode": "list", "source": JOBS, "consumer": "c1", "block_ms": 100, **kw}


@contextlib.asynccontextmanager
async def pipeline(s: Settings, *more: Settings, acker: bool = True) -> AsyncIterator[None]:
    """The ingester (and the acker) of ``s`` in this event loop, and an
    ingester of each of ``more`` beside it (another consumer of the same
    source), until the ``async with`` ends; everything they started is gone
    after."""
    stop = asyncio.Event()
    # The test's own clients (a NATS connection's reader and pinger) may run
    # beside the pipeline: only what the pipeline started must be gone after.
    before = asyncio.all_tasks()
    async with asyncio.TaskGroup() as tg:
        tg.create_task(run_ingester(s, stop))
        for other in more:
            tg.create_task(run_ingester(other, stop))
        if acker:
            tg.create_task(run_acker(s, stop))
        try:
            yield
        finally:
            stop.set()
    left = [
        t.get_name() for t in asyncio.all_tasks() - before if t is not asyncio.current_task() and not t.done()
    ]
    assert left == [], left


async def wait_until(predicate: Callable[[], Any], timeout_s: float = 20) -> None:
    """Poll ``predicate`` (a coroutine function too: its result is awaited)
    until it is true, for at most ``timeout_s``."""
    async with asyncio.timeout(timeout_s):
        while True:
            result = predicate()
            if inspect.isawaitable(result):
                result = await result
            if result:
                return
            await asyncio.sleep(0.05)
