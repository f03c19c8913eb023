"""Slow HTTP clients, for the tests of the ``[metrics]`` endpoint (issue 32):
connections that send a request head one byte at a time and never finish
it, reconnecting whenever the server cuts them, as a slowloris attacker
does."""

from __future__ import annotations

import select
import socket
import threading
import time
from collections.abc import Sequence
from types import TracebackType

# Never finished: the header's value goes on one byte at a time.
HEAD = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: "
CONNECT_TIMEOUT_S = 2.0
JOIN_TIMEOUT_S = 10.0


def connect(port: int, source: str = "127.0.0.1") -> socket.socket:
    """A connection to 127.0.0.1:``port`` from the loopback address ``source``
    (any of 127.0.0.0/8 is this host's, so each stands for another client)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((source, 0))
        sock.settimeout(CONNECT_TIMEOUT_S)
        sock.connect(("127.0.0.1", port))
    except OSError:
        sock.close()
        raise
    return sock


def was_cut(sock: socket.socket) -> bool:
    """The server closed or reset the connection (without waiting)."""
    readable, _, _ = select.select([sock], [], [], 0)
    if not readable:
        return False
    try:
        return sock.recv(4096, socket.MSG_DONTWAIT) == b""  # data instead: an answer, not a cut
    except BlockingIOError:
        return False
    except OSError:
        return True


def wait_cut(sock: socket.socket, timeout_s: float) -> float | None:
    """Seconds until the server cuts ``sock`` (reading only), or None if it
    has not after ``timeout_s``."""
    start = time.monotonic()
    while (left := start + timeout_s - time.monotonic()) > 0:
        readable, _, _ = select.select([sock], [], [], min(left, 0.05))
        if readable and was_cut(sock):
            return time.monotonic() - start
    return None


class Tricklers:
    """``count`` connections, one from each of ``sources`` in turn, each
    sending one more byte of a request head every ``interval_s`` and never
    its end; a connection the server cut is replaced at once. ``cuts``
    counts the connections the server cut. Used as a context manager: its
    thread stops and every socket is closed on exit."""

    def __init__(
        self, port: int, count: int, *, sources: Sequence[str] = ("127.0.0.1",), interval_s: float = 0.5
    ) -> None:
        self.port, self.interval_s = port, interval_s
        self.sources = [sources[i % len(sources)] for i in range(count)]
        self.cuts = 0
        self.connected = 0  # connections made in all
        self._socks: list[socket.socket | None] = [None] * count
        self._sent = [0] * count
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tricklers", daemon=True)
        self._error: BaseException | None = None

    def __enter__(self) -> Tricklers:
        self._connect_missing()
        self._thread.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(JOIN_TIMEOUT_S)
        if self._thread.is_alive():
            raise RuntimeError(f"the tricklers' thread did not stop within {JOIN_TIMEOUT_S}s")
        for sock in self._socks:
            if sock is not None:
                sock.close()
        if self._error is not None:
            raise RuntimeError("the tricklers failed") from self._error

    def _connect_missing(self) -> None:
        for i, sock in enumerate(self._socks):
            if sock is None:
                try:
                    self._socks[i] = connect(self.port, self.sources[i])
                except OSError:
                    continue  # refused, or the server gone: tried again next turn
                self._sent[i] = 0
                self.connected += 1

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.interval_s):
                for i, sock in enumerate(self._socks):
                    if sock is None:
                        continue
                    if was_cut(sock) or not self._send_one(i, sock):
                        sock.close()
                        self._socks[i] = None
                        self.cuts += 1
                self._connect_missing()
        except BaseException as exc:  # raised again by stop(), in the test's thread
            self._error = exc

    def _send_one(self, i: int, sock: socket.socket) -> bool:
        byte = HEAD[self._sent[i] : self._sent[i] + 1] or b"a"
        try:
            sock.send(byte)
        except OSError:
            return False
        self._sent[i] += 1
        return True

    def open_now(self) -> int:
        """Connections open and not seen cut, now (a snapshot)."""
        return sum(1 for s in list(self._socks) if s is not None)
