"""The ``[metrics]`` endpoint of a process: ``/metrics`` (Prometheus text
format, prometheus-client's own WSGI app) and ``/healthz`` on one port.

``/healthz`` answers 200 while every loop the process registered with its
:class:`Liveness` has ticked within its bound and the database answered
the last heartbeat; else 503, with a JSON body saying which did not. The
server runs in a thread of its own (stdlib ``wsgiref``), so a scrape never
waits on the event loop; :meth:`MetricsServer.close` stops and joins it and
every request thread, so nothing outlives the process's body.

Slow clients cannot take the endpoint (issue 32): each connection has a
thread of its own and two deadlines counted from its accept, whatever it
sends: its head within ``HEAD_TIMEOUT_S``, its whole exchange within
``REQUEST_TIMEOUT_S`` (a trickled byte never extends either, as a
per-``recv`` timeout would). A full server, or a client at its share
(``MAX_PER_CLIENT``), makes room for a newcomer by cutting the oldest
connection still sending its head: a probe, whose head comes in one packet,
is admitted and answered even while trickling clients hold every slot, and
even from their own address (a local attacker and a local probe are both
127.0.0.1). ``close`` shuts every open connection's socket, so it is
bounded however the clients behave.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import socket
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

HealthReport = tuple[bool, dict[str, Any]]

# How long close() waits for the server's loop and then for the requests it
# has cut short (their sockets are shut first, so each ends at once).
SERVER_STOP_TIMEOUT_S = 5.0
# A request's head (request line and headers) must have arrived this long
# after its connection was accepted; a scraper or a probe sends it in one
# packet. A client that trickles it a byte at a time is cut here: its slot
# is free again within this, whatever it sends.
HEAD_TIMEOUT_S = 2.0
# The whole exchange, accept to the last byte of the answer: a client that
# reads its answer slowly is cut here.
REQUEST_TIMEOUT_S = 5.0
# A head longer than this is no scrape: the connection is cut.
MAX_HEAD_BYTES = 16 * 1024
HEAD_END = b"\r\n\r\n"
# Requests served at once (a scraper and a probe or two are the expected
# load, not a crowd), and at most this many of them from one address.
MAX_CONNECTIONS = 8
MAX_PER_CLIENT = 4
# Connections cut but not yet gone (their threads end at once) and the live
# ones together never pass this: threads are bounded even under a flood.
MAX_THREADS = 2 * MAX_CONNECTIONS
# A connection arriving while cut ones still fill every thread waits this
# long for one of them to go (a cut thread ends at once, but on a loaded
# machine "at once" can be tens of milliseconds), rather than be refused:
# a crowd reconnecting the moment it is cut refused probes otherwise.
CUT_GRACE_S = 0.5


# A server the process needs (a broker its adapters read or ack) failing every
# try for this long makes the process unhealthy: a blip is retried, a wrong
# password or a server gone is said.
SERVER_FAILING_AFTER_S = 10.0


class Liveness:
    """What ``/healthz`` reads: each loop's last tick, whether the database
    answered, and the other servers the process needs that keep failing.
    Ticked from the event loop, read from the server's thread: guarded by a
    lock (a tick is one assignment under it)."""

    def __init__(self, *, database_stale_s: float) -> None:
        self._lock = threading.Lock()
        self._bounds: dict[str, float] = {}
        self._ticks: dict[str, float] = {}
        self._database_stale_s = database_stale_s
        self._database_at: float | None = None
        self._database_error: str | None = None
        # server -> (failing since, the last error): cleared by an answer.
        self._servers: dict[str, tuple[float, str]] = {}

    def server_failed(self, server: str, error: str, *, at_once: bool = False) -> None:
        """A try to reach ``server`` (say ``broker at host:port``)
        failed with ``error`` (no credential in either). ``at_once``: the
        server refused us (a login): failing now, not after the bound."""
        now = time.monotonic()
        start = now - SERVER_FAILING_AFTER_S if at_once else now
        with self._lock:
            since = min(self._servers.get(server, (start, error))[0], start)
            self._servers[server] = (since, error)

    def server_answered(self, server: str) -> None:
        with self._lock:
            self._servers.pop(server, None)

    def failing(self) -> dict[str, str]:
        """Servers failing every try for ``SERVER_FAILING_AFTER_S`` or more,
        with their last error."""
        now = time.monotonic()
        with self._lock:
            return {s: e for s, (since, e) in self._servers.items() if now - since >= SERVER_FAILING_AFTER_S}

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
        failing = self.failing()
        ok = database["ok"] and all(v["ok"] for v in loops.values()) and not failing
        report = {"status": "ok" if ok else "unhealthy", "database": database, "loops": loops}
        if failing:
            report["failing"] = failing
        return ok, report


class _Connection:
    """One accepted connection: its deadlines, and whether its head is still
    being read (only such a connection is ever cut to make room). Its
    ``shut`` and ``reading_head`` change under the server's lock."""

    __slots__ = (
        "accepted",
        "deadline",
        "head_arrived",
        "head_deadline",
        "host",
        "reading_head",
        "shut",
        "sock",
    )

    def __init__(self, sock: socket.socket, host: str) -> None:
        self.sock, self.host = sock, host
        self.accepted = time.monotonic()
        self.head_deadline = self.accepted + HEAD_TIMEOUT_S
        self.deadline = self.accepted + REQUEST_TIMEOUT_S
        self.reading_head = True
        self.head_arrived = False  # its whole head was read, not yet parsed
        self.shut = False

    def sending_head(self) -> bool:
        """Still sending its head: read, or waiting in the socket, no blank
        line has come. A probe sends its head in one packet; on a loaded
        machine its thread may not have read it yet when a crowd of
        newcomers wants room, and it must not be the one cut (it was)."""
        if not self.reading_head or self.head_arrived:
            return False
        try:
            waiting = _peek(self.sock)
        except (OSError, ValueError):  # nothing waiting, or the socket closed
            return True
        return HEAD_END not in waiting

    def shut_down(self) -> None:
        """Wake whatever the connection's thread waits for (a recv returns
        end of file, a send fails): called under the server's lock, while
        the connection is registered, so its socket is not closed yet."""
        if not self.shut:
            self.shut = True
            with contextlib.suppress(OSError):  # the peer went first
                self.sock.shutdown(socket.SHUT_RDWR)


