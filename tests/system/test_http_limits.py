"""Idle, slow and greedy clients against the real ``switchboard receive`` and
``switchboard web`` (issue 43, ``ingest/processes/http_guard.py``), over
loopback: a connection that sends nothing, or trickles its head or a body,
is closed within its deadline; a valid delivery is answered 200 while
hundreds of idle sockets are open, under a file limit lower than systemd's
default; an address at its share is refused (429) while others are served;
the request bodies held at once are capped (503 before a body is read), and
with them the receiver's memory. Each fails on uvicorn's protocol alone.

Client addresses are drawn from 127.0.0.0/8 (every one is this host's), so
each stands for another client."""

from __future__ import annotations

import contextlib
import json
import resource
import select
import shutil
import socket
import sys
import time
import urllib.request
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from ingest.embedded.processes import STRICT_FLAGS, SwitchboardProcess, wait_for
from ingest.embedded.servers import free_port
from ingest.processes import http_guard
from tests.support.config import write_config
from tests.support.db import scalar
from tests.support.processes import Processes, assert_clean_exit, with_secret_db
from tests.support.trickle import connect
from tests.support.webhooks import STANDARD_SECRET, post, receiver_config, standard_headers, wait_listening

pytestmark = pytest.mark.system

HOOK = {"name": "billing", "transport": "webhook", "secrets_env": ["BILLING_WHSEC"], "queue": "billing"}
ENV = {"BILLING_WHSEC": STANDARD_SECRET}
SLACK_S = 5.0  # on top of a deadline, for a loaded machine
TRICKLE_EVERY_S = 1.0
MIB = 1024 * 1024


def _receiver(
    procs: Processes,
    tmp_path: Path,
    db_url: str,
    *,
    nofile: int | None = None,
    adapters: list[Mapping[str, Any]] | None = None,
    **receiver: Any,
) -> tuple[SwitchboardProcess, int]:
    """``switchboard receive``, under an open-file limit of ``nofile`` if given
    (``prlimit`` sets it, then execs the interpreter: the pid is the process's)."""
    config, port = receiver_config(
        tmp_path / "receive.toml", with_secret_db(db_url), adapters or [HOOK], **receiver
    )
    if nofile is None:
        proc = procs.start("receive", config, name="receiver", env=ENV)
    else:
        prlimit = shutil.which("prlimit")
        if prlimit is None:
            pytest.skip("prlimit (util-linux) is not installed")
        proc = SwitchboardProcess(
            "receive",
            config,
            tmp_path / "receiver-limited.0.log",
            env=ENV,
            command=[
                prlimit,
                f"--nofile={nofile}:{nofile}",
                "--",
                sys.executable,
                *STRICT_FLAGS,
                "-m",
                "ingest",
            ],
        )
        procs.all.append(proc)
    wait_listening(proc)
    return proc, port


def _signed(n: int, body: bytes | None = None) -> tuple[bytes, dict[str, str]]:
    body = json.dumps({"type": "invoice.paid", "invoice": n}).encode() if body is None else body
    return body, standard_headers(STANDARD_SECRET, f"msg_{n}", body)


def _head(path: str, length: int, headers: Mapping[str, str]) -> bytes:
    lines = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    return f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {length}\r\n{lines}\r\n".encode()


@contextlib.contextmanager
def _sockets() -> Iterator[list[socket.socket]]:
    """A list to put client sockets in, every one closed on exit."""
    held: list[socket.socket] = []
    try:
        yield held
    finally:
        for sock in held:
            sock.close()


def _was_cut(sock: socket.socket) -> bool:
    """The server closed or reset ``sock`` (without waiting; data is an
    answer, not a cut). No select(): descriptors here go past 1024."""
    sock.setblocking(False)  # else a timeout set on it makes recv wait for it
    try:
        return sock.recv(4096) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def _cut_times(
    socks: Mapping[str, socket.socket], trickling: Collection[str], timeout_s: float
) -> dict[str, float]:
    """Seconds until the server closed each of ``socks``, while each one in
    ``trickling`` sends one more byte every ``TRICKLE_EVERY_S``; those still
    open after ``timeout_s`` are missing."""
    start = time.monotonic()
    cut: dict[str, float] = {}
    next_byte = start
    while len(cut) < len(socks) and (now := time.monotonic()) < start + timeout_s:
        if now >= next_byte:
            for name in trickling:
                if name not in cut:
                    with contextlib.suppress(OSError):
                        socks[name].send(b"a")
            next_byte += TRICKLE_EVERY_S
        waiting = {sock.fileno(): name for name, sock in socks.items() if name not in cut}
        poll = select.poll()
        for fd in waiting:
            poll.register(fd, select.POLLIN)
        left_s = min(next_byte, start + timeout_s) - time.monotonic()
        for fd, _events in poll.poll(max(0.0, left_s) * 1000):
            if _was_cut(socks[waiting[fd]]):
                cut[waiting[fd]] = time.monotonic() - start
    return cut


