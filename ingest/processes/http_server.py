"""What the HTTP processes (``receive``, ``web``) share: a listening socket
bound before any work, and uvicorn without signal handlers of its own, its
accept failures logged once per interval (``http_guard`` holds the limits on
what a client may hold)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator

import uvicorn

from ingest.config.webhook import split_listen
from ingest.errors import ConfigError
from ingest.processes.http_guard import accept_errors_logged


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
