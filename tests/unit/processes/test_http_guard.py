"""``ingest.processes.http_guard`` (issue 43) on a real uvicorn over loopback,
in this process, with limits small enough to reach: heads and requests that
do not arrive in time are closed, a full server cuts the oldest connection
waiting for a head (never one with a request in flight), body bytes in
flight are capped before a body is read, and accept failures are one log
line per interval. Each test fails on uvicorn's own h11 protocol."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import resource
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import uvicorn
from structlog.testing import capture_logs

from ingest.processes import http_guard
from ingest.processes.http_guard import Limits, accept_errors_logged, guarded_h11, within_file_limit
from ingest.processes.http_server import Server, bind

WAIT_S = 5.0  # the bound on every wait for something the server must do
KEEP_ALIVE_S = 5  # uvicorn's idle timeout after an answer: longer than the heads' here


def _limits(**overrides: Any) -> Limits:
    values: dict[str, Any] = {
        "request_timeout_s": 5.0,
        "max_connections": 64,
        "max_body_bytes": 64 * 1024,
        "body_bytes_in_flight": 1024 * 1024,
        "refuse_too_large": False,
        "head_timeout_s": 5.0,
    }
    return Limits(**{**values, **overrides})


@dataclass
class App:
    """``/ok`` answers at once; ``/read`` reads the whole body and answers its
    length; ``/hold`` answers once ``release`` is set, counting who waits.
    ``entered`` is set by the first request to reach it."""

    entered: asyncio.Event = field(default_factory=asyncio.Event)
    release: asyncio.Event = field(default_factory=asyncio.Event)
    holding: int = 0
    held: asyncio.Event = field(default_factory=asyncio.Event)
    hold_count: int = 1

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self.entered.set()
        size = 0
        if scope["path"] == "/hold":
            self.holding += 1
            if self.holding >= self.hold_count:
                self.held.set()
            await self.release.wait()
        elif scope["path"] == "/read":
            more = True
            while more:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
                size += len(message.get("body", b""))
                more = message.get("more_body", False)
        body = str(size).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-length", b"%d" % len(body))],
            }
        )
        await send({"type": "http.response.body", "body": body})


@contextlib.asynccontextmanager
async def serving(
    limits: Limits, app: App | None = None, *, keep_alive_s: int = KEEP_ALIVE_S
) -> AsyncIterator[int]:
    """The guarded uvicorn on a loopback port, as the processes run it."""
    sock = bind("127.0.0.1:0", "test")
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        app or App(),
        lifespan="off",
        http=guarded_h11(limits),
        ws="none",
        log_config=None,
        log_level="error",
        access_log=False,
        timeout_keep_alive=keep_alive_s,
        timeout_graceful_shutdown=1,
    )
    server = Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        await asyncio.wait_for(server.up.wait(), WAIT_S)
        yield port
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, WAIT_S * 2)
        sock.close()


class Clients:
    """Client connections from any loopback address, all closed on exit."""

    def __init__(self, port: int) -> None:
        self.port = port
        self._writers: list[asyncio.StreamWriter] = []

    async def open(self, source: str = "127.0.0.1") -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port, local_addr=(source, 0))
        self._writers.append(writer)
        return reader, writer

    async def close(self) -> None:
        for writer in self._writers:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()


@contextlib.asynccontextmanager
async def clients(port: int) -> AsyncIterator[Clients]:
    c = Clients(port)
    try:
        yield c
    finally:
        await c.close()


async def closed_after(reader: asyncio.StreamReader) -> tuple[bytes, float]:
    """All the server sends until it closes, and how long that took; fails
    after ``WAIT_S``."""
    start = time.monotonic()
    try:
        data = await asyncio.wait_for(reader.read(), WAIT_S)
    except ConnectionResetError:
        data = b""
    return data, time.monotonic() - start


async def answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT_S)
    status_line, *lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines if line)}
    body = await asyncio.wait_for(reader.readexactly(int(headers.get("content-length", "0"))), WAIT_S)
    return int(status_line.split()[1]), headers, body


def get(path: str = "/ok", extra: str = "") -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: x\r\n{extra}\r\n".encode()


def post(path: str, length: int | None, *, chunked: bool = False) -> bytes:
    framing = "Transfer-Encoding: chunked\r\n" if chunked else f"Content-Length: {length}\r\n"
    return f"POST {path} HTTP/1.1\r\nHost: x\r\n{framing}\r\n".encode()


async def trickle(writer: asyncio.StreamWriter, reader: asyncio.StreamReader, interval_s: float) -> float:
    """A byte of a never-ending header every ``interval_s`` until the server
    closes; the seconds that took (bounded by ``WAIT_S``)."""
    start = time.monotonic()
    read = asyncio.ensure_future(reader.read())
    try:
        async with asyncio.timeout(WAIT_S):
            while not read.done():
                with contextlib.suppress(OSError):
                    writer.write(b"a")
                await asyncio.wait([read], timeout=interval_s)
    finally:
        read.cancel()
        with contextlib.suppress(asyncio.CancelledError, OSError):
            await read
    return time.monotonic() - start


async def test_a_silent_connection_is_closed_at_the_head_deadline() -> None:
    async with serving(_limits(head_timeout_s=0.5)) as port, clients(port) as c:
        reader, _ = await c.open()
        data, took_s = await closed_after(reader)
    assert data == b""
    assert 0.4 <= took_s < 3


async def test_a_trickled_head_gains_nothing_by_its_bytes() -> None:
    async with serving(_limits(head_timeout_s=0.5)) as port, clients(port) as c:
        reader, writer = await c.open()
        writer.write(b"GET / HTTP/1.1\r\nX-Slow: ")
        took_s = await trickle(writer, reader, 0.05)
    assert took_s < 3


async def test_an_idle_keep_alive_is_closed_at_its_timeout() -> None:
    async with serving(_limits(head_timeout_s=3.0), keep_alive_s=1) as port, clients(port) as c:
        reader, writer = await c.open()
        writer.write(get())
        assert (await answer(reader))[0] == 200
        data, took_s = await closed_after(reader)
    assert data == b""
    assert 0.8 <= took_s < 2.5  # uvicorn's keep-alive timer, not the head deadline


async def test_after_an_answer_a_trickled_next_head_is_closed_too() -> None:
    """uvicorn's keep-alive timer is cancelled by any byte and never armed
    again: without the guard, one byte every few seconds holds it forever."""
    async with serving(_limits(head_timeout_s=0.5)) as port, clients(port) as c:
        reader, writer = await c.open()
        writer.write(get())
        assert (await answer(reader))[0] == 200
        writer.write(b"GET / HTTP/1.1\r\nX-Slow: ")
        took_s = await trickle(writer, reader, 0.05)
    assert took_s < 3  # the keep-alive timeout is 5 s


async def test_a_body_still_coming_after_the_answer_is_cut_at_the_request_deadline() -> None:
    async with serving(_limits(request_timeout_s=1.0)) as port, clients(port) as c:
        reader, writer = await c.open()
        start = time.monotonic()
        writer.write(get(extra="Content-Length: 100000\r\n"))
        assert (await answer(reader))[0] == 200  # /ok answers without reading
        await trickle(writer, reader, 0.05)
    assert time.monotonic() - start < 3


async def test_a_body_that_does_not_arrive_in_time_is_408() -> None:
    async with serving(_limits(request_timeout_s=0.5)) as port, clients(port) as c:
        reader, writer = await c.open()
        writer.write(post("/read", 100) + b"x" * 10)
        status, headers, _ = await answer(reader)
        assert (status, headers["connection"]) == (408, "close")
        assert (await closed_after(reader))[0] == b""


async def test_an_app_that_does_not_answer_in_time_is_503_with_retry_after() -> None:
    app = App()
    async with serving(_limits(request_timeout_s=0.5), app) as port, clients(port) as c:
        reader, writer = await c.open()
        writer.write(get("/hold"))
        status, headers, _ = await answer(reader)
        assert status == 503
        assert headers["retry-after"].isdigit()
        app.release.set()  # what the app sends then goes nowhere, quietly
        assert (await closed_after(reader))[0] == b""


async def test_a_full_server_cuts_the_oldest_connection_waiting_for_a_head() -> None:
    async with serving(_limits(max_connections=4)) as port, clients(port) as c:
        idle = [await c.open(f"127.0.0.{n}") for n in (2, 3, 4, 5)]
        for reader, writer in idle[1:]:  # requests answered: waiting again, since after the first
            writer.write(get())
            assert (await answer(reader))[0] == 200
        reader, writer = await c.open("127.0.0.6")
        writer.write(get())
        assert (await answer(reader))[0] == 200
        assert (await closed_after(idle[0][0]))[0] == b""
        for reader, writer in idle[2:]:
            writer.write(get())
            assert (await answer(reader))[0] == 200


async def test_a_client_at_its_share_cuts_its_own_oldest_waiting_connection() -> None:
    limits = _limits(max_connections=8)
    assert limits.max_per_client == 4
    async with serving(limits) as port, clients(port) as c:
        mine = [await c.open("127.0.0.2") for _ in range(4)]
        others = [await c.open("127.0.0.3") for _ in range(2)]
        for reader, writer in [*mine[1:], *others]:
            writer.write(get())
            assert (await answer(reader))[0] == 200
        reader, writer = await c.open("127.0.0.2")
        writer.write(get())
        assert (await answer(reader))[0] == 200
        assert (await closed_after(mine[0][0]))[0] == b""
        for reader, writer in others:
            writer.write(get())
            assert (await answer(reader))[0] == 200


async def test_a_request_in_flight_is_never_cut_and_a_newcomer_is_refused() -> None:
    app = App(hold_count=4)
    async with serving(_limits(max_connections=4), app) as port, clients(port) as c:
        busy = [await c.open(f"127.0.0.{n}") for n in (2, 2, 3, 3)]
        for _, writer in busy:
            writer.write(get("/hold"))
        await asyncio.wait_for(app.held.wait(), WAIT_S)
        reader, _ = await c.open("127.0.0.4")
        refused, _ = await closed_after(reader)
        assert refused.startswith(b"HTTP/1.1 503 "), refused
        assert b"\r\nretry-after: " in refused
        reader, _ = await c.open("127.0.0.2")
        refused, _ = await closed_after(reader)
        assert refused.startswith(b"HTTP/1.1 429 "), refused
        app.release.set()
        for reader, _ in busy:
            assert (await answer(reader))[0] == 200


async def test_body_bytes_in_flight_are_capped_before_a_body_is_read() -> None:
    app = App()
    limits = _limits(body_bytes_in_flight=1000, max_body_bytes=800)
    async with serving(limits, app) as port, clients(port) as c:
        first, first_w = await c.open()
        first_w.write(post("/read", 600) + b"x" * 10)
        await asyncio.wait_for(app.entered.wait(), WAIT_S)  # its head is in: 600 bytes counted
        second, second_w = await c.open()
        second_w.write(post("/read", 600))
        status, headers, _ = await answer(second)
        assert (status, headers["connection"]) == (503, "close")
        assert headers["retry-after"].isdigit()
        first_w.write(b"x" * 590)
        assert (await answer(first))[::2] == (200, b"600")
        third, third_w = await c.open()  # the first's bytes were given back
        third_w.write(post("/read", 600) + b"y" * 600)
        assert (await answer(third))[2] == b"600"


async def test_a_chunked_body_past_the_cap_in_flight_is_cut_with_503() -> None:
    async with serving(_limits(body_bytes_in_flight=1000, max_body_bytes=800)) as port, clients(port) as c:
        reader, writer = await c.open()
        writer.write(post("/read", None, chunked=True) + b"200\r\n" + b"z" * 0x200 + b"\r\n")
        writer.write(b"400\r\n" + b"z" * 0x400 + b"\r\n")
        status, _, _ = await answer(reader)
        assert status == 503


async def test_a_declared_length_over_the_cap_is_413_or_left_to_the_app() -> None:
    async with serving(_limits(max_body_bytes=100, refuse_too_large=True)) as port, clients(port) as c:
        reader, writer = await c.open()
        writer.write(post("/read", 1000))  # no byte of the body sent: refused by its length
        status, headers, _ = await answer(reader)
        assert (status, headers["connection"]) == (413, "close")
    async with serving(_limits(max_body_bytes=100, refuse_too_large=False)) as port, clients(port) as c:
        reader, writer = await c.open()
        writer.write(post("/read", 1000) + b"x" * 1000)  # the app decides: this one reads it
        assert (await answer(reader))[2] == b"1000"


def test_the_connections_stay_below_the_file_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    def limit(soft: int) -> Callable[[int], tuple[int, int]]:
        return lambda _which: (soft, 1 << 20)

    monkeypatch.setattr(resource, "getrlimit", limit(1024))
    assert within_file_limit(2000) == 1024 - http_guard.FD_RESERVE
    assert within_file_limit(100) == 100
    monkeypatch.setattr(resource, "getrlimit", limit(64))
    assert within_file_limit(2000) == http_guard.MIN_CONNECTIONS


async def test_accept_failures_are_one_line_per_interval_and_the_rest_goes_on() -> None:
    loop = asyncio.get_running_loop()
    others: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: others.append(context))
    try:
        with capture_logs() as logged, accept_errors_logged(loop, every_s=60):
            for _ in range(1000):
                loop.call_exception_handler(
                    {
                        "message": "socket.accept() out of system resource",
                        "exception": OSError(errno.EMFILE, "Too many open files"),
                        "socket": object(),
                    }
                )
            loop.call_exception_handler({"message": "something else", "exception": ValueError("x")})
    finally:
        loop.set_exception_handler(None)
    assert [(e["event"], e["errno"], e["failed_since_last_line"]) for e in logged] == [
        ("accept_failed", "EMFILE", 0)
    ]
    assert [c["message"] for c in others] == ["something else"]


# A server out of descriptors, for real: its accepts fail with EMFILE while
# connections wait in its backlog. It prints how many lines it logged.
_OUT_OF_FILES = textwrap.dedent(
    """
    import asyncio, resource, socket, sys, time
    from structlog.testing import capture_logs
    from ingest.processes.http_guard import accept_errors_logged

    async def main():
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        loop = asyncio.get_running_loop()
        server = await loop.create_server(asyncio.Protocol, sock=sock, backlog=64)
        print(sock.getsockname()[1], flush=True)
        sys.stdin.readline()  # the clients are waiting in the backlog
        hog = []
        with capture_logs() as logged, accept_errors_logged(loop):
            try:
                while True:
                    hog.append(socket.socket())
            except OSError:
                pass
            await asyncio.sleep(2.5)  # asyncio retries every second, a hundred tries each time
            for s in hog:
                s.close()
        server.close()
        print(len([e for e in logged if e["event"] == "accept_failed"]), flush=True)

    asyncio.run(main())
    """
)


def test_a_server_out_of_file_descriptors_logs_one_line_not_one_per_try() -> None:
    with subprocess.Popen(
        [sys.executable, "-c", _OUT_OF_FILES],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        assert proc.stdin is not None
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        waiting = [socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) for _ in range(5)]
        try:
            proc.stdin.write("go\n")
            proc.stdin.flush()
            lines = proc.stdout.readline()
            _out, err = proc.communicate(timeout=30)
        finally:
            for s in waiting:
                s.close()
    assert proc.returncode == 0, err
    assert int(lines) == 1, err
    assert "Traceback" not in err
