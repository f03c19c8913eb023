"""The one shape of the long-running asyncio processes, ``switchboard
ingest`` and ``switchboard ack``: :func:`run_process` runs a
:class:`ProcessBody` inside it, and owns everything the two have in common.

In order:

1. the ``[metrics]`` endpoint is bound (a port that cannot be bound is a
   ConfigError, before any work) and the engine is made; the body is built
   on the engine;
2. the body's ``start``: its start-up work, retried while the database is
   away; a stop during it ends the process there;
3. one TaskGroup: the body's tasks (``spawn``), then the heartbeat and, with
   ``[metrics] port`` set, the body's gauges;
4. on stop, one deadline (the body's ``shutdown_timeout_s``) for the work:
   each task spawned with :meth:`Process.work`, the heartbeat and the gauges.
   What still runs at the deadline is logged (``shutdown_deadline_exceeded``)
   and cancelled. A task spawned with :meth:`Process.beside` ends on stop by
   itself, or is cancelled by one that watches stop; the deadline does not
   wait for it, the TaskGroup's exit does;
5. whatever happened: the body's ``close`` (its broker connections), the
   engine disposed, the body's stopped event logged, the endpoint closed.

A failure of start-up or of a task propagates (the TaskGroup cancels the
others first) and the CLI turns it into the exit code.
"""

from __future__ import annotations

import abc
import asyncio
import gc
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, ClassVar

import structlog
from sqlalchemy.ext.asyncio import AsyncEngine

from backhalf import tracing
from backhalf.db import create_engine
from ingest.config import Settings
from ingest.errors import ConfigError
from ingest.observe.dependency import Dependency
from ingest.observe.heartbeat import heartbeat_loop, loop_bound_s, new_liveness, serving
from ingest.observe.metrics_http import Liveness

log = structlog.get_logger(__name__)

Job = Coroutine[Any, Any, None]


class Process:
    """What a body is given: the settings, the engine, the stop event, the
    liveness its loops tick, and (in ``spawn``) the process's TaskGroup
    through :meth:`work` and :meth:`beside`."""

    def __init__(self, settings: Settings, engine: AsyncEngine, liveness: Liveness, stop: asyncio.Event):
        self.settings = settings
        self.engine = engine
        self.liveness = liveness
        self.stop = stop
        self.group: asyncio.TaskGroup | None = None
        self.working: list[asyncio.Task[None]] = []

    @property
    def deadline_ms(self) -> int:
        """The transaction deadline, which the process's loops and its heartbeat use."""
        return self.settings.database.transaction_deadline_ms

    def watch(self, loop: str, own_interval_s: float = 0.0) -> Callable[[], None]:
        """The tick of a loop that sleeps up to ``own_interval_s`` between
        turns: /healthz calls it stuck after ``loop_bound_s`` without one."""
        return self.liveness.watch(loop, loop_bound_s(self.settings, own_interval_s))

    def dependency(self, server: str) -> Dependency:
        """How a loop reports a server it needs (``server``: a label, no
        credential): every process judges its servers by the same rule
        (``ingest.observe.dependency``)."""
        return Dependency(self.liveness, server)

    def work(self, job: Job, name: str) -> asyncio.Task[None]:
        """A task that ends on stop, waited for under the shutdown deadline."""
        task = self._group().create_task(job, name=name)
        self.working.append(task)
        return task

    def beside(self, job: Job, name: str) -> asyncio.Task[None]:
        """A task that ends on stop by itself, or is cancelled on stop: the
        deadline does not wait for it."""
        return self._group().create_task(job, name=name)

    def _group(self) -> asyncio.TaskGroup:
        if self.group is None:
            raise RuntimeError("tasks are spawned in ProcessBody.spawn, inside the process's TaskGroup")
        return self.group


