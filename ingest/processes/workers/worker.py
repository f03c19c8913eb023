"""``switchboard worker``: dramatiq workers for the todos of ``[queues.*]``,
on PostgreSQL as their broker (DESIGN.md section 7b).

:func:`switchboard_broker` is the whole of it: a
:class:`~ingest.processes.workers.worker_broker.TodoBroker` with the dramatiq
middleware that means something for a todo (its time limit, the shutdown
notice) and Switchboard's, which declares one actor per
configured queue (``switchboard:NAME``, with its time limit) that runs the
claimed todo through :class:`backhalf.lifecycle.worker.Runner`, and starts the worker
process's heartbeat. ``switchboard worker`` runs dramatiq's own CLI (its
processes, threads and signals) on :mod:`ingest.processes.workers.worker_app`; an
application that runs dramatiq itself builds the same broker with
:func:`switchboard_broker` and may add middleware of its own.
"""

from __future__ import annotations

import gc
import importlib
import inspect
import os
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import dramatiq
import structlog
from dramatiq.middleware import ShutdownNotifications, TimeLimit

from backhalf import metrics, tracing
from backhalf.db import create_sync_engine
from backhalf.housekeeping import heartbeats
from backhalf.lifecycle.queues import QueueConfig
from backhalf.lifecycle.state_writer import StateWriter
from backhalf.lifecycle.worker import Handler, Runner
from ingest.children import end_with_parent
from ingest.config import METRICS_PORT_VARIABLE, Settings
from ingest.errors import ConfigError
from ingest.observe import worker_metrics
from ingest.observe.metrics_http import MetricsServer
from ingest.observe.worker_metrics import WorkerHeartbeat
from ingest.processes.skeleton import switch_tracing_on
from ingest.processes.workers.worker_broker import (
    SWITCHBOARD_QUEUE,
    Claimer,
    LeaseKeeper,
    Leases,
    TodoBroker,
    TodoMessage,
)

log = structlog.get_logger(__name__)

CONFIG_VARIABLE = worker_metrics.CONFIG_VARIABLE
# The Switchboard queues `--queues` chose, for the processes dramatiq starts.
QUEUES_VARIABLE = "SWITCHBOARD_WORKER_QUEUES"


# What makes a handler's module importable by the workers: the current
# directory is not searched (`switchboard` is an installed script).
IMPORT_HINT = (
    "install the package that holds it into the Python that runs switchboard (pip install -e .),"
    " or put its directory on PYTHONPATH"
)


def resolve_handler(queue: QueueConfig) -> Handler:
    """``module:function``: the function, or an existing dramatiq actor's own
    function (the queue's settings then apply, not the actor's options)."""
    module_name, _, attr = queue.handler.partition(":")
    where = f"[queues.{queue.name}]: key 'handler'"
    try:
        target: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            target = getattr(target, part)
    except ImportError as exc:
        raise ConfigError(
            f"{where}: cannot import {module_name!r}: {type(exc).__name__}: {exc}"
            f" ({IMPORT_HINT}; this Python is {sys.executable})"
        ) from exc
    except AttributeError as exc:
        raise ConfigError(f"{where}: {module_name!r} has no {attr!r}") from exc
    if isinstance(target, dramatiq.Actor):
        # dramatiq wraps an async actor's function for its AsyncIO
        # middleware's event loop; the original is called here instead (run
        # to completion by the runner), whatever middleware the broker has.
        original = inspect.unwrap(target.fn)
        handler_fn: Handler = original if inspect.iscoroutinefunction(original) else target.fn
        return handler_fn
    if not callable(target):
        raise ConfigError(f"{where}: {queue.handler!r} is not a function")
    handler: Handler = target
    return handler


