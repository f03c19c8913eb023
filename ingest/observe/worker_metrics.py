"""What ``switchboard worker`` runs beside dramatiq's worker processes so that
operators can see them: a heartbeat thread in each worker process, and the
``[metrics]`` endpoint as a dramatiq fork process (``--fork-function``).

dramatiq runs several worker processes; one port cannot be bound by each.
So the workers run prometheus-client's multiprocess mode: each process
writes its figures to files in ``PROMETHEUS_MULTIPROC_DIR`` (a directory
of this run's own, made by :func:`prepare` before dramatiq starts), and
the fork process (:func:`serve`) sums them on every scrape. Its ``/healthz``
is healthy while the database answers and as many worker processes of this
dramatiq main process heartbeat as were asked for.

The directory is made with ``tempfile.mkdtemp`` (issue 32): a fresh name
no other local user can guess or make first (a fixed name per port could
be, and the worker then refused to start), private (0700). It records the
process that will be dramatiq's main one (``switchboard worker`` execs it,
keeping its pid), so a later start deletes the directories of runs that
have ended and never those of a deployment still running.
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import stat
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import structlog
from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector
from sqlalchemy.engine import Engine
from sqlalchemy.exc import SQLAlchemyError

from backhalf import metrics as m
from backhalf.db import create_sync_engine
from backhalf.housekeeping import heartbeats
from ingest.config import Settings, load
from ingest.errors import ConfigError, error_kind, log_failure
from ingest.observe import logs
from ingest.observe.logs import redact
from ingest.observe.metrics_http import SERVER_FAILING_AFTER_S, HealthReport, MetricsServer
from ingest.pids import owner_tag

log = structlog.get_logger(__name__)

CONFIG_VARIABLE = "SWITCHBOARD_CONFIG"
MULTIPROC_VARIABLE = "PROMETHEUS_MULTIPROC_DIR"
MMAP_HEADER_BYTES = 8  # a figures file's header: how much of it is used
PROCESSES_VARIABLE = "SWITCHBOARD_WORKER_PROCESSES"
JOIN_TIMEOUT_S = 10.0


class SettledFilesCollector(MultiProcessCollector):
    """prometheus-client's multiprocess collector, skipping the file of a
    worker process that is being created: it exists empty for a moment
    before its header is written, and reading it then failed the whole
    scrape (a 500, seen in the suite). Such a file holds no figure yet."""

    def __init__(self, registry: CollectorRegistry, path: str) -> None:
        super().__init__(registry, path)  # type: ignore[no-untyped-call]
        self._files_path = path

    def collect(self) -> Iterable[Metric]:
        files = glob.glob(os.path.join(self._files_path, "*.db"))
        settled = [f for f in files if _size(f) >= MMAP_HEADER_BYTES]
        return self.merge(settled, accumulate=True)  # type: ignore[no-any-return,no-untyped-call]


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:  # gone meanwhile (a worker's file removed)
        return 0


def load_app_settings() -> Settings:
    """The settings of the processes dramatiq started, from ``SWITCHBOARD_CONFIG``
    (``--metrics-port`` reaches them as ``SWITCHBOARD_METRICS_PORT``)."""
    path = os.environ.get(CONFIG_VARIABLE)
    if not path:
        raise ConfigError(f"{CONFIG_VARIABLE} is not set: run `switchboard worker`")
    return load(path, os.environ)


MULTIPROC_PREFIX = "switchboard-metrics-"
# In each run's directory: "<pid> <start time>" of dramatiq's main process.
OWNER_FILE = "owner"


def remove_ended_runs(base: Path | None = None) -> list[Path]:
    """Delete this user's run directories (``MULTIPROC_PREFIX*`` in the temp
    directory) whose main process has ended; return them. Another user's,
    a symlink, one naming no owner (a run still being set up, or an older
    version's), and a running one's stay."""
    removed = []
    for path in (base or Path(tempfile.gettempdir())).glob(f"{MULTIPROC_PREFIX}*"):
        try:
            info = path.lstat()
            if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
                continue
            pid_text, _, started = (path / OWNER_FILE).read_text().partition(" ")
            pid = int(pid_text)
        except (OSError, ValueError):
            continue
        if owner_tag(pid) == f"{pid} {started}":
            continue  # still running
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def prepare(settings: Settings) -> dict[str, str]:
    """The environment dramatiq's processes need for metrics (empty when
    off): a new private directory for this run's files, owned by this
    process (dramatiq's main one once exec'd); ended runs' are deleted."""
    if not settings.metrics.port:
        return {}
    remove_ended_runs()
    try:
        path = Path(tempfile.mkdtemp(prefix=f"{MULTIPROC_PREFIX}{settings.metrics.port}-"))  # 0700
        with (path / OWNER_FILE).open("x") as owner:
            owner.write(owner_tag(os.getpid()))
    except OSError as exc:
        raise ConfigError(
            f"[metrics]: cannot make the workers' metrics directory in {tempfile.gettempdir()}"
            f" ({exc.strerror}): set TMPDIR to a directory this user can write"
        ) from exc
    return {MULTIPROC_VARIABLE: str(path)}


