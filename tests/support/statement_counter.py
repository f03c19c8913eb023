"""A TCP proxy on loopback in front of PostgreSQL that counts the statements
its clients send: each simple query (``Q``) and each execute of the
extended protocol (``E``), read off the wire (PostgreSQL's protocol 3.0),
whatever the client library does. Point a process's database URL at it
(:meth:`StatementCounter.url_for`) to count what that process runs.

The client's first messages carry no type byte (an SSLRequest or a
GSSENCRequest, which a server without TLS answers ``N``, then the
StartupMessage); typed messages follow. A connection that upgrades to TLS
could not be read: the test servers offer none."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator

from ingest.embedded.servers import free_port

PROTOCOL_3 = 196608  # the StartupMessage's version: typed messages follow it
STATEMENTS = (b"Q", b"E")
CHUNK = 65536


class StatementCounter:
    def __init__(self, target_port: int) -> None:
        self.port = free_port()
        self._target = target_port
        self._lock = threading.Lock()
        self._statements = 0
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"counter:{self.port}", daemon=True
        )

    @property
    def statements(self) -> int:
        with self._lock:
            return self._statements

    def url_for(self, url: str) -> str:
        return url.replace(f":{self._target}/", f":{self.port}/", 1)

    def start(self) -> None:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result(timeout=10)

    def stop(self) -> None:
        async def shutdown() -> None:
            if self._server is not None:
                self._server.close()
            for w in list(self._writers):
                w.close()

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)

    async def _accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            server_r, server_w = await asyncio.open_connection("127.0.0.1", self._target)
        except OSError:
            client_w.close()
            return
        self._writers |= {client_w, server_w}
        await asyncio.gather(
            self._pump(client_r, server_w, count=True), self._pump(server_r, client_w, count=False)
        )
        for w in (client_w, server_w):
            self._writers.discard(w)
            w.close()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, count: bool) -> None:
        messages = _Messages()
        with contextlib.suppress(OSError, asyncio.CancelledError):
            while chunk := await reader.read(CHUNK):
                if count:
                    found = messages.feed(chunk)
                    if found:
                        with self._lock:
                            self._statements += found
                writer.write(chunk)
                await writer.drain()
        with contextlib.suppress(OSError):
            writer.close()


class _Messages:
    """One client's byte stream, cut into protocol messages; counts the statements."""

    def __init__(self) -> None:
        self._buffer = b""
        self._typed = False

    def feed(self, chunk: bytes) -> int:
        self._buffer += chunk
        found = 0
        while True:
            head = 5 if self._typed else 4
            if len(self._buffer) < head:
                return found
            start = 1 if self._typed else 0
            length = int.from_bytes(self._buffer[start : start + 4], "big")
            if len(self._buffer) < start + length:
                return found
            message, self._buffer = self._buffer[: start + length], self._buffer[start + length :]
            if self._typed:
                found += message[:1] in STATEMENTS
            elif int.from_bytes(message[4:8], "big") == PROTOCOL_3:
                self._typed = True


@contextlib.contextmanager
def counting(port: int) -> Iterator[StatementCounter]:
    counter = StatementCounter(port)
    counter.start()
    try:
        yield counter
    finally:
        counter.stop()
