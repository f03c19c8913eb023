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
from functools import partial
from pathlib import Path
from typing import Any

import dramatiq
import redis
import structlog
from dramatiq.brokers.redis import RedisBroker
from dramatiq.middleware import SkipMessage
from redis.backoff import NoBackoff
from redis.retry import Retry

from backhalf import heartbeats, metrics
from backhalf.db import create_sync_engine
from backhalf.errors import StoreError
from backhalf.queues import QueueConfig
from backhalf.state_writer import StateWriter
from backhalf.worker import Handler, Runner, refused
from ingest.config import LEASE_MARGIN_MIN_MS, METRICS_PORT_VARIABLE, Settings
from ingest.errors import ConfigError
from ingest.observe import worker_metrics
from ingest.observe.metrics_http import MetricsServer
from ingest.observe.worker_metrics import WorkerHeartbeat
from ingest.processes.children import end_with_parent
from ingest.processes.worker_acks import DeferredAcks
from ingest.processes.worker_claims import FetchClaims
from ingest.processes.worker_messages import (
    OPTION_READERS,
    FetchHooks,
    GuardedRedisBroker,
    MiddlewareOrderError,
    ignored_options,
    message_refusal,
)

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
        # What `--queues` chose, as dramatiq sees it: two Switchboard queues
        # may share a dramatiq queue, whose consumer then gets both's messages.
        self._served_broker_queues = frozenset(settings.queues[q].broker_queue for q in self._served)
        self._heartbeat: WorkerHeartbeat | None = None
        # Claims made at fetch, and acks held until a run's end is committed:
        # only on Switchboard's own broker, whose consumers call them.
        self._claims = FetchClaims(
            lambda: self._runner_for().writer, self._by_actor, self._served_broker_queues
        )
        self._acks: DeferredAcks | None = None
        self._current = threading.local()  # the message a worker thread is running

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
            message, self._current.message = getattr(self._current, "message", None), None
            claim = self._claims.take(message) if message is not None else None
            acks = self._acks
            hold = None if acks is None or message is None else partial(acks.hold, message)
            self._runner_for().run(queue_name, todo_id, claim, hold)

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
        try:
            reason = message_refusal(message, queue, self._served_broker_queues)
        except Exception:  # noqa: BLE001 - a shape nothing above foresaw: refused all the same
            reason = "bad_arguments"
        if reason is not None:
            # Types only: the values are the sender's.
            bound = log.bind(queue=queue.name, message_id=str(message.message_id)[:64])
            refused(queue.name, reason, bound, argument_types=type(message.args).__name__)
            raise SkipMessage(reason)
        overrides = ignored_options(message.options, queue)
        for key in overrides:
            del message.options[key]
        if overrides:
            log.warning("message_options_ignored", queue=queue.name, message_id=str(message.message_id)[:64],
                        options=sorted(str(k)[:40] for k in overrides)[:10])  # fmt: skip
        self._current.message = message  # for the actor: its claim, and its ack held

    def after_skip_message(self, broker: dramatiq.Broker, message: Any) -> None:
        self._not_run(message)

    def after_process_message(
        self, broker: dramatiq.Broker, message: Any, *, result: Any = None, exception: Any = None
    ) -> None:
        self._not_run(message)

    def _not_run(self, message: Any) -> None:
        """A message whose actor did not take its claim (a middleware after
        this one skipped it, or failed it before the actor ran): the claim is
        given back, and the thread forgets the message."""
        if getattr(self._current, "message", None) is message:
            self._current.message = None
        claim = self._claims.take(message)
        if claim is not None:
            self._claims.give_back_claims([claim])

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
        self.declare(broker)

    def before_worker_boot(self, broker: dramatiq.Broker, worker: Any) -> None:
        """Refuse to start behind dramatiq's option readers: their
        before_process_message would read a message's overrides (a time
        limit, retries) before this one drops them. A MiddlewareError is the
        one failure dramatiq's emit_before lets through: the worker stops."""
        readers = [type(m).__name__ for m in broker.middleware[: broker.middleware.index(self)]
                   if isinstance(m, OPTION_READERS)]  # fmt: skip
        if readers:
            raise MiddlewareOrderError(
                f"SwitchboardMiddleware must come before dramatiq's {', '.join(readers)} on the broker:"
                " broker.add_middleware(SwitchboardMiddleware(...), before=type(broker.middleware[0]))"
            )
        if isinstance(broker, GuardedRedisBroker):
            # Before the consumers start (dramatiq adds them after this hook).
            self._acks = DeferredAcks()
            broker.hooks = FetchHooks(fetched=self._claims.claim, requeued=self._claims.give_back,
                                      acks=self._acks.ack, nacks=self._acks.forget,
                                      tick=self._claims.refresh)  # fmt: skip

    def after_worker_boot(self, broker: dramatiq.Broker, worker: Any) -> None:
        """Its threads consume: the line a supervisor (or a test) waits for."""
        self._heartbeat = WorkerHeartbeat(
            self._settings,
            {"queues": self._served, "threads": self._threads, "slot": heartbeats.slot(self._served)},
            broker=_pinger(broker),
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
                self._runner.close()  # every end written, its held ack released
                self._runner = None
        if self._acks is not None:
            self._acks.close()
            self._acks = None


def _retry_when(max_attempts: int) -> Any:
    def retry_when(retries_so_far: int, exc: BaseException) -> bool:
        return isinstance(exc, StoreError) or retries_so_far < max_attempts - 1

    return retry_when


# A heartbeat's ping of dramatiq's broker: one try, bounded, so a server out
# of reach delays no beat past its row's freshness.
PING_TIMEOUT_S = 2.0


def _pinger(broker: dramatiq.Broker) -> tuple[str, Callable[[], object]] | None:
    """dramatiq's Redis broker by name (host:port/db), and a ping of it on a
    client of its own: one try, within PING_TIMEOUT_S (the broker's own
    client retries and waits far longer). None for another broker."""
    client = getattr(broker, "client", None)
    if not isinstance(client, redis.Redis):
        return None
    kwargs = dict(client.connection_pool.connection_kwargs)
    kwargs.update(socket_timeout=PING_TIMEOUT_S, socket_connect_timeout=PING_TIMEOUT_S,
                  retry=Retry(NoBackoff(), 0), driver_info=None)  # fmt: skip
    pool = client.connection_pool.__class__(
        connection_class=client.connection_pool.connection_class, **kwargs
    )
    where = kwargs.get("path") or f"{kwargs.get('host')}:{kwargs.get('port')}/{kwargs.get('db', 0)}"
    return f"dramatiq broker at {where}", redis.Redis(connection_pool=pool).ping


def broker_for(settings: Settings, *, threads: int = 8, queues: Sequence[str] = ()) -> RedisBroker:
    """dramatiq's Redis broker at ``[dramatiq] url``, its default middleware
    plus Switchboard's, every Redis wait bounded."""
    client = redis.Redis.from_url(
        settings.dramatiq_broker.url(),
        socket_timeout=BROKER_SOCKET_TIMEOUT_S,
        socket_connect_timeout=BROKER_SOCKET_TIMEOUT_S,
        driver_info=None,  # no CLIENT SETINFO: ops/redis-users.acl does not grant it (Redis 7.0 lacks it)
    )
    broker = GuardedRedisBroker(client=client)
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
                              # a user's own setting of dramatiq's variable stands
                              "dramatiq_queue_prefetch": os.environ.get("dramatiq_queue_prefetch")  # noqa: SIM112 - dramatiq spells it so
                              or str(queue_prefetch(threads)),
                              **worker_metrics.prepare(settings)}  # fmt: skip
    argv = [sys.executable, "-m", "dramatiq", "ingest.processes.worker_app", "--processes", str(processes),
            "--threads", str(threads), "--queues", *broker_queues,
            "--worker-shutdown-timeout", str(shutdown_timeout_ms(settings, chosen))]  # fmt: skip
    if settings.metrics.port:
        # The endpoint: a process of dramatiq's own, summing the workers' files.
        argv += ["--fork-function", METRICS_FORK_FUNCTION]
    log.info("workers_starting", processes=processes, threads=threads, queues=broker_queues)
    os.execve(sys.executable, argv, dict(env))  # noqa: S606 - our interpreter, fixed arguments, no shell


# How many messages a worker process's consumer holds per queue, per
# thread (dramatiq's default is 2), counting each until it is acked. Acks
# wait here for the run's end to commit (ingest.processes.worker_acks): with
# 2, the window was often full, each fetch and each claim took fewer
# messages, and the consumer slept for up to its idle poll. Bench, one
# round each, 10,000 messages: 2 per thread 870 msg/s, workers 940 us of
# CPU per todo; 4 per thread 1,080-1,228 msg/s, 691-748 us.
PREFETCH_PER_THREAD = 4


def queue_prefetch(threads: int) -> int:
    """dramatiq's ``dramatiq_queue_prefetch`` for ``threads`` threads."""
    return min(threads * PREFETCH_PER_THREAD, 65535)


# The workers' metrics endpoint: a process dramatiq's main process forks.
METRICS_FORK_FUNCTION = "ingest.processes.worker:serve_metrics"


def serve_metrics() -> int:
    """dramatiq's fork function: the workers' /metrics and /healthz, ended by
    the kernel with dramatiq's main process (as its worker processes are): a
    main process killed outright left it serving, the port held, alone."""
    end_with_parent(os.getppid())
    return worker_metrics.serve()


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
