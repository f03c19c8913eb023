"""A small TCP proxy on loopback, in a thread of the test process, for
network faults between a real switchboard process and a real server:
added latency, a blackhole (bytes swallowed, no reset), and cutting a
connection right after a given client message has been forwarded (a COMMIT
sent whose reply never comes back). With ``server_ssl`` it terminates TLS:
clients speak TLS to it, the server behind it plain TCP, as behind stunnel."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import threading
from collections.abc import Iterator

from ingest.embedded.servers import free_port

CHUNK = 65536


class Proxy:
    def __init__(self, target_port: int, server_ssl: ssl.SSLContext | None = None) -> None:
        self.port = free_port()
        self._target = target_port
        self._server_ssl = server_ssl
        self.latency_s = 0.0
        self.blackhole = False
        self.cut_after: bytes | None = None  # close once a client chunk containing this was sent,
        # on a connection that has sent this before (or in that chunk): a
        # COMMIT cut only where it ends a given statement's transaction.
        self.cut_only_after: bytes | None = None
        # True: never in the chunk that carries cut_only_after itself (a
        # statement whose text holds cut_after too is cut at its execution,
        # not as its text is sent).
        self.cut_in_a_later_chunk = False
        self.cuts = 0
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"proxy:{self.port}", daemon=True)

    def url_for(self, url: str) -> str:
        return url.replace(f":{self._target}/", f":{self.port}/", 1)

    def start(self) -> None:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result(timeout=10)

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port, ssl=self._server_ssl)

    async def _accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            server_r, server_w = await asyncio.open_connection("127.0.0.1", self._target)
        except OSError:
            client_w.close()
            return
        self._writers |= {client_w, server_w}
        pair = (client_w, server_w)
        for task in (
            asyncio.create_task(self._pump(client_r, server_w, pair, upstream=True)),
            asyncio.create_task(self._pump(server_r, client_w, pair, upstream=False)),
        ):
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pump(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        pair: tuple[asyncio.StreamWriter, asyncio.StreamWriter],
        *,
        upstream: bool,
    ) -> None:
        sent_marker = False
        with contextlib.suppress(OSError, asyncio.CancelledError):
            while data := await reader.read(CHUNK):
                if self.blackhole:
                    continue  # swallowed: no reset, no reply
                if self.latency_s:
                    await asyncio.sleep(self.latency_s)
                writer.write(data)
                await writer.drain()
                marked_before = sent_marker
                if upstream and self.cut_only_after is not None and self.cut_only_after in data:
                    sent_marker = True
                marked = marked_before if self.cut_in_a_later_chunk else sent_marker
                if (
                    upstream
                    and self.cut_after is not None
                    and self.cut_after in data
                    and (marked or self.cut_only_after is None)
                ):
                    self.cut_after = None
                    self.cuts += 1
                    for w in pair:  # the reply to what was just sent never arrives
                        w.transport.abort()
                    return
        writer.close()

    def stop(self) -> None:
        async def shutdown() -> None:
            if self._server is not None:
                self._server.close()
            for w in list(self._writers):
                w.transport.abort()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()


@contextlib.contextmanager
def proxy_to(port: int, server_ssl: ssl.SSLContext | None = None) -> Iterator[Proxy]:
    proxy = Proxy(port, server_ssl)
    proxy.start()
    try:
        yield proxy
    finally:
        proxy.stop()
