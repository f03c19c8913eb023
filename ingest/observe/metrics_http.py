"""The ``[metrics]`` endpoint of a process: ``/metrics`` (Prometheus text
format, prometheus-client's own WSGI app) and ``/healthz`` on one port.

``/healthz`` answers 200 while every loop the process registered with its
:class:`Liveness` has ticked within its bound and the database answered
the last heartbeat; else 503, with a JSON body saying which did not. The
server runs in a thread of its own (stdlib ``wsgiref``), so a scrape never
waits on the event loop; :meth:`MetricsServer.close` stops and joins it and
every request thread, so nothing outlives the process's body.
"""

from __future__ import annotations

import errno
import json
import socketserver
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import structlog
from prometheus_client import REGISTRY, CollectorRegistry, make_wsgi_app

from backhalf.redaction import redact
from ingest.errors import ConfigError

log = structlog.get_logger(__name__)

SERVER_STOP_TIMEOUT_S = 5.0
# A client that connects and sends nothing (or reads nothing) is dropped
# after this: a request thread never outlives it, so close() is bounded.
REQUEST_TIMEOUT_S = 5.0
# Requests served at once; more are refused at accept (a scraper and a probe
# or two are the expected load, not a crowd).
MAX_CONNECTIONS = 8
HealthReport = tuple[bool, dict[str, Any]]


class Liveness:
    """What ``/healthz`` reads: each loop's last tick, and whether the
    database answered. Ticked from the event loop, read from the server's
    thread: guarded by a lock (a tick is one assignment under it)."""

    def __init__(self, *, database_stale_s: float) -> None:
        self._lock = threading.Lock()
        self._bounds: dict[str, float] = {}
        self._ticks: dict[str, float] = {}
        self._database_stale_s = database_stale_s
        self._database_at: float | None = None
        self._database_error: str | None = None

    def watch(self, name: str, stale_after_s: float) -> Callable[[], None]:
        """Register a loop; return the tick it calls at every turn."""
        with self._lock:
            self._bounds[name] = stale_after_s
            self._ticks[name] = time.monotonic()

        def tick() -> None:
            now = time.monotonic()
            with self._lock:
                self._ticks[name] = now

        return tick

    def loops_stuck(self) -> bool:
        now = time.monotonic()
        with self._lock:
            return any(now - at > self._bounds[name] for name, at in self._ticks.items())

    def forget(self, name: str) -> None:
        with self._lock:
            self._bounds.pop(name, None)
            self._ticks.pop(name, None)

    def database_answered(self) -> None:
        with self._lock:
            self._database_at, self._database_error = time.monotonic(), None

    def database_failed(self, error: str) -> None:
        with self._lock:
            self._database_error = error

    def report(self) -> HealthReport:
        now = time.monotonic()
        with self._lock:
            loops = {
                name: {"ok": now - at <= self._bounds[name], "since_tick_s": round(now - at, 3)}
                for name, at in self._ticks.items()
            }
            answered = self._database_at
            error = self._database_error
        database: dict[str, Any] = {
            "ok": answered is not None and now - answered <= self._database_stale_s,
            "since_answer_s": None if answered is None else round(now - answered, 3),
        }
        if error is not None:
            database["last_error"] = error
        ok = database["ok"] and all(v["ok"] for v in loops.values())
        return ok, {"status": "ok" if ok else "unhealthy", "database": database, "loops": loops}


class _QuietHandler(WSGIRequestHandler):
    timeout = REQUEST_TIMEOUT_S  # socketserver sets it on the connection

    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes are not logged: one line every few seconds says nothing."""


class _ThreadingServer(socketserver.ThreadingMixIn, WSGIServer):
    # Not daemon threads: server_close() joins them (block_on_close), each
    # bounded by REQUEST_TIMEOUT_S.
    daemon_threads = False
    allow_reuse_address = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # too many at once: refused, not queued
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


def wsgi_app(
    health: Callable[[], HealthReport], registry: CollectorRegistry = REGISTRY
) -> Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]:
    metrics = make_wsgi_app(registry)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO") == "/healthz":
            try:
                ok, body = health()
            except Exception as exc:  # noqa: BLE001 - a failing check is an unhealthy answer, not a crash
                # Redacted: the body goes to whoever can reach the port.
                ok, body = False, {"status": "unhealthy", "error": redact(f"{type(exc).__name__}: {exc}")}
            payload = json.dumps(body).encode()
            status = "200 OK" if ok else "503 Service Unavailable"
            headers = [("Content-Type", "application/json"), ("Content-Length", str(len(payload)))]
            start_response(status, headers)
            return [payload]
        result: Iterable[bytes] = metrics(environ, start_response)
        return result

    return app


class MetricsServer:
    """``/metrics`` and ``/healthz`` on ``address:port``, in a thread."""

    def __init__(
        self,
        address: str,
        port: int,
        health: Callable[[], HealthReport],
        registry: CollectorRegistry = REGISTRY,
        *,
        quiet: bool = False,
    ) -> None:
        try:
            self._server = make_server(
                address, port, wsgi_app(health, registry), _ThreadingServer, handler_class=_QuietHandler
            )
        except OSError as exc:
            # A config problem: another process has the port (two processes
            # of one host given the same [metrics] port), or the address is
            # none of this host's.
            why = "is in use" if exc.errno == errno.EADDRINUSE else f"cannot be bound ({exc.strerror})"
            raise ConfigError(
                f"[metrics]: {address}:{port} {why}: give each process its own port"
                " (--metrics-port, or SWITCHBOARD_METRICS_PORT)"
            ) from exc
        self.port = self._server.server_port
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.5}, name="metrics-http"
        )
        self._thread.start()
        if not quiet:
            log.info("metrics_listening", address=address, port=self.port)

    def close(self) -> None:
        self._server.shutdown()  # returns once serve_forever has (within its poll interval)
        self._thread.join(SERVER_STOP_TIMEOUT_S)
        self._server.server_close()  # joins the request threads