class _Process:
    """What one worker process holds once it consumes: the state writer
    (one connection), the claimer (one more), the leases and their keeper
    (a third)."""

    def __init__(self, settings: Settings, threads: int, served: Sequence[str], handlers: Any) -> None:
        worker = settings.worker
        self.lease_s = worker.lease_ms / 1000
        self.engine = create_sync_engine(settings.database, pool_size=3)
        self.writer = StateWriter(
            self.engine,
            deadline_ms=settings.database.transaction_deadline_ms,
            threads=threads,
            releases=any(a.ack_after == "complete" for a in settings.adapters),
        )
        self.runner = Runner(self.writer, handlers)
        self.leases = Leases()
        self.keeper = LeaseKeeper(self.leases, self.engine, self.lease_s)
        self._claimer_args = (served, threads, worker.poll_interval_ms / 1000)

    def claimer(self) -> Claimer:
        served, threads, poll_s = self._claimer_args
        return Claimer(self.engine, self.writer, self.leases, served, threads=threads, lease_s=self.lease_s,
                       poll_interval_s=poll_s)  # fmt: skip

    def close(self) -> None:
        self.keeper.close()
        self.runner.close()  # every end written; the engine disposed


class SwitchboardMiddleware(dramatiq.Middleware):
    """Switchboard's queues on its :class:`TodoBroker`: one actor per queue,
    the claimed todo handed to it, the process's heartbeat."""

    def __init__(self, settings: Settings, *, threads: int = 8, queues: Sequence[str] = ()) -> None:
        """``queues``: those the workers claim from (``--queues``), default all."""
        self._settings = settings
        self._threads = threads
        self._served = sorted(queues or settings.queues)
        if settings.metrics.port:
            metrics.switch_on()
        self._handlers = {name: (q, resolve_handler(q)) for name, q in settings.queues.items()}
        self._process: _Process | None = None
        self._lock = threading.Lock()  # the consumer and the first messages' threads
        self._heartbeat: WorkerHeartbeat | None = None
        self._current = threading.local()  # the message a worker thread is running

    def process(self) -> _Process:
        with self._lock:
            if self._process is None:
                self._process = _Process(self._settings, self._threads, self._served, self._handlers)
            return self._process

    def declare(self, broker: dramatiq.Broker) -> None:
        """One actor per queue, all on dramatiq's ``switchboard`` queue (no
        retries of dramatiq's: a todo's retries are its own, backhalf.lifecycle.worker)."""
        for name, (queue, _handler) in self._handlers.items():
            if queue.actor_name in broker.actors:
                continue
            dramatiq.actor(
                broker=broker,
                actor_name=queue.actor_name,
                queue_name=SWITCHBOARD_QUEUE,
                time_limit=queue.time_limit_ms,
            )(self._actor_function(name))

    def _actor_function(self, queue_name: str) -> Callable[[int], None]:
        def run(todo_id: int) -> None:
            message, self._current.message = getattr(self._current, "message", None), None
            if not isinstance(message, TodoMessage) or message.claim.todo.id != todo_id:
                # Only the claimer's messages reach these actors (enqueue is
                # refused): a bookkeeping slip, never a todo run unclaimed.
                log.error("claim_mismatch", todo_id=todo_id, queue=queue_name)
                return
            message.ran = True
            process = self.process()
            claim = message.claim
            process.runner.run(claim, lost=process.leases.lost(claim),
                               settled=lambda _outcome: process.leases.release(claim))  # fmt: skip

        return run

    def before_process_message(self, broker: dramatiq.Broker, message: Any) -> None:
        if isinstance(message, TodoMessage):
            self._current.message = message
            message.owner.began(message)

    def after_skip_message(self, broker: dramatiq.Broker, message: Any) -> None:
        self._forget(message)

    def after_process_message(
        self, broker: dramatiq.Broker, message: Any, *, result: Any = None, exception: Any = None
    ) -> None:
        self._forget(message)

    def _forget(self, message: Any) -> None:
        if getattr(self._current, "message", None) is message:
            self._current.message = None

    @staticmethod
    def process_claimer(broker: dramatiq.Broker) -> Claimer | None:
        return broker.claimer if isinstance(broker, TodoBroker) else None

    def before_worker_boot(self, broker: dramatiq.Broker, worker: Any) -> None:
        if not isinstance(broker, TodoBroker):
            raise dramatiq.middleware.MiddlewareError(
                "SwitchboardMiddleware runs on Switchboard's own broker over PostgreSQL:"
                " build it with ingest.worker.switchboard_broker(settings)"
            )
        # In each worker process, before its threads run a todo (DESIGN.md section 14).
        switch_tracing_on("worker")
        # What start-up made (modules, the config, the handlers) lives as
        # long as the process: out of the collector's reach, as in the other
        # processes (ingest.processes.skeleton). Left in it, the first full
        # collection walked it all within the first second of work and
        # stopped every thread of the process for 170-200 ms: the p99 of
        # XADD -> done at 500/s (docs/performance.md, "Found: the workers'
        # first full garbage collection").
        gc.freeze()

    def after_worker_boot(self, broker: dramatiq.Broker, worker: Any) -> None:
        """Its threads consume: the line a supervisor (or a test) waits for."""
        self._heartbeat = WorkerHeartbeat(
            self._settings,
            {"queues": self._served, "threads": self._threads, "slot": heartbeats.slot(self._served)},
        )
        self._heartbeat.start()
        log.info("worker_ready", queues=self._served, threads=self._threads)

    def before_worker_shutdown(self, broker: dramatiq.Broker, worker: Any) -> None:
        """SIGTERM: no more claims; the claims no thread has started are given
        back now (not once the last running handler ends); running handlers
        finish."""
        claimer = self.process_claimer(broker)
        if claimer is not None:
            claimer.stop_claiming()
            claimer.drain(worker.work_queue)

    def after_worker_shutdown(self, broker: dramatiq.Broker, worker: Any) -> None:
        """Once every worker thread has stopped and the unrun claims are
        given back: the heartbeat stops, the ends are written, the
        connections closed."""
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None
        with self._lock:
            if self._process is not None:
                self._process.close()
                self._process = None
        tracing.shutdown()  # the last runs' spans exported


