"""The process skeleton of ``ingest`` and ``ack``: the order of its stop, its
one deadline, and a stop during start-up. The database is a closed port: the
heartbeat fails and goes on, as it would during an outage."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, MutableMapping
from typing import Any

import pytest
import structlog
from sqlalchemy.ext.asyncio import AsyncEngine

from ingest.config import Settings, from_mapping
from ingest.processes.skeleton import Job, Process, ProcessBody, run_process

SETTINGS = from_mapping({"database": {"url": "postgresql://127.0.0.1:1/nowhere"}}, {})


class _Body(ProcessBody):
    role = "test"
    stopped_event = "test_stopped"
    overdue_field = "stuck"

    def __init__(self, engine: AsyncEngine, *, starts: bool = True, stubborn: bool = False) -> None:
        self.shutdown_timeout_s = 0.5
        self.engine = engine
        self.starts = starts
        self.stubborn = stubborn
        self.said: list[str] = []

    async def start(self, process: Process) -> bool:
        self.said.append("start")
        assert process.engine is self.engine
        return self.starts

    def spawn(self, process: Process) -> None:
        self.said.append("spawn")
        process.work(self._loop(process.stop), name="loop")
        process.beside(self._beside(process.stop), name="beside")
        if self.stubborn:
            process.work(asyncio.sleep(3600), name="stubborn")

    async def _loop(self, stop: asyncio.Event) -> None:
        await stop.wait()
        self.said.append("loop ended")

    async def _beside(self, stop: asyncio.Event) -> None:
        await stop.wait()
        await asyncio.sleep(0.7)  # past the deadline: not waited for under it
        self.said.append("beside ended")

    def detail(self) -> Mapping[str, Any]:
        return {}

    def gauges(self, process: Process, interval_s: float) -> tuple[str, Job]:
        raise AssertionError("asked for without [metrics] port")

    async def close(self) -> None:
        self.said.append("close")


async def _run(settings: Settings, **kwargs: bool) -> tuple[_Body, list[MutableMapping[str, Any]]]:
    stop = asyncio.Event()
    bodies: list[_Body] = []

    def build(engine: AsyncEngine) -> _Body:
        bodies.append(_Body(engine, **kwargs))
        return bodies[0]

    asyncio.get_running_loop().call_later(0.3, stop.set)
    with structlog.testing.capture_logs() as logged:
        await asyncio.wait_for(run_process(settings, stop, build), timeout=30)
    return bodies[0], logged


async def test_stop_ends_the_work_then_the_tasks_beside_it_then_closes_and_says_so() -> None:
    body, logged = await _run(SETTINGS)
    assert body.said == ["start", "spawn", "loop ended", "beside ended", "close"]
    events = [e["event"] for e in logged]
    assert events[-1] == "test_stopped"
    assert "shutdown_deadline_exceeded" not in events
    assert "heartbeat_failed" in events, "the heartbeat ran beside the work"


async def test_work_still_running_at_the_deadline_is_named_and_cancelled() -> None:
    body, logged = await _run(SETTINGS, stubborn=True)
    [overdue] = [e for e in logged if e["event"] == "shutdown_deadline_exceeded"]
    assert overdue["stuck"] == ["stubborn"]
    assert overdue["log_level"] == "error"
    assert body.said[-1] == "close"
    assert logged[-1]["event"] == "test_stopped"


async def test_a_stop_during_start_up_spawns_nothing_and_still_closes() -> None:
    body, logged = await _run(SETTINGS, starts=False)
    assert body.said == ["start", "close"]
    assert [e["event"] for e in logged] == ["test_stopped"]


async def test_tasks_are_spawned_only_inside_the_task_group() -> None:
    process = Process(SETTINGS, None, None, asyncio.Event())  # type: ignore[arg-type]
    job = asyncio.sleep(0)
    with pytest.raises(RuntimeError, match=r"ProcessBody\.spawn"):
        process.work(job, name="early")
    job.close()


async def test_a_body_that_cannot_be_built_still_disposes_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine is made before the body (the body is built on it): a build
    that fails, a config error found on the way, leaves no pool behind and
    logs no stopped line, as the process never started."""
    made: list[AsyncEngine] = []

    def build(engine: AsyncEngine) -> ProcessBody:
        made.append(engine)
        raise RuntimeError("no such acknowledger")

    disposed: list[AsyncEngine] = []

    async def dispose(self: AsyncEngine, close: bool = True) -> None:
        disposed.append(self)

    monkeypatch.setattr(AsyncEngine, "dispose", dispose)
    with (
        structlog.testing.capture_logs() as logged,
        pytest.raises(RuntimeError, match="no such acknowledger"),
    ):
        await run_process(SETTINGS, asyncio.Event(), build)
    assert disposed == made
    assert len(made) == 1
    assert not [e for e in logged if e["event"] == "test_stopped"]
