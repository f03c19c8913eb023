"""``switchboard worker``: dramatiq workers for the todos of ``[queues.*]``.

:class:`SwitchboardMiddleware` is the whole of it: added to a dramatiq
broker, it declares one actor per configured queue (``switchboard:NAME``,
on the queue's dramatiq queue, with its retries, backoff and time limit),
which does its todos through :class:`backhalf.worker.Runner`, and opens the
worker process's database engine. ``switchboard worker`` runs dramatiq's own
CLI (its processes, threads, signals and restarts) on :mod:`ingest.processes.worker_app`,
a broker with that middleware installed; users running ``dramatiq
myapp.tasks`` add the middleware to their own broker and get the same.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import dramatiq
import redis
import structlog
from dramatiq.brokers.redis import RedisBroker
from dramatiq.common import q_name
from dramatiq.middleware import (
    AgeLimit,
    Callbacks,
    Pipelines,
    Retries,
    ShutdownNotifications,
    SkipMessage,
    TimeLimit,
)
from dramatiq.results import Results

from backhalf import heartbeats, metrics
from backhalf.db import create_sync_engine
from backhalf.errors import StoreError
from backhalf.queues import QueueConfig
from backhalf.state_writer import StateWriter
from backhalf.worker import Handler, Runner, refused
from ingest.config import LEASE_MARGIN_MIN_MS, METRICS_PORT_VARIABLE, Settings
from ingest.config.urls import broker_name
from ingest.errors import ConfigError
from ingest.observe import worker_metrics
from ingest.observe.metrics_http import MetricsServer
from ingest.observe.worker_metrics import WorkerHeartbeat

log = structlog.get_logger(__name__)

BROKER_SOCKET_TIMEOUT_S = 10.0
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


class SwitchboardMiddleware(dramatiq.Middleware):
    """Switchboard's queues on a dramatiq broker: add it to any broker."""

    def __init__(self, settings: Settings, *, threads: int = 8, queues: Sequence[str] = ()) -> None:
        """``queues``: those the workers consume (``--queues``), default all."""
        self._settings = settings
        self._threads = threads
        self._served = sorted(queues or settings.queues)
        if settings.metrics.port:
            metrics.switch_on()
        self._runner: Runner | None = None
        self._runner_lock = threading.Lock()  # the first messages arrive on several threads at once
        self._handlers = {name: (q, resolve_handler(q)) for name, q in settings.queues.items()}
        self._by_actor = {q.actor_name: q for q in settings.queues.values()}
        self._heartbeat: WorkerHeartbeat | None = None

    def declare(self, broker: dramatiq.Broker) -> None:
        """One actor per queue; called by the worker process at boot (and by
        an app that wants them declared at import)."""
        for name, (queue, _handler) in self._handlers.items():
            if queue.actor_name in broker.actors:
                continue
            dramatiq.actor(
                broker=broker,
                actor_name=queue.actor_name,
                queue_name=queue.broker_queue,
                # PostgreSQL counts the attempts; dramatiq's retries are the
                # backoff between them (the last failure is not retried).
                max_retries=queue.max_attempts - 1,
                # A database error is no attempt of the handler's: it is
                # retried whatever the count (with the backoff), so an outage
                # never uses a todo's retries up.
                retry_when=_retry_when(queue.max_attempts),
                min_backoff=queue.min_backoff_ms,
                max_backoff=queue.max_backoff_ms,
                time_limit=queue.time_limit_ms,
            )(self._actor_function(name))

    def _actor_function(self, queue_name: str) -> Callable[[int], None]:
        """The actor of one queue: one todo id, its queue bound here, never
        an argument (before_process_message has refused any other shape)."""

        def run(todo_id: int) -> None:
            self._runner_for().run(queue_name, todo_id)

        return run

    def before_process_message(self, broker: dramatiq.Broker, message: Any) -> None:
        """A message for a Switchboard actor is a hint, never an authority:
        one not shaped as the relay sends them (one todo id, on its queue's
        dramatiq queue, for a queue this worker serves) runs nothing and is
        not retried; options that would override the queue's settings are
        dropped. Runs before dramatiq's own middleware reads them (the
        middleware is the broker's first: :meth:`after_process_boot`)."""
        queue = self._by_actor.get(message.actor_name)
        if queue is None:
            return
        reason = message_refusal(message, queue, self._served)
        if reason is not None:
            refused(queue.name, reason, log.bind(queue=queue.name, message_id=message.message_id),
                    argument_types=[type(a).__name__ for a in message.args[:3]],
                    keywords=len(message.kwargs))  # fmt: skip
            raise SkipMessage(reason)
        overrides = [key for key in message.options if key not in DRAMATIQ_BOOKKEEPING]
        for key in overrides:
            del message.options[key]
        if overrides:
            log.warning("message_options_ignored", queue=queue.name, message_id=message.message_id,
                        options=sorted(str(k)[:40] for k in overrides)[:10])  # fmt: skip

    def _runner_for(self) -> Runner:
        with self._runner_lock:
            if self._runner is None:
                # One connection: the process's state writer's (backhalf.state_writer).
                engine = create_sync_engine(self._settings.database, pool_size=1)
                writer = StateWriter(
                    engine,
                    deadline_ms=self._settings.database.transaction_deadline_ms,
                    threads=self._threads,
                    releases=any(a.ack_after == "complete" for a in self._settings.adapters),
                )
                self._runner = Runner(writer, self._handlers)
            return self._runner

    def after_process_boot(self, broker: dramatiq.Broker) -> None:
        readers = [type(m).__name__ for m in broker.middleware[: broker.middleware.index(self)]
                   if isinstance(m, OPTION_READERS)]  # fmt: skip
        if readers:
            # Their before_process_message would read a message's overrides
            # (a time limit, retries) before this one drops them.
            raise ConfigError(
                f"SwitchboardMiddleware must come before dramatiq's {', '.join(readers)} on the broker:"
                " broker.add_middleware(SwitchboardMiddleware(...), before=type(broker.middleware[0]))"
            )
        self.declare(broker)

    def after_worker_boot(self, broker: dramatiq.Broker, worker: Any) -> None:
        """Its threads consume: the line a supervisor (or a test) waits for."""
        client = getattr(broker, "client", None)  # a Redis broker's; another broker is not pinged
        try:
            name = broker_name(self._settings.dramatiq_broker.url())
        except ConfigError:  # a broker of the user's own app: [dramatiq]'s credentials unset here
            name = "dramatiq broker"
        self._heartbeat = WorkerHeartbeat(
            self._settings,
            {"queues": self._served, "threads": self._threads, "slot": heartbeats.slot(self._served)},
            broker=(name, client.ping) if client is not None else None,
        )
        self._heartbeat.start()
        log.info("worker_ready", queues=sorted(self._settings.queues), threads=self._threads)

    def after_worker_shutdown(self, broker: dramatiq.Broker, worker: Any) -> None:
        """Once every worker thread has stopped: close the database pool."""
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None
        with self._runner_lock:
            if self._runner is not None:
                self._runner.close()
                self._runner = None