def _peek(sock: socket.socket) -> bytes:
    """What waits unread in ``sock``, never waiting (BlockingIOError: nothing).

    Under the server's lock, so never a wait: the socket carries its
    thread's timeout, and Python waits for a socket with a timeout to be
    readable before any recv, MSG_DONTWAIT or not. A select first was not
    enough: the connection's thread could read what was waiting in between,
    and the accept loop then waited out the head's deadline, every newcomer
    behind it (seen: 2 s). A duplicate of the descriptor, made without a
    timeout, peeks at once (the flags of the open file are left as they are)."""
    with socket.socket(sock.family, sock.type, sock.proto, fileno=os.dup(sock.fileno())) as view:
        return view.recv(MAX_HEAD_BYTES, socket.MSG_PEEK | socket.MSG_DONTWAIT)


class _Cut(ConnectionAbortedError):
    """The connection passed a deadline or its head's size: it is dropped
    quietly (wsgiref, too, takes ConnectionAbortedError as a client gone)."""


class _HeadReader(io.RawIOBase):
    """The request's socket as a raw stream whose every read is bounded by
    what is left of the connection's deadline (the head's while the head is
    read): trickled bytes never extend it, as a per-recv timeout would."""

    def __init__(self, conn: _Connection) -> None:
        self._conn = conn
        self._head_bytes = 0
        self._tail = b""  # the last bytes read, for a blank line split between reads

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        conn = self._conn
        view = memoryview(buffer).cast("B")
        if conn.reading_head:
            room = MAX_HEAD_BYTES - self._head_bytes
            if room <= 0:
                raise _Cut("request head too large")
            view = view[:room]
        left = (conn.head_deadline if conn.reading_head else conn.deadline) - time.monotonic()
        if left <= 0:
            raise _Cut("request deadline passed")
        try:
            conn.sock.settimeout(left)
            n = conn.sock.recv_into(view)
        except TimeoutError as exc:
            raise _Cut("request deadline passed") from exc
        if conn.reading_head:
            self._head_bytes += n
            # The blank line that ends a head: seen, the connection is no
            # slow client, whether or not its thread has parsed it yet.
            seen = self._tail + bytes(view[:n])
            if HEAD_END in seen:
                conn.head_arrived = True
            self._tail = seen[-(len(HEAD_END) - 1) :]
        return n


class _AnswerWriter(io.BufferedIOBase):
    """The request's socket as a raw stream whose writes end by the
    connection's deadline (a socket timeout bounds a whole ``sendall``)."""

    def __init__(self, conn: _Connection) -> None:
        self._conn = conn

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        left = self._conn.deadline - time.monotonic()
        if left <= 0:
            raise _Cut("request deadline passed")
        try:
            self._conn.sock.settimeout(left)
            self._conn.sock.sendall(data)
        except TimeoutError as exc:
            raise _Cut("request deadline passed") from exc
        return len(data)


