"""What ``switchboard worker`` runs beside dramatiq's worker processes so that
operators can see them: a heartbeat thread in each worker process, and the
``[metrics]`` endpoint as a dramatiq fork process (``--fork-function``).

dramatiq runs several worker processes; one port cannot be bound by each.
So the workers run prometheus-client's multiprocess mode: each process
writes its figures to files in ``PROMETHEUS_MULTIPROC_DIR`` (a directory
private to this port, set by :func:`prepare` before dramatiq starts), and
the fork process (:func:`serve`) sums them on every scrape. Its ``/healthz``
is healthy while the database answers and as many worker processes of this
dramatiq main process heartbeat as were asked for.
"""

from __future__ import annotations

import os
import shutil
import socket
import stat
import tempfile
import threading
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import structlog
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector
from sqlalchemy.engine import Engine
from sqlalchemy.exc import SQLAlchemyError

from backhalf import heartbeats
from backhalf import metrics as m
from backhalf.db import create_sync_engine
from ingest.config import Settings, load
from ingest.errors import ConfigError, error_kind, log_failure
from ingest.observe import logs
from ingest.observe.metrics_http import HealthReport, MetricsServer

log = structlog.get_logger(__name__)

CONFIG_VARIABLE = "SWITCHBOARD_CONFIG"
MULTIPROC_VARIABLE = "PROMETHEUS_MULTIPROC_DIR"
PROCESSES_VARIABLE = "SWITCHBOARD_WORKER_PROCESSES"
FORK_FUNCTION = "ingest.observe.worker_metrics:serve"
JOIN_TIMEOUT_S = 10.0


def load_app_settings() -> Settings:
    """The settings of the processes dramatiq started, from ``SWITCHBOARD_CONFIG``
    (``--metrics-port`` reaches them as ``SWITCHBOARD_METRICS_PORT``)."""
    path = os.environ.get(CONFIG_VARIABLE)
    if not path:
        raise ConfigError(f"{CONFIG_VARIABLE} is not set: run `switchboard worker`")
    return load(path, os.environ)


def multiproc_dir(port: int) -> Path:
    """One directory per metrics port and user: the port is this host's
    only worker deployment on it, so its files are this deployment's."""
    return Path(tempfile.gettempdir()) / f"switchboard-metrics-{os.getuid()}-{port}"


def prepare(settings: Settings) -> dict[str, str]:
    """The environment dramatiq's processes need for metrics (empty when
    off): the directory made private and emptied of an earlier run's files."""
    if not settings.metrics.port:
        return {}
    path = multiproc_dir(settings.metrics.port)
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        info = path.lstat()
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            raise ConfigError(
                f"[metrics]: {path} exists and is not a directory of this user's: remove it"
            ) from None
        shutil.rmtree(path)
        try:
            path.mkdir(mode=0o700)
        except FileExistsError as exc:  # another user took the name meanwhile
            raise ConfigError(f"[metrics]: {path} was created by someone else meanwhile: remove it") from exc
    return {MULTIPROC_VARIABLE: str(path)}


class WorkerHeartbeat:
    """A worker process's heartbeat row, written from a thread of its own
    every ``HEARTBEAT_INTERVAL_S`` (dramatiq's threads are busy with todos)."""

    def __init__(self, settings: Settings, detail: Mapping[str, Any]) -> None:
        self._engine: Engine = create_sync_engine(settings.database, pool_size=1)
        self._instance = uuid.uuid4()
        self._detail = {**detail, "parent": os.getppid()}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="switchboard-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _beat(self, first: bool) -> None:
        with self._engine.begin() as conn:
            conn.execute(
                heartbeats.beat_statement(
                    self._instance, "worker", socket.gethostname(), os.getpid(), self._detail
                )
            )
            if first:
                conn.execute(heartbeats.forget_statement())

    def _run(self) -> None:
        first = True
        while not self._stop.is_set():
            try:
                self._beat(first)
                first = False
            except Exception as exc:  # noqa: BLE001 - the thread must go on beating; a bug is logged with its traceback
                if m.on():
                    m.ERRORS.labels("worker", error_kind(exc), m.error_class(exc)).inc()
                log_failure(log, "heartbeat_failed", exc, expected=(SQLAlchemyError,), role="worker")
            self._stop.wait(heartbeats.HEARTBEAT_INTERVAL_S)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(JOIN_TIMEOUT_S)
        try:
            with self._engine.begin() as conn:
                conn.execute(heartbeats.stopped_statement(self._instance))
        except SQLAlchemyError as exc:
            log_failure(log, "heartbeat_stop_not_recorded", exc, role="worker")
        finally:
            self._engine.dispose()


def _alive_workers(engine: Engine, parent: int) -> int:
    with engine.connect() as conn:
        query = heartbeats.alive_children_statement("worker", socket.gethostname(), parent)
        return int(conn.execute(query).scalar_one())


def serve() -> int:
    """dramatiq's fork function: the workers' endpoint until SIGTERM (which
    dramatiq's fork process turns into SystemExit in this thread)."""
    logs.configure()
    settings = load_app_settings()
    expected = int(os.environ.get(PROCESSES_VARIABLE, "1"))
    parent = os.getppid()
    registry = CollectorRegistry()
    MultiProcessCollector(registry, os.environ[MULTIPROC_VARIABLE])  # type: ignore[no-untyped-call]
    engine = create_sync_engine(settings.database, pool_size=1)

    def health() -> HealthReport:
        try:
            alive = _alive_workers(engine, parent)
        except SQLAlchemyError as exc:
            return False, {"status": "unhealthy", "database": {"ok": False, "error": type(exc).__name__}}
        ok = alive >= expected
        body = {
            "status": "ok" if ok else "unhealthy",
            "database": {"ok": True},
            "worker_processes": {"alive": alive, "expected": expected},
        }
        return ok, body

    server = MetricsServer(settings.metrics.address, settings.metrics.port, health, registry)
    stopped = threading.Event()
    try:
        while not stopped.wait(60.0):
            pass  # until SIGTERM raises SystemExit here
    finally:
        server.close()
        engine.dispose()
    return 0