class ProcessBody(abc.ABC):
    """What one process does in the skeleton (see the module docstring)."""

    # The heartbeat's role ("ingest", "ack"), the last line it logs, and the
    # field of ``shutdown_deadline_exceeded`` that names the tasks still
    # running at the deadline (each process has kept its own name).
    role: ClassVar[str]
    stopped_event: ClassVar[str]
    overdue_field: ClassVar[str]
    shutdown_timeout_s: float
    # Whether the process traces (DESIGN.md section 14) when the OTEL_*
    # variables ask for it: those whose work is a message's (ingest, receive).
    traced: ClassVar[bool] = False

    @abc.abstractmethod
    async def start(self, process: Process) -> bool:
        """Start-up work, before any task; False: stop came first."""

    @abc.abstractmethod
    def spawn(self, process: Process) -> None:
        """Create the process's own tasks with ``process.work`` and ``process.beside``."""

    @abc.abstractmethod
    def detail(self) -> Mapping[str, Any]:
        """What the heartbeat row says of the process, read at every beat."""

    @abc.abstractmethod
    def gauges(self, process: Process, interval_s: float) -> tuple[str, Job]:
        """The task name and loop of the process's gauges; asked for only with ``[metrics] port`` set."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Close what the body opened besides the engine: broker connections."""


async def run_process(
    settings: Settings, stop: asyncio.Event, build: Callable[[AsyncEngine], ProcessBody]
) -> None:
    """Run the body ``build`` makes on the process's engine, until ``stop``."""
    liveness = new_liveness()
    with serving(settings, liveness):
        engine = create_engine(settings.database)
        body: ProcessBody | None = None
        try:
            # A body that cannot be built (a config error found on the way)
            # still leaves no engine behind; it logs no stopped line, as it
            # never started.
            body = build(engine)
            await _run_body(body, Process(settings, engine, liveness, stop))
        finally:
            if tracing.on():  # the last batches' spans exported before the end
                await asyncio.to_thread(tracing.shutdown)
            await engine.dispose()
            if body is not None:
                log.info(body.stopped_event)


def switch_tracing_on(process: str) -> None:
    """Trace if the OTEL_* variables ask for it (backhalf.tracing); a
    ConfigError for what they ask that cannot be done."""
    try:
        tracing.switch_on(process)
    except tracing.TracingConfigError as exc:
        raise ConfigError(str(exc)) from exc


async def _run_body(body: ProcessBody, process: Process) -> None:
    try:
        if body.traced:  # inside the try: a refusal still closes what the body opened
            switch_tracing_on(body.role)
        if not await body.start(process):
            return
        # What start-up made (modules, the config, the pool) lives as long
        # as the process: out of the collector's reach, a full collection
        # walks only what the work makes. Measured in the receiver: each
        # stopped the loop 60-80 ms every few seconds, 0.4-2.8 ms after this
        # (docs/performance.md, "Webhook receiver").
        gc.freeze()
        async with asyncio.TaskGroup() as tg:
            process.group = tg
            _spawn_all(body, process)
            await process.stop.wait()
            await _join(process.working, body)
    finally:
        await body.close()


def _spawn_all(body: ProcessBody, process: Process) -> None:
    body.spawn(process)
    beat = heartbeat_loop(
        process.engine,
        body.role,
        body.detail,
        process.liveness,
        process.stop,
        deadline_ms=process.deadline_ms,
    )
    process.work(beat, name="heartbeat")
    metrics = process.settings.metrics
    if metrics.port:
        name, gauges = body.gauges(process, metrics.refresh_interval_ms / 1000)
        process.work(gauges, name=name)


async def _join(working: list[asyncio.Task[None]], body: ProcessBody) -> None:
    """Wait for the work under the one shutdown deadline; cancel what is still running then."""
    _done, running = await asyncio.wait(working, timeout=body.shutdown_timeout_s)
    if running:
        overdue = sorted(t.get_name() for t in running)
        log.error("shutdown_deadline_exceeded", **{body.overdue_field: overdue})
        for task in running:
            task.cancel()