# The options dramatiq itself puts on a message (its retries' count and
# traceback, a delay's eta, the Redis broker's id): kept. Any other option a
# message carries would override its queue's settings (time_limit,
# max_retries, backoff, max_age, callbacks, pipelines): dropped.
DRAMATIQ_BOOKKEEPING = frozenset({"retries", "traceback", "requeue_timestamp", "eta", "redis_message_id"})
# dramatiq's middleware that read a message's options.
OPTION_READERS = (AgeLimit, TimeLimit, ShutdownNotifications, Callbacks, Pipelines, Retries, Results)
# A todo id is a PostgreSQL bigint.
MAX_TODO_ID = 2**63 - 1


def message_refusal(message: Any, queue: QueueConfig, served: Sequence[str]) -> str | None:
    """Why a message for ``queue``'s actor must not run, or None: the relay
    sends exactly one todo id, on the queue's own dramatiq queue."""
    args, kwargs = message.args, message.kwargs
    if kwargs or len(args) != 1 or type(args[0]) is not int or not 1 <= args[0] <= MAX_TODO_ID:
        return "bad_arguments"
    if q_name(message.queue_name) != queue.broker_queue or queue.name not in served:
        return "other_queue"
    return None


def _retry_when(max_attempts: int) -> Any:
    def retry_when(retries_so_far: int, exc: BaseException) -> bool:
        return isinstance(exc, StoreError) or retries_so_far < max_attempts - 1

    return retry_when