class WorkerHeartbeat:
    """A worker process's heartbeat row, written from a thread of its own
    every ``HEARTBEAT_INTERVAL_S`` (dramatiq's threads are busy with todos)."""

    def __init__(
        self,
        settings: Settings,
        detail: Mapping[str, Any],
        broker: tuple[str, Callable[[], object]] | None = None,
    ) -> None:
        """``broker``: dramatiq's broker, by name, and a ping of it, asked at
        every beat: one that fails every try for ``SERVER_FAILING_AFTER_S``
        is named in the row (``failing``), which status and /healthz read."""
        self._engine: Engine = create_sync_engine(settings.database, pool_size=1)
        self._instance = uuid.uuid4()
        self._detail = {**detail, "parent": os.getppid()}
        self._broker = broker
        self._failing_since: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="switchboard-heartbeat", daemon=True)

    def _failing(self) -> dict[str, str]:
        """Ping the broker: its error, once it has failed every try for a while."""
        if self._broker is None:
            return {}
        name, ping = self._broker
        try:
            ping()
        except Exception as exc:  # noqa: BLE001 - whatever the client raises is the broker failing
            now = time.monotonic()
            self._failing_since = self._failing_since or now
            if now - self._failing_since >= SERVER_FAILING_AFTER_S:
                return {name: redact(f"{type(exc).__name__}: {exc}")}
            return {}
        self._failing_since = None
        return {}

    def start(self) -> None:
        self._thread.start()

    def _beat(self, first: bool) -> None:
        failing = self._failing()
        detail = {**self._detail, "failing": failing} if failing else self._detail
        with self._engine.begin() as conn:
            conn.execute(
                heartbeats.beat_statement(self._instance, "worker", socket.gethostname(), os.getpid(), detail)
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


def _alive_workers(engine: Engine, parent: int) -> list[Mapping[str, Any]]:
    """The heartbeat details of this deployment's worker processes alive now."""
    with engine.connect() as conn:
        query = heartbeats.alive_children_statement("worker", socket.gethostname(), parent)
        return [dict(detail) for (detail,) in conn.execute(query)]


def serve() -> int:
    """dramatiq's fork function: the workers' endpoint until SIGTERM (which
    dramatiq's fork process turns into SystemExit in this thread)."""
    logs.configure()
    settings = load_app_settings()
    expected = int(os.environ.get(PROCESSES_VARIABLE, "1"))
    parent = os.getppid()
    registry = CollectorRegistry()
    SettledFilesCollector(registry, os.environ[MULTIPROC_VARIABLE])
    engine = create_sync_engine(settings.database, pool_size=1)

    def health() -> HealthReport:
        try:
            workers = _alive_workers(engine, parent)
        except SQLAlchemyError as exc:
            return False, {"status": "unhealthy", "database": {"ok": False, "error": type(exc).__name__}}
        failing = {k: v for w in workers for k, v in (w.get("failing") or {}).items()}
        ok = len(workers) >= expected and not failing
        body: dict[str, Any] = {
            "status": "ok" if ok else "unhealthy",
            "database": {"ok": True},
            "worker_processes": {"alive": len(workers), "expected": expected},
        }
        if failing:
            body["failing"] = failing
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