def switchboard_broker(settings: Settings, *, threads: int = 8, queues: Sequence[str] = ()) -> TodoBroker:
    """The workers' broker over PostgreSQL: Switchboard's middleware first, then
    dramatiq's TimeLimit and ShutdownNotifications (an application adds its
    own with ``broker.add_middleware``)."""
    # dramatiq's defaults that mean something for a todo: its time limit, and
    # the shutdown notice an actor may ask for. Not Retries (a todo's retries
    # are its own, in PostgreSQL), nor Callbacks and Pipelines (each sends a
    # message, which this broker refuses), nor AgeLimit (a message's age is
    # its claim's, a few milliseconds; a todo's own age is in its row).
    middleware = [TimeLimit(), ShutdownNotifications()]
    switchboard = SwitchboardMiddleware(settings, threads=threads, queues=queues)
    broker = TodoBroker(lambda: switchboard.process().claimer(), middleware=[switchboard, *middleware])
    # Here, not at process boot: a failure there is only logged by dramatiq,
    # and the worker would run with no actor.
    switchboard.declare(broker)
    return broker


def exec_workers(
    config_path: Path, settings: Settings, *, processes: int, threads: int, queues: Sequence[str]
) -> None:
    """Replace this process with dramatiq's CLI on :mod:`ingest.processes.workers.worker_app`
    (its processes, threads and signal handling: SIGTERM stops them
    gracefully)."""
    unknown = sorted(set(queues) - set(settings.queues))
    if unknown:
        raise ConfigError(
            f"--queues: no [queues.{unknown[0]}] in the config (known: {sorted(settings.queues)})"
        )
    if not settings.queues:
        raise ConfigError("[queues.*]: `switchboard worker` needs at least one queue with a handler")
    try:
        tracing.check(os.environ)  # what the OTEL_* variables ask, checked once before the processes start
    except tracing.TracingConfigError as exc:
        raise ConfigError(str(exc)) from exc
    for queue in settings.queues.values():
        resolve_handler(queue)  # a handler that cannot be imported stops us here, exit 2
    chosen = queues or sorted(settings.queues)
    if settings.metrics.port:
        # Before prepare() makes this run's metrics directory: a port in use
        # (a running deployment's, whose directory prepare() leaves alone)
        # stops us here, exit 2.
        _check_port_free(settings)
    env: Mapping[str, str] = {**os.environ, CONFIG_VARIABLE: str(config_path.resolve()),
                              "SWITCHBOARD_WORKER_THREADS": str(threads),
                              QUEUES_VARIABLE: ",".join(chosen),
                              worker_metrics.PROCESSES_VARIABLE: str(processes),
                              # --metrics-port, for the processes that read the config again
                              METRICS_PORT_VARIABLE: str(settings.metrics.port),
                              **worker_metrics.prepare(settings)}  # fmt: skip
    argv = [sys.executable, "-m", "dramatiq", "ingest.processes.workers.worker_app",
            "--processes", str(processes), "--threads", str(threads), "--queues", SWITCHBOARD_QUEUE,
            "--worker-shutdown-timeout", str(shutdown_timeout_ms(settings, chosen))]  # fmt: skip
    if settings.metrics.port:
        # The endpoint: a process of dramatiq's own, summing the workers' files.
        argv += ["--fork-function", METRICS_FORK_FUNCTION]
    log.info("workers_starting", processes=processes, threads=threads, queues=chosen)
    os.execve(sys.executable, argv, dict(env))  # noqa: S606 - our interpreter, fixed arguments, no shell