def broker_for(settings: Settings, *, threads: int = 8, queues: Sequence[str] = ()) -> RedisBroker:
    """dramatiq's Redis broker at ``[dramatiq] url``, its default middleware
    plus Switchboard's, every Redis wait bounded."""
    client = redis.Redis.from_url(
        settings.dramatiq_broker.url(),
        socket_timeout=BROKER_SOCKET_TIMEOUT_S,
        socket_connect_timeout=BROKER_SOCKET_TIMEOUT_S,
        driver_info=None,  # no CLIENT SETINFO: ops/redis-users.acl does not grant it (Redis 7.0 lacks it)
    )
    broker = RedisBroker(client=client)  # type: ignore[no-untyped-call]
    first = type(broker.middleware[0]) if broker.middleware else None
    broker.add_middleware(SwitchboardMiddleware(settings, threads=threads, queues=queues), before=first)
    return broker


def exec_workers(
    config_path: Path, settings: Settings, *, processes: int, threads: int, queues: Sequence[str]
) -> None:
    """Replace this process with dramatiq's CLI on :mod:`ingest.processes.worker_app`
    (its processes, threads and signal handling: SIGTERM stops them
    gracefully)."""
    unknown = sorted(set(queues) - set(settings.queues))
    if unknown:
        raise ConfigError(
            f"--queues: no [queues.{unknown[0]}] in the config (known: {sorted(settings.queues)})"
        )
    if not settings.queues:
        raise ConfigError("[queues.*]: `switchboard worker` needs at least one queue with a handler")
    for queue in settings.queues.values():
        resolve_handler(queue)  # a handler that cannot be imported stops us here, exit 2
    settings.dramatiq_broker.url()  # its credentials' variables unset: exit 2 here, not in dramatiq
    chosen = queues or sorted(settings.queues)
    broker_queues = sorted({settings.queues[q].broker_queue for q in chosen})
    # dramatiq reads its idle poll bound (worker_timeout) from its environment only.
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
                              "dramatiq_worker_timeout": str(settings.dramatiq_idle_poll_ms),
                              **worker_metrics.prepare(settings)}  # fmt: skip
    argv = [sys.executable, "-m", "dramatiq", "ingest.processes.worker_app", "--processes", str(processes),
            "--threads", str(threads), "--queues", *broker_queues,
            "--worker-shutdown-timeout", str(shutdown_timeout_ms(settings, chosen))]  # fmt: skip
    if settings.metrics.port:
        # The endpoint: a process of dramatiq's own, summing the workers' files.
        argv += ["--fork-function", worker_metrics.FORK_FUNCTION]
    log.info("workers_starting", processes=processes, threads=threads, queues=broker_queues)
    os.execve(sys.executable, argv, dict(env))  # noqa: S606 - our interpreter, fixed arguments, no shell


# dramatiq's own default: ten minutes for running handlers to finish on SIGTERM.
DRAMATIQ_SHUTDOWN_TIMEOUT_MS = 600_000


def shutdown_timeout_ms(settings: Settings, queues: Sequence[str]) -> int:
    """How long a graceful stop waits for running handlers: dramatiq's ten
    minutes, or longer if a queue's time limit is (its handlers would be
    abandoned mid-run otherwise). A supervisor's stop timeout must exceed it
    (ops/systemd/switchboard-worker.service: TimeoutStopSec)."""
    longest = max((settings.queues[q].time_limit_ms for q in queues), default=0)
    return max(DRAMATIQ_SHUTDOWN_TIMEOUT_MS, longest + LEASE_MARGIN_MIN_MS)


def app_broker() -> RedisBroker:
    """The broker of :mod:`ingest.processes.worker_app`, from ``SWITCHBOARD_CONFIG``."""
    settings = worker_metrics.load_app_settings()
    queues = [q for q in os.environ.get(QUEUES_VARIABLE, "").split(",") if q]
    return broker_for(settings, threads=int(os.environ.get("SWITCHBOARD_WORKER_THREADS", "8")), queues=queues)


def _check_port_free(settings: Settings) -> None:
    """The fork process binds the port only once the workers are up; a port
    taken is said now, as a config error (exit 2), not lost in its log."""
    MetricsServer(settings.metrics.address, settings.metrics.port, lambda: (True, {}), quiet=True).close()