def _until_closed(sock: socket.socket, timeout_s: float) -> bytes:
    """What the server sends until it closes (a reset ends it too)."""
    sock.settimeout(timeout_s)
    data = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            data += chunk
    return data


def _head_reply(sock: socket.socket, timeout_s: float = 10) -> bytes:
    sock.settimeout(timeout_s)
    data = b""
    while b"\r\n\r\n" not in data and (chunk := sock.recv(4096)):
        data += chunk
    return data


def _kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def _open_files_for(n: int) -> None:
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < n + 256:
        pytest.skip(f"this test opens {n} sockets: the open-file limit is {soft}")


def test_a_silent_or_trickling_connection_is_closed_within_the_head_deadline(
    procs: Processes, tmp_path: Path, db_url: str
) -> None:
    proc, port = _receiver(procs, tmp_path, db_url)
    with _sockets() as held:
        held += [connect(port), connect(port, "127.0.0.2")]
        held[1].sendall(b"POST /hooks/billing HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        cut = _cut_times(
            {"silent": held[0], "trickling": held[1]}, {"trickling"}, http_guard.HEAD_TIMEOUT_S + SLACK_S
        )
    assert set(cut) == {"silent", "trickling"}, f"still open after the head deadline: {cut}"
    assert post(port, "/healthz", b"", {}, method="GET").status == 200
    [shed, *_] = proc.events("http_shed")
    assert shed["head_timeout"] >= 1
    assert_clean_exit(proc, proc.stop())


def test_a_body_still_trickling_after_its_answer_is_closed_at_the_request_deadline(
    procs: Processes, tmp_path: Path, db_url: str
) -> None:
    """``/healthz`` answers without reading a body; uvicorn alone then reads
    the trickled rest forever, each byte cancelling its keep-alive timer."""
    respond_within_s = 2.0
    proc, port = _receiver(
        procs, tmp_path, db_url, respond_within_ms=int(respond_within_s * 1000), body_timeout_ms=1000
    )
    with _sockets() as held:
        held.append(connect(port))
        held[0].sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n")
        # Answered (503 while the first heartbeat is not yet in), the body unread.
        assert _head_reply(held[0]).startswith((b"HTTP/1.1 200 ", b"HTTP/1.1 503 "))
        bound_s = respond_within_s + http_guard.REQUEST_GRACE_S + SLACK_S
        cut = _cut_times({"body": held[0]}, {"body"}, bound_s)
    assert "body" in cut, f"a trickled body held its connection past {bound_s} s"
    assert_clean_exit(proc, proc.stop())


def test_a_delivery_is_answered_while_hundreds_of_idle_sockets_are_open_under_a_low_file_limit(
    procs: Processes, tmp_path: Path, db_url: str
) -> None:
    """More idle sockets than the receiver has descriptors for, under
    systemd's default limit (1024): uvicorn alone stops accepting (EMFILE,
    logged thousands of times a second) and the delivery is never answered.
    The guard caps connections below the limit and cuts the oldest idle one
    for each newcomer."""
    nofile, idle = 1024, 1200
    _open_files_for(idle)
    proc, port = _receiver(procs, tmp_path, db_url, nofile=nofile)
    [listening] = proc.events("receiver_listening")
    assert listening["max_connections"] == nofile - http_guard.FD_RESERVE
    with _sockets() as held:
        held += [connect(port, f"127.0.0.{10 + i % 6}") for i in range(idle)]
        body, headers = _signed(1)
        start = time.monotonic()
        delivered = post(port, "/hooks/billing", body, headers, timeout_s=8)
        took_s = time.monotonic() - start
        healthz = post(port, "/healthz", b"", {}, method="GET", timeout_s=8)
        still_open = sum(1 for sock in held if not _was_cut(sock))
    assert delivered.status == 200, delivered.body
    assert took_s < 8  # respond_within_ms
    assert healthz.status == 200
    assert still_open >= 200, f"only {still_open} idle sockets were open beside the delivery"
    assert scalar(db_url, "SELECT count(*) FROM inbox") == 1
    assert proc.events("accept_failed") == []  # below the file limit: no accept failed
    assert len(proc.events("http_shed")) <= 2  # one line per 10 s, with counts
    assert_clean_exit(proc, proc.stop())


