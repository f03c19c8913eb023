"""What an HTTP client may hold of ``switchboard receive`` and ``switchboard
web`` (issue 43): uvicorn's h11 protocol with deadlines and caps.

uvicorn alone arms no deadline before a request's head is complete (its
keep-alive timer runs only after an answer, and any byte cancels it), counts
idle connections against ``limit_concurrency`` (so idle sockets make every
request 503), and bounds no body bytes in total. Here, per server:

* **The head** (request line and headers; h11 refuses one over 16 KiB) must
  be in within ``head_timeout_s`` of the accept, or of the first byte after
  a keep-alive pause (an idle one is closed by uvicorn's own
  ``timeout_keep_alive``). A trickled byte does not extend it.
* **The request**, from its head to the end of both its body and its
  answer, within ``request_timeout_s``: else 408 while the body is still
  coming, 503 while the app has not answered, or just closed once the answer
  has started (a client that does not read it).
* **Connections**: at most ``max_connections``, ``max_per_client`` of them
  from one address. A newcomer over either makes room by closing the oldest
  connection that waits for a head (its own address's, when that address is
  at its share); a request in flight is never cut. Refused (429, 503, then
  closed) only when every connection has a request in flight. So idle and
  trickling sockets never keep a real request out, and the cap stays below
  the process's file limit (``within_file_limit``): accepting does not fail.
* **Body bytes in flight**, over all requests: a declared length is counted
  at the head, and a head whose length does not fit is answered 503 with
  ``Retry-After`` before a byte of its body is read; a body of no declared
  length is counted as it comes and cut (503) when it does not fit. A
  declared length over ``max_body_bytes`` is answered 413 here
  (``refuse_too_large``) or left to the app (the receiver's 413, per
  adapter, with its metric).

What is shed is logged as one ``http_shed`` line every ``LOG_EVERY_S`` at
most, with counts; accept failures (out of file descriptors) as one
``accept_failed`` line every ``LOG_EVERY_S`` (:func:`accept_errors_logged`):
asyncio logs one per try, thousands a second, with a traceback each.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import http
import json
import resource
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import h11
import structlog
from h11._connection import DEFAULT_MAX_INCOMPLETE_EVENT_SIZE
from uvicorn.config import Config
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.utils import get_remote_addr
from uvicorn.server import ServerState

if TYPE_CHECKING:
    from uvicorn._types import ASGI3Application, ASGIReceiveCallable, ASGISendCallable, Scope

log = structlog.get_logger(__name__)

# A request's head comes in one packet from a real sender, a proxy or a
# browser; a few seconds covers a slow link. Past it the socket is a
# slowloris's (or a browser's unused preconnect): closed.
HEAD_TIMEOUT_S = 5.0
# Added to a server's own answer deadline for its request deadline, so the
# app's answer (the receiver's 503 at respond_within_ms) always comes first.
REQUEST_GRACE_S = 1.0
# Connections asyncio accepts in one go (its accept loop takes up to the
# listen backlog per turn, before any is handed to a protocol and counted),
# and the listen backlog itself: pass it to uvicorn.Config(backlog=...).
BACKLOG = 128
# File descriptors kept beside the client connections: the process's own (the
# database pools, the metrics endpoint's threads, logs, the event loop's),
# and two turns of accepts not yet counted (a connection cut to make room
# closes its descriptor a turn later).
OWN_FDS = 96
FD_RESERVE = OWN_FDS + 2 * BACKLOG
MIN_CONNECTIONS = 16
RETRY_AFTER_S = 5
LOG_EVERY_S = 10.0
# What asyncio's accept reports when the process or the system is out of
# descriptors or memory (it retries a second later, and logs every try).
ACCEPT_RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


@dataclass(frozen=True, slots=True)
class Limits:
    """One server's limits (the module docstring says what each bounds)."""

    request_timeout_s: float
    max_connections: int
    max_body_bytes: int
    body_bytes_in_flight: int
    refuse_too_large: bool
    head_timeout_s: float = HEAD_TIMEOUT_S

    @property
    def max_per_client(self) -> int:
        # Half: one address (an attacker, or the proxy every request comes
        # through) never holds the whole server, and a proxy still has room.
        return max(1, self.max_connections // 2)


def within_file_limit(wanted: int) -> int:
    """``wanted`` connections, or fewer when the process's open-file limit
    (systemd's default is 1024) would not leave ``FD_RESERVE`` beside them:
    then accepting never runs out of descriptors, however many clients come
    (an accept that does anyway waits a second, logged by
    :func:`accept_errors_logged`)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return wanted
    return max(MIN_CONNECTIONS, min(wanted, soft - FD_RESERVE))


class _Every:
    """At most one log line every ``every_s``: ``due`` says whether this one
    is logged, and how many were held back since the last."""

    def __init__(self, every_s: float) -> None:
        self._every_s = every_s
        self._last = -every_s
        self._held = 0

    def due(self) -> int | None:
        now = time.monotonic()
        if now - self._last < self._every_s:
            self._held += 1
            return None
        self._last = now
        held, self._held = self._held, 0
        return held


@contextlib.contextmanager
def accept_errors_logged(loop: asyncio.AbstractEventLoop, every_s: float = LOG_EVERY_S) -> Iterator[None]:
    """While inside: an accept that fails for want of descriptors (asyncio
    calls the loop's exception handler with the listening ``socket``) is one
    ``accept_failed`` line every ``every_s``, with a count; anything else
    goes to the handler there was."""
    previous = loop.get_exception_handler()
    every = _Every(every_s)

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if "socket" in context and isinstance(exc, OSError) and exc.errno in ACCEPT_RESOURCE_ERRNOS:
            held = every.due()
            if held is not None:
                log.error(
                    "accept_failed",
                    error=exc.strerror or str(exc),
                    errno=errno.errorcode.get(exc.errno or 0, str(exc.errno)),
                    failed_since_last_line=held,
                )
            return
        if previous is None:
            loop.default_exception_handler(context)
        else:
            previous(loop, context)

    loop.set_exception_handler(handler)
    try:
        yield
    finally:
        loop.set_exception_handler(previous)


def _json(error: str, detail: str, *, retry: bool = False) -> tuple[list[tuple[bytes, bytes]], bytes]:
    body = json.dumps({"error": error, "detail": detail}).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]
    if retry:
        headers.append((b"retry-after", str(RETRY_AFTER_S).encode()))
    return headers, body


def _raw(status: int, error: str, detail: str, *, retry: bool) -> bytes:
    """A whole answer, written before the request is read (a connection refused)."""
    headers, body = _json(error, detail, retry=retry)
    lines = [f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}".encode()]
    lines += [name + b": " + value for name, value in headers]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def _answer(status: int, error: str, detail: str, *, retry: bool = False) -> ASGI3Application:
    """An app answering this, the body unread (``Connection: close``)."""
    headers, body = _json(error, detail, retry=retry)

    async def app(scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable) -> None:
        await send({"type": "http.response.start", "status": status, "headers": headers, "trailers": False})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    return app


class Gate:
    """One server's shared state: connections per address, those waiting for
    a head (oldest first), body bytes in flight, what was shed."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.body_bytes = 0
        self._open: dict[GuardedH11Protocol, str] = {}
        self._held: dict[str, int] = {}
        # Waiting for a head, in the order they began to: the first is the one cut.
        self._waiting: dict[GuardedH11Protocol, None] = {}
        self._waiting_by_host: dict[str, dict[GuardedH11Protocol, None]] = {}
        self._shed: dict[str, int] = {}
        self._every = _Every(LOG_EVERY_S)
        busy = "too many request bodies are in flight: retry later"
        self.busy_app = _answer(503, "busy", busy, retry=True)
        self.too_large_app = _answer(
            413, "too_large", f"the body is over {limits.max_body_bytes} bytes", retry=False
        )
        self.busy_bytes = _raw(503, "busy", "too many connections: retry later", retry=True)
        self.too_many_bytes = _raw(
            429, "too_many_connections", "too many connections from one address", retry=True
        )

    def admit(self, conn: GuardedH11Protocol, host: str) -> bytes | None:
        """Room for ``conn`` from ``host``, made by cutting the oldest
        connection waiting for a head if need be; None, or the answer that
        refuses it."""
        if self._held.get(host, 0) >= self.limits.max_per_client:
            victim = next(iter(self._waiting_by_host.get(host, {})), None)
            refusal = self.too_many_bytes
        elif len(self._open) >= self.limits.max_connections:
            victim = next(iter(self._waiting), None)
            refusal = self.busy_bytes
        else:
            victim, refusal = None, None
        if refusal is not None:
            if victim is None:
                self.shed("refused")
                return refusal
            self.shed("cut_for_room")
            victim.cut()
        self._open[conn] = host
        self._held[host] = self._held.get(host, 0) + 1
        self.waits(conn)
        return None

    def forget(self, conn: GuardedH11Protocol) -> None:
        if conn not in self._open:
            return
        self.busy(conn)
        host = self._open.pop(conn)
        left = self._held[host] - 1
        if left:
            self._held[host] = left
        else:
            del self._held[host]

    def waits(self, conn: GuardedH11Protocol) -> None:
        """``conn`` waits for a head (kept in its place if it already did)."""
        host = self._open.get(conn)
        if host is not None and conn not in self._waiting:
            self._waiting[conn] = None
            self._waiting_by_host.setdefault(host, {})[conn] = None

    def busy(self, conn: GuardedH11Protocol) -> None:
        """``conn`` has a request in flight: never cut to make room."""
        if conn not in self._waiting:
            return
        del self._waiting[conn]
        host = self._open[conn]
        of_host = self._waiting_by_host[host]
        del of_host[conn]
        if not of_host:
            del self._waiting_by_host[host]

    def take(self, n: int) -> bool:
        if self.body_bytes + n > self.limits.body_bytes_in_flight:
            return False
        self.body_bytes += n
        return True

    def give(self, n: int) -> None:
        self.body_bytes -= n

    def shed(self, why: str) -> None:
        self._shed[why] = self._shed.get(why, 0) + 1
        if self._every.due() is not None:
            log.info(
                "http_shed",
                **self._shed,
                open_connections=len(self._open),
                body_bytes_in_flight=self.body_bytes,
            )
            self._shed = {}


class _Watched(h11.Connection):
    """h11's server side, telling the protocol of each head and body chunk
    as uvicorn's loop takes them (before it hands the request to the app)."""

    def __init__(self, protocol: GuardedH11Protocol, max_incomplete_event_size: int) -> None:
        super().__init__(h11.SERVER, max_incomplete_event_size)
        self._protocol = protocol

    def next_event(self) -> h11.Event | type[h11.NEED_DATA] | type[h11.PAUSED]:
        event = super().next_event()
        if isinstance(event, h11.Request):
            self._protocol.head_in(event)
        elif isinstance(event, h11.Data):
            self._protocol.body_in(len(event.data))
        return event


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol under its server's :class:`Gate` (a class made
    per server by :func:`guarded_h11`). Written against uvicorn 0.55's
    ``H11Protocol`` (``constraints.txt``): it relies on its ``conn``,
    ``cycle``, ``app`` and ``timeout_keep_alive_task``, and
    ``tests/unit/processes/test_http_guard.py`` fails on an upgrade that
    changes them."""

    gate: ClassVar[Gate]

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        size = config.h11_max_incomplete_event_size
        self.conn = _Watched(self, DEFAULT_MAX_INCOMPLETE_EVENT_SIZE if size is None else size)
        self._app = self.app
        self._admitted = False
        self._head_timer: asyncio.TimerHandle | None = None
        self._request_timer: asyncio.TimerHandle | None = None
        self._refusing = False  # this request is answered by the gate: its body is not counted
        self._body_taken = 0  # bytes of this request's body counted in the gate
        self._body_seen = 0

    # --- asyncio.Protocol

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        peer = get_remote_addr(transport)
        refusal = self.gate.admit(self, peer[0] if peer else "")
        if refusal is not None:
            transport.write(refusal)
            transport.close()
            return
        self._admitted = True
        super().connection_made(transport)
        self._watch()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._admitted:
            return
        self._disarm()
        self._give_back()
        self.gate.forget(self)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if not self._admitted:
            return
        super().data_received(data)
        self._watch()

    def on_response_complete(self) -> None:
        self._give_back()  # answered: the app holds its body no longer
        super().on_response_complete()
        self._watch()

    # --- told by _Watched, inside uvicorn's handle_events

    def head_in(self, event: h11.Request) -> None:
        self._give_back()
        self._cancel_head()
        self.gate.busy(self)
        if self._request_timer is not None:
            self._request_timer.cancel()
        self._request_timer = self.loop.call_later(self.gate.limits.request_timeout_s, self._request_overdue)
        declared = _declared_length(event)
        limits = self.gate.limits
        self._refusing = False
        app = self._app
        if declared is not None and declared > limits.max_body_bytes:
            if limits.refuse_too_large:
                self.gate.shed("too_large")
                app, self._refusing = self.gate.too_large_app, True
        elif declared:
            if self.gate.take(declared):
                self._body_taken = declared
            else:
                self.gate.shed("body_budget")
                app, self._refusing = self.gate.busy_app, True
        self.app = app  # what uvicorn runs for this request, read right after

    def body_in(self, n: int) -> None:
        cycle = self.cycle
        if self._refusing or cycle is None or cycle.response_complete or self.transport.is_closing():
            return  # uvicorn drops it, or the answer needs none of it
        self._body_seen += n
        more = self._body_seen - self._body_taken
        if more <= 0:
            return
        if not self.gate.take(more):
            self.gate.shed("body_budget")
            self._abort(503, "busy", "too many request bodies are in flight: retry later")
            return
        self._body_taken += more

    # --- the deadlines

    def _watch(self) -> None:
        """After each event: the head deadline armed while a head is awaited
        (and uvicorn's keep-alive timer is not), the request's cancelled once
        both its body and its answer are done."""
        if self.transport.is_closing():
            self._disarm()
            return
        theirs = self.conn.their_state
        if theirs is h11.IDLE:
            self.gate.waits(self)
            if self._head_timer is None and self.timeout_keep_alive_task is None:
                self._head_timer = self.loop.call_later(self.gate.limits.head_timeout_s, self._head_overdue)
        else:
            self._cancel_head()
        answered = self.cycle is None or self.cycle.response_complete
        if self._request_timer is not None and answered and theirs is not h11.SEND_BODY:
            self._request_timer.cancel()
            self._request_timer = None

    def _head_overdue(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            self.gate.shed("head_timeout")
            self.transport.close()

    def _request_overdue(self) -> None:
        self._request_timer = None
        if self.transport.is_closing():
            return
        self.gate.shed("request_timeout")
        if self.conn.their_state is h11.SEND_BODY:
            self._abort(408, "request_timeout", "the request did not arrive in time")
        else:
            self._abort(503, "unanswered", "no answer in time: retry later", retry=True)

    def cut(self) -> None:
        """Closed to make room for a newcomer (it waits for a head)."""
        self.gate.forget(self)
        self._disarm()
        self.transport.close()

    def _abort(self, status: int, error: str, detail: str, *, retry: bool = False) -> None:
        """Answer ``status`` if no answer has started, and close; the app's
        request sees a disconnect, and what it sends goes nowhere."""
        cycle = self.cycle
        if cycle is not None and not cycle.response_started:
            headers, body = _json(error, detail, retry=retry)
            phrase = http.HTTPStatus(status).phrase.encode()
            try:
                out = self.conn.send(h11.Response(status_code=status, headers=headers, reason=phrase))
                out += self.conn.send(h11.Data(data=body))
                out += self.conn.send(h11.EndOfMessage())
            except h11.LocalProtocolError:
                out = b""
            self.transport.write(out)
        if cycle is not None:
            cycle.disconnected = True
            cycle.message_event.set()
        self._disarm()
        self.transport.close()

    def _cancel_head(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _disarm(self) -> None:
        self._cancel_head()
        if self._request_timer is not None:
            self._request_timer.cancel()
            self._request_timer = None

    def _give_back(self) -> None:
        self.gate.give(self._body_taken)
        self._body_taken = self._body_seen = 0


def _declared_length(event: h11.Request) -> int | None:
    """The body's declared length; None when chunked (h11 has checked both)."""
    length = None
    for name, value in event.headers:
        if name == b"transfer-encoding":
            return None
        if name == b"content-length":
            length = int(value)
    return length


def guarded_h11(limits: Limits) -> type[GuardedH11Protocol]:
    """The protocol class for one server (uvicorn's ``Config(http=...)``),
    with a gate of its own."""

    class Guarded(GuardedH11Protocol):
        gate = Gate(limits)

    return Guarded