class _Handler(WSGIRequestHandler):
    """wsgiref's handler over a :class:`_Connection`'s bounded streams."""

    server: _Server

    def __init__(self, conn: _Connection, client_address: Any, server: _Server) -> None:
        self.conn = conn
        super().__init__(conn.sock, client_address, server)

    def setup(self) -> None:
        self.connection = self.request
        self.rfile = io.BufferedReader(_HeadReader(self.conn))
        self.wfile = _AnswerWriter(self.conn)

    def parse_request(self) -> bool:
        parsed = super().parse_request()  # reads the headers: the head is in
        self.server.head_read(self.conn)
        return parsed

    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes are not logged: one line every few seconds says nothing."""


class _Server(WSGIServer):
    """wsgiref's server with a thread per connection, each bounded by its
    deadlines, and admission by :meth:`_admit` (see :class:`MetricsServer`)."""

    allow_reuse_address = True
    request_queue_size = MAX_THREADS

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # A condition: a thread leaving tells a newcomer waiting for room.
        self._lock = threading.Condition()
        self._open: dict[_Connection, threading.Thread] = {}
        self._closing = False

    def process_request(self, request: Any, client_address: Any) -> None:
        conn = _Connection(request, str(client_address[0]))
        thread = threading.Thread(
            target=self._serve, args=(conn, client_address), name="metrics-http-request", daemon=True
        )
        with self._lock:
            if self._may_wait(conn.host):
                self._lock.wait_for(self._room_for_a_thread, timeout=CUT_GRACE_S)
            admitted = not self._closing and self._admit(conn)
            if admitted:
                try:
                    thread.start()
                except RuntimeError:  # no thread to be had: refused like a crowd
                    admitted = False
                else:
                    self._open[conn] = thread
        if not admitted:
            self.shutdown_request(request)  # refused, not queued

    def _may_wait(self, host: str) -> bool:
        """Under the lock: whether a newcomer from ``host`` may wait its
        grace for a thread. Connections are accepted one at a time, so each
        wait delays everyone queued behind it: a crowd reconnecting the
        moment it is cut queued its own waits ahead of a probe and held it
        for seconds (seen under load). A client already holding its share
        of threads, serving or ending, is refused at once instead."""
        return sum(1 for c in self._open if c.host == host) < MAX_PER_CLIENT

    def _room_for_a_thread(self) -> bool:
        """Under the lock: a thread can be had, or none is about to be (every
        thread serves a live connection, so waiting would not help)."""
        return len(self._open) < MAX_THREADS or not any(c.shut for c in self._open)

    def _admit(self, conn: _Connection) -> bool:
        """Room for ``conn`` (under the lock): a client at its share, or a
        full server, makes room by cutting the oldest connection still
        sending its head (the share's own, else that of the client holding
        the most); a connection whose head is in is never cut. Refused only
        when every slot is answering, or too many cut ones are still going."""
        if len(self._open) >= MAX_THREADS:
            return False
        live = [c for c in self._open if not c.shut]
        held: dict[str, int] = {}
        for c in live:
            held[c.host] = held.get(c.host, 0) + 1
        if held.get(conn.host, 0) >= MAX_PER_CLIENT:
            candidates = [c for c in live if c.host == conn.host and c.sending_head()]
        elif len(live) >= MAX_CONNECTIONS:
            candidates = [c for c in live if c.sending_head()]
        else:
            return True
        if not candidates:
            return False
        victim = min(candidates, key=lambda c: (-held[c.host], c.accepted))
        victim.shut_down()
        return True

    def head_read(self, conn: _Connection) -> None:
        with self._lock:
            conn.reading_head = False

    def _serve(self, conn: _Connection, client_address: Any) -> None:
        try:
            _Handler(conn, client_address, self)
        except OSError:
            pass  # a client cut, gone, or too slow: nothing to say
        except Exception as exc:  # the endpoint goes on; a bug is logged with its traceback
            log.exception("metrics_request_failed", error=type(exc).__name__)
        finally:
            with self._lock:  # before the socket is closed: shut_down never meets a reused descriptor
                self._open.pop(conn, None)
                self._lock.notify_all()
            self.shutdown_request(conn.sock)

    def cut_all(self) -> list[threading.Thread]:
        """Admit no more, shut every open connection; their threads."""
        with self._lock:
            self._closing = True
            for conn in self._open:
                conn.shut_down()
            return list(self._open.values())


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
                address, port, wsgi_app(health, registry), _Server, handler_class=_Handler
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
        """Stop accepting, cut every open connection, join the threads:
        within ``SERVER_STOP_TIMEOUT_S`` (a request thread still inside the
        app then is left, a daemon thread, and said in the log)."""
        deadline = time.monotonic() + SERVER_STOP_TIMEOUT_S
        self._server.shutdown()  # returns once serve_forever has (within its poll interval)
        self._thread.join(max(0.0, deadline - time.monotonic()))
        threads = self._server.cut_all()
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        self._server.server_close()
        left = sum(1 for thread in threads if thread.is_alive())
        if left:
            log.warning("metrics_requests_abandoned", requests=left, waited_s=SERVER_STOP_TIMEOUT_S)