def test_an_address_at_its_share_is_refused_while_another_is_served(
    procs: Processes, tmp_path: Path, db_url: str
) -> None:
    """Connections with a request in flight (a head in, a body not yet) are
    never cut: an address holding its share of them is refused (429)."""
    nofile = http_guard.FD_RESERVE + 64
    proc, port = _receiver(
        procs, tmp_path, db_url, nofile=nofile, respond_within_ms=30_000, body_timeout_ms=20_000
    )
    [listening] = proc.events("receiver_listening")
    share = listening["max_per_client"]
    assert share == 32
    # Healthy first (its first heartbeat answered): the check below is that
    # another address is served, and a 503 before that beat says nothing.
    wait_for(lambda: post(port, "/healthz", b"", {}, method="GET").status == 200, timeout_s=30,
             what="the receiver healthy")  # fmt: skip
    body, headers = _signed(2)
    with _sockets() as held:
        for _ in range(share):
            held.append(connect(port, "127.0.0.30"))
            held[-1].sendall(_head("/hooks/billing", len(body), headers))  # the body never comes
        # Answered after the heads above were read (they came first, from sockets accepted first).
        assert post(port, "/healthz", b"", {}, method="GET").status == 200
        held.append(connect(port, "127.0.0.30"))
        refused = _until_closed(held[-1], 10)
        assert refused.startswith(b"HTTP/1.1 429 "), refused
        assert b"\r\nretry-after: " in refused.lower()
        assert post(port, "/hooks/billing", body, headers).status == 200  # from 127.0.0.1
    assert_clean_exit(proc, proc.stop())


def test_request_bodies_held_at_once_are_capped_and_so_is_the_memory(
    procs: Processes, tmp_path: Path, db_url: str
) -> None:
    """250 unauthenticated bodies of 1 MiB, each a byte short: uvicorn alone
    holds them all (over 250 MB). The guard counts each declared length at
    its head and answers 503 once ``BODY_BYTES_IN_FLIGHT`` are held."""
    from ingest.processes.push.receiver import BODY_BYTES_IN_FLIGHT

    count = 250
    _open_files_for(count)
    proc, port = _receiver(procs, tmp_path, db_url)
    rss_before_kib = _kib(proc.pid, "VmRSS")
    body, headers = _signed(3, b"x" * MIB)
    request = _head("/hooks/billing", len(body), headers) + body[:-1]
    with _sockets() as held:
        for i in range(count):
            held.append(connect(port, f"127.0.0.{40 + i % 4}"))
            with contextlib.suppress(OSError):  # refused: the server closed as we sent
                held[-1].sendall(request)
        # The held ones are 408 at body_timeout_ms (5 s), the others were 503 at once.
        replies = [_until_closed(sock, 15) for sock in held]
    growth = (_kib(proc.pid, "VmHWM") - rss_before_kib) * 1024
    assert growth < BODY_BYTES_IN_FLIGHT + 64 * MIB, f"the receiver grew by {growth / MIB:.0f} MiB"
    assert sum(r.startswith(b"HTTP/1.1 408 ") for r in replies) <= BODY_BYTES_IN_FLIGHT // MIB
    assert sum(e.get("body_budget", 0) for e in proc.events("http_shed")) >= 1
    small, small_headers = _signed(4)
    assert post(port, "/hooks/billing", small, small_headers).status == 200  # all given back
    assert_clean_exit(proc, proc.stop())


def test_the_console_closes_idle_and_trickling_sockets_and_answers_beside_hundreds(
    procs: Processes, tmp_path: Path, db_url: str
) -> None:
    idle = 300
    _open_files_for(idle)
    config = write_config(
        tmp_path / "web.toml",
        database_url=with_secret_db(db_url),
        redis_url="redis://127.0.0.1:1/0",  # no pull adapter: never connected
        adapters=[HOOK],
    )
    port = free_port()
    proc = procs.start("web", config, name="web", args=["--listen", f"127.0.0.1:{port}"])
    wait_for(lambda: proc.events("web_listening") or not proc.alive(), timeout_s=30, what="the console")
    assert proc.alive(), proc.raw_log()[-3000:]
    with _sockets() as held:
        held += [connect(port), connect(port, "127.0.0.2")]
        held[1].sendall(b"POST /login HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        cut = _cut_times(
            {"silent": held[0], "trickling": held[1]}, {"trickling"}, http_guard.HEAD_TIMEOUT_S + SLACK_S
        )
        assert set(cut) == {"silent", "trickling"}, f"still open after the head deadline: {cut}"
        held += [connect(port, f"127.0.0.{50 + i % 6}") for i in range(idle)]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=8) as reply:
            assert reply.status == 200
    assert_clean_exit(proc, proc.stop())