# The workers' metrics endpoint: a process dramatiq's main process forks.
METRICS_FORK_FUNCTION = "ingest.processes.workers.worker:serve_metrics"


def serve_metrics() -> int:
    """dramatiq's fork function: the workers' /metrics and /healthz, ended by
    the kernel with dramatiq's main process (as its worker processes are): a
    main process killed outright left it serving, the port held, alone."""
    end_with_parent(os.getppid())
    return worker_metrics.serve()


# dramatiq's own default: ten minutes for running handlers to finish on SIGTERM.
# dramatiq's TimeLimit looks at running actors once a second: a stop waits
# that much past the longest time limit.
TIME_LIMIT_CHECK_MS = 2_000
DRAMATIQ_SHUTDOWN_TIMEOUT_MS = 600_000


def shutdown_timeout_ms(settings: Settings, queues: Sequence[str]) -> int:
    """How long a graceful stop waits for running handlers: dramatiq's ten
    minutes, or longer if a queue's time limit is (its handlers would be
    abandoned mid-run otherwise). A supervisor's stop timeout must exceed it
    (ops/systemd/switchboard-worker.service: TimeoutStopSec)."""
    longest = max((settings.queues[q].time_limit_ms for q in queues), default=0)
    return max(DRAMATIQ_SHUTDOWN_TIMEOUT_MS, longest + TIME_LIMIT_CHECK_MS)


def app_broker() -> TodoBroker:
    """The broker of :mod:`ingest.processes.workers.worker_app`, from ``SWITCHBOARD_CONFIG``."""
    settings = worker_metrics.load_app_settings()
    queues = [q for q in os.environ.get(QUEUES_VARIABLE, "").split(",") if q]
    threads = int(os.environ.get("SWITCHBOARD_WORKER_THREADS", "8"))
    return switchboard_broker(settings, threads=threads, queues=queues)


def _check_port_free(settings: Settings) -> None:
    """The fork process binds the port only once the workers are up; a port
    taken is said now, as a config error (exit 2), not lost in its log."""
    MetricsServer(settings.metrics.address, settings.metrics.port, lambda: (True, {}), quiet=True).close()
