"""What the HTTP processes (``receive``, ``web``) share: a listening socket
bound before any work, and uvicorn without signal handlers of its own, its
accept failures logged once per interval (``http_guard`` holds the limits on
what a client may hold)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator
from typing import Any

import uvicorn

from ingest.config.webhook import split_listen
from ingest.errors import ConfigError
from ingest.processes.http_guard import BACKLOG, Limits, accept_errors_logged, guarded_h11


def bind(listen: str, what: str) -> socket.socket:
    """The listening socket, bound now: a taken port or an address this host
    lacks is a ConfigError (``what`` names the setting) before any work."""
    host, port = split_listen(listen)
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = infos[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise ConfigError(f"{what} {listen!r}: {exc.strerror or exc}") from exc
    # Bound, not listening: a connection is refused until uvicorn serves
    # (asyncio's server calls listen), never left unanswered in the backlog
    # while start-up waits for the database.
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"{what} {listen!r}: cannot listen there: {exc.strerror or exc}") from exc
    sock.setblocking(False)
    return sock


def guarded_config(app: Any, limits: Limits, *, graceful_s: int, **more: Any) -> uvicorn.Config:
    """uvicorn as both HTTP processes run it: h11, whatever else is installed
    (what their behaviour was built and tested on), under the guard's
    deadlines and caps; no lifespan, no websockets, no server header; and
    no log line per malformed request (anyone can send one): only uvicorn's
    errors reach the log, refusals are ours, rate-limited. ``graceful_s``:
    how long requests in flight are given at a stop."""
    return uvicorn.Config(
        app,
        lifespan="off",
        http=guarded_h11(limits),
        ws="none",
        log_config=None,
        log_level="error",
        access_log=False,
        server_header=False,
        backlog=BACKLOG,
        timeout_keep_alive=5,
        timeout_graceful_shutdown=graceful_s,
        **more,
    )


class Server(uvicorn.Server):
    """uvicorn without its own signal handlers: the process's stop ends it;
    ``up`` is set once it serves (uvicorn itself says so by a flag only).
    Out of file descriptors, asyncio's accept logs every try, with a
    traceback, thousands a second: one line every few seconds instead."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.up = asyncio.Event()

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        with accept_errors_logged(asyncio.get_running_loop()):
            await super().serve(sockets=sockets)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        self.up.set()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield
