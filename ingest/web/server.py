"""``switchboard web``: the console's process, on the process skeleton
(heartbeat row with role ``web``, ``[metrics]`` endpoint, graceful stop),
serving the Starlette app on uvicorn like ``switchboard receive``.

At start, before any request: the listen address is checked (non-loopback
without a token: a ConfigError, exit 2) and bound, and the database is asked
whether this login may act (``has_column_privilege`` on what the actions
write); a login that may not makes the console read-only, as
``--read-only`` does.

Its h11 protocol is ``http_guard``'s, as the receiver's: a head within a few
seconds, a request within its deadline, connections capped per address and
in all, a form over ``MAX_FORM_BYTES`` refused (413) by its declared length
before it is read (:func:`web_limits`).
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
import structlog
from sqlalchemy.ext.asyncio import AsyncEngine

from backhalf.db import create_engine, within_deadline
from ingest.config import Settings
from ingest.config.webhook import split_listen
from ingest.errors import ConfigError
from ingest.lifecycle import wait_stop
from ingest.processes.http_guard import REQUEST_GRACE_S, Limits, within_file_limit
from ingest.processes.http_server import Server, bind, guarded_config
from ingest.processes.skeleton import Job, Process, ProcessBody, run_process
from ingest.web import app as web_app
from ingest.web.console import Console, templates
from ingest.web.figures import OverviewCache
from ingest.web.security import MIN_TOKEN_LENGTH, TOKEN_VARIABLE, Guard, is_loopback

log = structlog.get_logger(__name__)

DEFAULT_LISTEN = "127.0.0.1:8089"
SHUTDOWN_S = 5.0
# Connections open at once (fewer under a low open-file limit): a few
# operators' browsers, six or so each, or the proxy in front of them.
MAX_CONNECTIONS = 256
# Forms received and not yet answered, over all requests: 64 of the largest.
BODY_BYTES_IN_FLIGHT = 64 * web_app.MAX_FORM_BYTES
# What the actions write: a login without one of these privileges cannot act.
WRITES = (
    ("adapters", "enabled", "UPDATE"),
    ("todos", "status", "UPDATE"),
    ("todos", "payload", "INSERT"),  # a replay's todo
    ("events", "payload", "INSERT"),  # a replay's event
    ("inbox", "status", "UPDATE"),
    ("todo_events", "to_status", "INSERT"),
)


@dataclass(frozen=True, slots=True)
class WebOptions:
    listen: str = DEFAULT_LISTEN
    read_only: bool = False


def web_limits(settings: Settings) -> Limits:
    """What one client may hold of the console. A page reads under the
    transaction deadline, the overview's figures under twice it: the request
    gets that, and a second."""
    deadline_s = settings.database.transaction_deadline_ms / 1000
    return Limits(
        request_timeout_s=2 * deadline_s + REQUEST_GRACE_S,
        max_connections=within_file_limit(MAX_CONNECTIONS),
        max_body_bytes=web_app.MAX_FORM_BYTES,
        body_bytes_in_flight=BODY_BYTES_IN_FLIGHT,
        refuse_too_large=True,
    )


def check_bound(sock: socket.socket, listen: str, guard: Guard) -> None:
    """Without a token, the address bound must be loopback: a name such as
    ``console.localhost`` is loopback by its words, not by what it resolves to."""
    address = sock.getsockname()[0]
    if guard.token is None and not ipaddress.ip_address(address.split("%")[0]).is_loopback:
        raise ConfigError(
            f"--listen {listen}: resolves to {address}, not a loopback address, and {TOKEN_VARIABLE}"
            " is not set: set a token before the console listens beyond this machine"
        )


def check_access(listen: str, env: Mapping[str, str]) -> Guard:
    """The guard for this listen address: a token of ``MIN_TOKEN_LENGTH``
    characters at least; none only on loopback."""
    token = env.get(TOKEN_VARIABLE) or None
    if token is not None and len(token) < MIN_TOKEN_LENGTH:
        raise ConfigError(f"{TOKEN_VARIABLE} must be {MIN_TOKEN_LENGTH} characters or more")
    host, _port = split_listen(listen)
    if token is None and not is_loopback(host):
        raise ConfigError(
            f"--listen {listen}: not a loopback address, and {TOKEN_VARIABLE} is not set:"
            " set a token before the console listens beyond this machine"
        )
    return Guard(token)


async def run_web(
    settings: Settings, stop: asyncio.Event, options: WebOptions, *, env: Mapping[str, str]
) -> None:
    guard = check_access(options.listen, env)
    sock = bind(options.listen, "--listen")
    try:
        check_bound(sock, options.listen, guard)
        await run_process(settings, stop, lambda engine: _WebBody(settings, engine, guard, options, sock))
    finally:
        sock.close()


async def may_write(engine: AsyncEngine, deadline_ms: int) -> bool:
    """Whether this login holds every privilege the actions need."""
    checks = [
        sa.func.has_column_privilege(sa.literal(table), sa.literal(column), sa.literal(kind))
        for table, column, kind in WRITES
    ]
    async with within_deadline(engine.connect(), deadline_ms, "checking the console's grants") as conn:
        answers = (await conn.execute(sa.select(*checks))).one()
    return all(answers)


class _WebBody(ProcessBody):
    role = "web"
    stopped_event = "web_stopped"
    overdue_field = "tasks"

    def __init__(
        self, settings: Settings, engine: AsyncEngine, guard: Guard, options: WebOptions, sock: socket.socket
    ) -> None:
        self.shutdown_timeout_s = SHUTDOWN_S + 1
        self._settings = settings
        self._engine = engine
        self._guard = guard
        self._options = options
        self._sock = sock
        self._read_only_why: str | None = "--read-only" if options.read_only else None
        # The pages' and actions' own pool: a burst of slow requests cannot
        # take the connection the heartbeat needs (the skeleton's engine).
        self._requests = create_engine(settings.database)

    async def start(self, process: Process) -> bool:
        if self._read_only_why is None and not await may_write(self._engine, process.deadline_ms):
            self._read_only_why = "this database login may not write what the actions change"
        return True

    def spawn(self, process: Process) -> None:
        process.work(self._serve(process), name="http")

    async def _serve(self, process: Process) -> None:
        console = Console(
            settings=self._settings,
            engine=self._requests,
            guard=self._guard,
            read_only=self._read_only_why is not None,
            read_only_why=self._read_only_why,
            templates=templates(),
            overview=OverviewCache(self._requests, self._settings),
            healthy=process.liveness.report,
        )
        limits = web_limits(self._settings)
        config = guarded_config(web_app.build(console), limits, graceful_s=int(SHUTDOWN_S))
        server = Server(config)
        serving = asyncio.create_task(server.serve(sockets=[self._sock]), name="uvicorn")
        up = asyncio.create_task(server.up.wait(), name="uvicorn-up")
        try:
            await asyncio.wait([up, serving], return_when=asyncio.FIRST_COMPLETED)
            if serving.done():  # it could not start: its error is the process's
                await serving
                return
            if server.started:
                log.info(
                    "web_listening",
                    listen=self._options.listen,
                    read_only=console.read_only,
                    read_only_why=self._read_only_why,
                    signin="token" if self._guard.token else "none (loopback only)",
                    max_connections=limits.max_connections,
                    max_per_client=limits.max_per_client,
                )
            stopping = asyncio.create_task(process.stop.wait(), name="web-stop")
            # The server ending by itself (not asked to) ends the process: a
            # console that serves nothing must not beat as alive.
            await asyncio.wait([stopping, serving], return_when=asyncio.FIRST_COMPLETED)
            stopping.cancel()
            if serving.done() and not process.stop.is_set():
                serving.result()  # its error, if any, is the process's
                raise RuntimeError("the console's HTTP server stopped by itself")
            server.should_exit = True  # no new connection; requests in flight are answered
            await serving
        finally:
            up.cancel()
            serving.cancel()
            await asyncio.gather(up, serving, return_exceptions=True)

    def detail(self) -> Mapping[str, Any]:
        return {"listen": self._options.listen, "read_only": self._read_only_why is not None}

    def gauges(self, process: Process, interval_s: float) -> tuple[str, Job]:
        return "web-gauges", self._idle(process)

    async def _idle(self, process: Process) -> None:
        """The console has no gauges of its own: its /metrics has the process's."""
        while not process.stop.is_set():
            await wait_stop(process.stop, 60.0)

    async def close(self) -> None:
        """The requests' engine; the skeleton's engine is the skeleton's, the socket run_web's."""
        await self._requests.dispose()
