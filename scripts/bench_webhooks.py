"""``make bench``'s webhook part (issue 30): ``switchboard receive`` beside
the same HTTP stack answering 200 without storing, in one run on the same
machine.

1. generator ceiling: the load generator against a server that answers a
   fixed 200 from a bare asyncio protocol (no HTTP parsing to speak of), so
   its figure is what the generator itself can send on this machine; the
   no-store server's figure must stay well below it, or the generator is
   the limit.
2. no-store: a Starlette app on uvicorn with the receiver's settings
   (``lifespan`` off, no access log, no server header, keep-alive 5 s, a
   socket bound before it serves), its one route ``POST /hooks/{adapter}``
   reading the body and answering ``{"status": "stored"}``: the HTTP stack's
   own limit. A process of its own (this file, ``--peer``).
3. receive: the real ``switchboard receive`` with one ``standard-webhooks``
   adapter (its secret from an environment variable) on an embedded
   PostgreSQL: each delivery verified, normalized and committed (inbox row,
   event, todo; group commit) before its 200.

2 and 3 run ``rounds`` times interleaved, the order rotated, each a closed
loop of ``CONNECTIONS`` keep-alive connections (one request at a time on
each) for a warm-up then a measured window: deliveries/s over the window,
p50/p99 from writing the request to reading the whole 200. Then the receiver,
and the no-store server for reference, at a fixed offered rate (open loop,
paced from a schedule; a delivery's latency counts from its scheduled time,
so a generator that falls behind, or runs out of free connections, counts
against the server, never for it), with the count of answers other than
200. Last, PostgreSQL is asked whether it holds one todo for each distinct
delivery the receiver was sent.

The load generator is this file run as ``--load``: a process of its own, one
asyncio loop on raw streams, every request (a distinct ``webhook-id``,
signed with HMAC-SHA256 as Standard Webhooks says, one checked against the
reference ``standardwebhooks`` library) built as bytes before its clock
starts, its garbage collector off while timing. Everything shares the
machine's cores: generator, server and PostgreSQL; CPU per delivery is
printed by process, with what else the machine ran meanwhile (other
processes, and the hypervisor's steal): a run beside other work measures
that work too.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import gc
import hashlib
import hmac
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import bench_kit  # noqa: E402

from backhalf.db import libpq_url  # noqa: E402
from backhalf.housekeeping import migrate  # noqa: E402
from ingest.children import die_with_parent, reap  # noqa: E402
from ingest.embedded import config  # noqa: E402
from ingest.embedded.processes import SwitchboardProcess, wait_for  # noqa: E402
from ingest.embedded.servers import PostgresServer, free_port  # noqa: E402

ADAPTER = "bench"
PATH = f"/hooks/{ADAPTER}"
SECRET_ENV = "BENCH_WHSEC"  # noqa: S105 - a variable's name; the receiver's secret, and the generator's
SECRET = "whsec_" + base64.b64encode(b"switchboard-bench-webhook-key-01").decode()
CONNECTIONS = 32  # the closed loop's keep-alive connections
OPEN_CONNECTIONS = 64  # the open loop's pool: in flight at once at most
RATE = 500  # the open loop's offered deliveries/s
P99_TARGET_MS = 50.0
RATIO_TARGET = 0.5
ROUNDS = 2
START_TIMEOUT_S = 30
RUN_TIMEOUT_S = 120


# --- the parent: servers, generator runs, figures --------------------------------------------


@dataclass(frozen=True)
class Run:
    """One generator run's report, and the CPU it cost by process."""

    figures: dict[str, Any]
    cpu_us: dict[str, float]  # CPU per delivery sent, by process
    others: float  # cores busy on the machine with anything else (another process's work skews the run)
    stolen: float  # cores the hypervisor gave to someone else (steal time): a slower machine that hour

    @property
    def rate(self) -> float:
        return float(self.figures["rate"])


class Child:
    """A helper process of this file (``--peer``, ``--canned``, ``--load``):
    it says a first line on stdout (``ready`` or ``listening PORT``) once
    set up; it is stopped by its pid."""

    def __init__(self, argv: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self._log = log.open("ab")
        self.proc = subprocess.Popen(  # noqa: S603 - this interpreter, this file
            [sys.executable, str(Path(__file__).resolve()), *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env={**os.environ, **(env or {})},
            **die_with_parent(),
        )
        self.log_path = log

    @property
    def pid(self) -> int:
        return self.proc.pid

    def first_line(self) -> str:
        assert self.proc.stdout is not None
        line: str = self.proc.stdout.readline().decode().strip()  # bounded: it says it or dies (EOF)
        if not line:
            self.stop()
            raise SystemExit(
                f"bench: {self.log_path.name} did not start:\n{self.log_path.read_text()[-2000:]}"
            )
        return line

    def say(self, word: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(word.encode() + b"\n")
        self.proc.stdin.flush()

    def result(self) -> dict[str, Any]:
        """The generator's report (its last line), once it has exited."""
        assert self.proc.stdout is not None
        out = self.proc.stdout.read()
        code = self.proc.wait(timeout=RUN_TIMEOUT_S)
        self._log.close()
        if code != 0:
            raise SystemExit(
                f"bench: the load generator failed ({code}):\n{self.log_path.read_text()[-2000:]}"
            )
        return dict(json.loads(out.decode().strip().splitlines()[-1]))

    def stop(self) -> None:
        """SIGTERM by pid, SIGKILL if it has not gone in 10 s."""
        if self.proc.poll() is None:
            self.proc.terminate()
            reap(self.proc, 10)
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                with contextlib.suppress(OSError):
                    f.close()
        self._log.close()


def server_child(kind: str, workdir: Path) -> tuple[Child, int]:
    child = Child([f"--{kind}"], workdir / f"webhooks-{kind}.log")
    word, _, port = child.first_line().partition(" ")
    if word != "listening":
        child.stop()
        raise SystemExit(f"bench: the {kind} server said {word!r}")
    return child, int(port)


def generate(workdir: Path, name: str, port: int, pids: dict[str, int], load_args: list[str]) -> Run:
    """One run of the load generator against ``port``: started, set up (its
    requests built, its connections open), then told to go; CPU of ``pids``
    and its own counted from go to its exit."""
    gen = Child(
        ["--load", "--port", str(port), *load_args], workdir / f"webhooks-load-{name}.log",
        env={SECRET_ENV: SECRET},
    )  # fmt: skip
    try:
        if (said := gen.first_line()) != "ready":
            raise SystemExit(f"bench: the load generator said {said!r}")
        every = {**pids, "generator": gen.pid}
        before = {k: bench_kit.tree_cpu_seconds(p) for k, p in every.items()}
        (busy_before, stolen_before), began = machine_cpu_s(), time.perf_counter()
        gen.say("go")
        # Its CPU read before it is reaped: a zombie's /proc/stat still holds it.
        wait_for(lambda: _exited(gen.pid), timeout_s=RUN_TIMEOUT_S, what=f"the load generator ({name})",
                 interval_s=bench_kit.POLL_S)  # fmt: skip
        after = {k: bench_kit.tree_cpu_seconds(p) for k, p in every.items()}
        (busy, stolen), elapsed = machine_cpu_s(), time.perf_counter() - began
        figures = gen.result()
    finally:
        gen.stop()
    sent = max(1, int(figures["sent"]))
    ours = sum(after[k] - before[k] for k in every)
    return Run(
        figures,
        {k: (after[k] - before[k]) / sent * 1e6 for k in every},
        others=max(0.0, busy - busy_before - ours) / elapsed,
        stolen=(stolen - stolen_before) / elapsed,
    )


def machine_cpu_s() -> tuple[float, float]:
    """CPU seconds the whole machine has spent busy (user, nice, system, irq,
    softirq) and stolen by the hypervisor, from /proc/stat."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    return sum(int(fields[i]) for i in (0, 1, 2, 5, 6)) / bench_kit.CLK_TCK, int(
        fields[7]
    ) / bench_kit.CLK_TCK


def _exited(pid: int) -> bool:
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def receiver_db(pg: PostgresServer, name: str) -> str:
    url = pg.create_database(name)
    migrate.upgrade(url)
    import psycopg

    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        conn.execute("CHECKPOINT")
    return url


def start_receiver(workdir: Path, url: str) -> tuple[SwitchboardProcess, int]:
    port = free_port()
    adapter = {"name": ADAPTER, "transport": "webhook", "mode": "standard-webhooks", "source": ADAPTER,
               "queue": ADAPTER, "secrets_env": [SECRET_ENV]}  # fmt: skip
    path = config.write_config(
        workdir / "webhooks-receive.toml",
        database_url=url,
        adapters=[adapter],
        receiver={"listen": f"127.0.0.1:{port}"},
    )
    proc = bench_kit.start("receive", path, workdir / "webhooks-receive.log", env={SECRET_ENV: SECRET})
    wait_for(lambda: proc.events("receiver_listening") or not proc.alive(), timeout_s=START_TIMEOUT_S,
             what="receiver_listening")  # fmt: skip
    if not proc.alive():
        raise SystemExit(f"bench: switchboard receive exited:\n{proc.raw_log()[-2000:]}")
    return proc, port


def stored(url: str, prefix: str | None = None) -> tuple[int, int]:
    """(todos, inbox rows not 'stored'), of deliveries whose id starts ``prefix``."""
    import psycopg

    like = f"webhook:{ADAPTER}:{prefix or ''}%"
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        todos = conn.execute("SELECT count(*) FROM todos WHERE idempotency_key LIKE %s", (like,)).fetchone()
        bad = conn.execute(
            "SELECT count(*) FROM inbox WHERE idempotency_key LIKE %s AND status <> 'stored'", (like,)
        ).fetchone()
    assert todos is not None
    assert bad is not None
    return int(todos[0]), int(bad[0])


def _latency(figures: dict[str, Any]) -> str:
    return f"p50 {figures['p50_ms']:6.1f} ms  p99 {figures['p99_ms']:6.1f} ms"


def _cpu(cpu_us: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.0f} us" for k, v in cpu_us.items())


def _not_200(figures: dict[str, Any]) -> int:
    return sum(int(v) for k, v in figures["statuses"].items() if k != "200") + int(figures["errors"])


def compare(base: Path, pg: PostgresServer, *, quick: bool = False, rounds: int = ROUNDS) -> None:
    """The figures above, printed; every process it starts stopped by its pid."""
    window_s, warmup_s = (3.0, 0.5) if quick else (5.0, 1.0)
    open_s = 5.0 if quick else 10.0
    rounds = 1 if quick else rounds
    print(
        f"  webhooks (issue 30): {CONNECTIONS} keep-alive connections, {rounds} round(s) of {warmup_s:g} s"
        f" warm-up + {window_s:g} s, the order rotated; then {RATE}/s offered for {open_s:g} s."
        f" {os.cpu_count()} CPUs, shared by the generator, the server and PostgreSQL"
    )
    url = receiver_db(pg, "webhooks")
    started: list[Child] = []
    receiver: SwitchboardProcess | None = None
    try:
        receiver, receive_port = start_receiver(base, url)
        peer, peer_port = server_child("peer", base)
        started.append(peer)
        canned, canned_port = server_child("canned", base)
        started.append(canned)
        targets = {
            "no-store": (peer_port, {"server": peer.pid}),
            "receive": (receive_port, {"receiver": receiver.pid, "postgres": pg.pid}),
        }
        closed = ["--connections", str(CONNECTIONS), "--seconds", str(window_s), "--warmup", str(warmup_s)]

        ceiling = generate(base, "canned", canned_port, {"server": canned.pid}, [*closed, "--cycle"])
        canned.stop()
        started.remove(canned)
        print(
            f"    generator ceiling (canned 200)  {ceiling.rate:>10,.0f} req/s  {_latency(ceiling.figures)}"
            f"  (generator {ceiling.cpu_us['generator']:.0f} us a request)"
        )

        runs: dict[str, list[Run]] = {name: [] for name in targets}
        sent_to_receiver = 0
        names = list(targets)
        for i in range(rounds):
            for name in names[i % 2 :] + names[: i % 2]:
                port, pids = targets[name]
                run = generate(base, f"{name}-{i}", port, pids, [*closed, "--prefix", f"r{i}-{name}-"])
                runs[name].append(run)
                if name == "receive":
                    sent_to_receiver += int(run.figures["sent"])
                if _not_200(run.figures):
                    f = run.figures
                    print(f"    {name}, round {i + 1}: {f['statuses']}, {f['errors']} errors")
            rates = ", ".join(f"{n} {runs[n][-1].rate:,.0f}" for n in names)
            print(f"    round {i + 1}: {rates} deliveries/s")

        labels = {"no-store": "no-store Starlette/uvicorn", "receive": "switchboard receive"}
        for name in names:
            rate = statistics.median(r.rate for r in runs[name])
            p50 = statistics.median(r.figures["p50_ms"] for r in runs[name])
            p99 = statistics.median(r.figures["p99_ms"] for r in runs[name])
            print(
                f"  {labels[name]:<32}{rate:>10,.0f} deliveries/s  p50 {p50:6.1f} ms  p99 {p99:6.1f} ms"
                f"  (median of {rounds})"
            )
        each = [r.rate / p.rate for r, p in zip(runs["receive"], runs["no-store"], strict=True)]
        print(
            f"  receive / no-store              {statistics.median(each):>10.2f}x"
            f"  (rounds {min(each):.2f}-{max(each):.2f})  target >= {RATIO_TARGET}"
        )
        peer_rate = statistics.median(r.rate for r in runs["no-store"])
        print(
            f"  no-store / generator ceiling    {peer_rate / ceiling.rate:>10.2f}x"
            "  (far below 1: the generator is not the limit)"
        )
        for name in names:
            cpu = {k: statistics.median(r.cpu_us[k] for r in runs[name]) for k in runs[name][0].cpu_us}
            others, stolen = max(r.others for r in runs[name]), max(r.stolen for r in runs[name])
            print(
                f"    CPU per delivery, {name:<9} {_cpu(cpu)};"
                f" anything else on the machine {others:.2f} cores, stolen {stolen:.2f}"
            )

        # The open loop: the receiver at RATE, then the no-store server at
        # RATE for reference (what the HTTP stack and the machine add).
        open_args = ["--connections", str(OPEN_CONNECTIONS), "--rate", str(RATE), "--seconds", str(open_s)]
        paced = {
            name: generate(base, f"open-{name}", targets[name][0], targets[name][1],
                           [*open_args, "--prefix", f"open-{name}-"])
            for name in ("receive", "no-store")
        }  # fmt: skip
        peer.stop()
        started.remove(peer)
        sent_to_receiver += int(paced["receive"].figures["sent"])
        for name in ("receive", "no-store"):
            f = paced[name].figures
            target = f"  target p99 < {P99_TARGET_MS:g} ms" if name == "receive" else ""
            print(
                f"  {name} at {RATE}/s offered{'':<{13 - len(name)}}{_latency(f)}  max {f['max_ms']:6.1f} ms"
                f"  (n={f['sent']:,}){target}"
            )
            print(
                f"    {f['rate']:,.0f} deliveries/s; the generator behind schedule at most"
                f" {f['lag_max_ms']:.1f} ms;"
                f" CPU per delivery {_cpu(paced[name].cpu_us)};"
                f" anything else {paced[name].others:.2f} cores, stolen {paced[name].stolen:.2f}"
            )
        f = paced["receive"].figures
        wrong = _not_200(f)
        detail = f": {f['statuses']}, {f['errors']} connection errors" if wrong else ""
        print(f"  answers other than 200 at {RATE}/s  {wrong:>8}  (must be 0){detail}")

        todos, rejected = stored(url)
        lost = sent_to_receiver - todos
        verdict = "nothing lost" if lost == 0 and rejected == 0 else f"{lost} missing, {rejected} not stored"
        print(
            f"  todos in PostgreSQL / deliveries sent to receive  {todos:,} / {sent_to_receiver:,}: {verdict}"
        )
    finally:
        for child in started:
            child.stop()
        if receiver is not None:
            receiver.stop()
        pg.drop_database("webhooks")


# --- the servers: no-store (``--peer``) and canned (``--canned``) ----------------------------


def _bound() -> socket.socket:
    """A socket bound as the receiver binds its own (getaddrinfo's, so its
    proto is IPPROTO_TCP): asyncio sets TCP_NODELAY only on connections of
    such a socket. One made with ``socket.socket(AF_INET, SOCK_STREAM)``
    (proto 0) leaves Nagle on, and uvicorn's two writes a response (head,
    then body) wait for the client's delayed ACK: 44 ms a request."""
    from ingest.processes.http_server import bind

    return bind("127.0.0.1:0", "--listen")


def serve_peer() -> None:
    """The receiver's Starlette app on the receiver's uvicorn settings
    (ingest.processes.push.receiver), storing nothing."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    async def hook(request: Request) -> Response:
        await request.body()
        return JSONResponse({"status": "stored"})

    app = Starlette(routes=[Route("/hooks/{adapter}", hook, methods=["POST"])])
    settings = uvicorn.Config(
        app, lifespan="off", log_config=None, access_log=False, server_header=False, timeout_keep_alive=5
    )
    sock = _bound()
    print(f"listening {sock.getsockname()[1]}", flush=True)
    asyncio.run(uvicorn.Server(settings).serve(sockets=[sock]))  # SIGTERM: uvicorn's graceful exit


CANNED = b'HTTP/1.1 200 OK\r\ncontent-length: 19\r\ncontent-type: application/json\r\n\r\n{"status":"stored"}'


class _Canned(asyncio.Protocol):
    """One fixed 200 per request: counts requests by their blank line and
    skips bodies by Content-Length, the least a server can do."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._t: Any = transport
        self._buf = b""

    def data_received(self, data: bytes) -> None:
        buf = self._buf + data
        answers = 0
        while True:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                break
            length = 0
            for line in buf[:end].split(b"\r\n"):
                if line[:15].lower() == b"content-length:":
                    length = int(line[15:])
            if len(buf) < end + 4 + length:
                break
            buf = buf[end + 4 + length :]
            answers += 1
        self._buf = buf
        if answers:
            self._t.write(CANNED * answers)


def serve_canned() -> None:
    import signal

    async def main() -> None:
        loop = asyncio.get_running_loop()
        sock = _bound()
        server = await loop.create_server(_Canned, sock=sock)
        stop = asyncio.Event()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        print(f"listening {sock.getsockname()[1]}", flush=True)
        async with server:
            await stop.wait()

    asyncio.run(main())


# --- the load generator (``--load``) ----------------------------------------------------------


def signed_requests(port: int, prefix: str, count: int) -> Iterator[bytes]:
    """``count`` whole HTTP requests, each a distinct delivery signed as
    Standard Webhooks says: base64 HMAC-SHA256 of ``id.timestamp.body``
    under the secret's decoded bytes."""
    key = base64.b64decode(os.environ[SECRET_ENV].removeprefix("whsec_"))
    stamp = str(int(time.time()))
    head = f"POST {PATH} HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\ncontent-type: application/json\r\n"
    for i in range(count):
        msg_id = f"msg_{prefix}{i}"
        body = json.dumps(
            {"type": "order.created", "timestamp": stamp,
             "data": {"order_id": i, "sku": f"SKU-{i % 97}", "qty": 1 + i % 7, "note": "bench"}},
            separators=(",", ":"),
        ).encode()  # fmt: skip
        sig = base64.b64encode(
            hmac.digest(key, f"{msg_id}.{stamp}.".encode() + body, hashlib.sha256)
        ).decode()
        yield (
            f"{head}content-length: {len(body)}\r\nwebhook-id: {msg_id}\r\nwebhook-timestamp: {stamp}\r\n"
            f"webhook-signature: v1,{sig}\r\n\r\n"
        ).encode() + body


def _check_against_reference(request: bytes) -> None:
    """The first request's signature, as the reference library verifies it."""
    from standardwebhooks.webhooks import Webhook

    head, _, body = request.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")[1:]
    headers = dict(line.split(": ", 1) for line in lines)
    Webhook(os.environ[SECRET_ENV]).verify(body, headers)  # raises if it does not match


class Conn:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, port: int) -> Conn:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return cls(reader, writer)

    async def exchange(self, request: bytes) -> tuple[int, bool]:
        """(status, the server closes the connection)."""
        self.writer.write(request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        lower = head.lower()
        at = lower.find(b"content-length:")
        if at >= 0:
            length = int(lower[at + 15 : lower.find(b"\r\n", at)])
            if length:
                await self.reader.readexactly(length)
        return status, b"connection: close" in lower

    def close(self) -> None:
        self.writer.close()


class Tally:
    def __init__(self) -> None:
        self.statuses: dict[str, int] = {}
        self.errors = 0
        self.reconnects = 0
        self.latencies: list[float] = []
        self.sent = 0

    def answer(self, status: int) -> None:
        key = str(status)
        self.statuses[key] = self.statuses.get(key, 0) + 1


async def _exchange(conn: Conn, port: int, request: bytes, tally: Tally) -> Conn:
    """One request on ``conn`` (reopened if the server closed it); the
    connection to use next."""
    try:
        status, closing = await conn.exchange(request)
    except (OSError, asyncio.IncompleteReadError, ValueError):
        tally.errors += 1
        conn.close()
        tally.reconnects += 1
        return await Conn.open(port)
    tally.answer(status)
    if closing:
        conn.close()
        tally.reconnects += 1
        return await Conn.open(port)
    return conn


async def closed_loop(
    port: int, requests: list[bytes], connections: int, warmup_s: float, seconds: float, cycle: bool
) -> dict[str, Any]:
    conns = [await Conn.open(port) for _ in range(connections)]
    print("ready", flush=True)
    await _go()
    tally = Tally()
    began = time.perf_counter()
    window_from, window_to = began + warmup_s, began + warmup_s + seconds
    in_window = 0
    next_i = 0

    async def worker(conn: Conn) -> Conn:
        nonlocal next_i, in_window
        while True:
            t0 = time.perf_counter()
            if t0 >= window_to or (next_i >= len(requests) and not cycle):
                return conn
            request = requests[next_i % len(requests)]
            next_i += 1
            tally.sent += 1
            conn = await _exchange(conn, port, request, tally)
            t1 = time.perf_counter()
            if t0 >= window_from and t1 <= window_to:
                in_window += 1
                tally.latencies.append(t1 - t0)

    conns = await asyncio.gather(*(worker(c) for c in conns))
    ended = min(time.perf_counter(), window_to)
    for conn in conns:
        conn.close()
    if not cycle and next_i >= len(requests):
        print(f"bench_webhooks: ran out of the {len(requests)} requests built", file=sys.stderr)
    return _report(tally, rate=in_window / max(ended - window_from, 1e-9))


async def open_loop(port: int, requests: list[bytes], connections: int, rate: float) -> dict[str, Any]:
    """``len(requests)`` deliveries at ``rate``, each sent at its scheduled
    time on a free connection (waiting for one if all are busy); latency
    from the scheduled time."""
    idle: asyncio.Queue[Conn] = asyncio.Queue()
    for _ in range(connections):
        idle.put_nowait(await Conn.open(port))
    print("ready", flush=True)
    await _go()
    tally = Tally()
    lag_max, lag_at = 0.0, 0

    async def one(request: bytes, due: float) -> None:
        conn = await idle.get()
        conn = await _exchange(conn, port, request, tally)
        tally.latencies.append(time.perf_counter() - due)
        idle.put_nowait(conn)

    tasks = []
    began = time.perf_counter() + 0.01
    for i, request in enumerate(requests):
        due = began + i / rate
        if (wait := due - time.perf_counter()) > 0:
            await asyncio.sleep(wait)
        lag = time.perf_counter() - due
        if lag > lag_max:
            lag_max, lag_at = lag, i
        tally.sent += 1
        tasks.append(asyncio.create_task(one(request, due)))
    await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - began
    while not idle.empty():
        idle.get_nowait().close()
    return {**_report(tally, rate=len(requests) / elapsed), "lag_max_ms": lag_max * 1000, "lag_at": lag_at}


async def _go() -> None:
    go = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    if go.strip() != "go":
        raise SystemExit(0)


def _report(tally: Tally, rate: float) -> dict[str, Any]:
    lat = sorted(tally.latencies) or [float("nan")]

    def pct(p: float) -> float:
        return lat[min(len(lat) - 1, round(p / 100 * (len(lat) - 1)))] * 1000

    return {"sent": tally.sent, "statuses": tally.statuses, "errors": tally.errors,
            "reconnects": tally.reconnects, "rate": rate, "measured": len(tally.latencies),
            "p50_ms": pct(50), "p99_ms": pct(99), "max_ms": lat[-1] * 1000}  # fmt: skip


def load(args: argparse.Namespace) -> None:
    if args.rate:
        count = int(args.rate * args.seconds)
    elif args.cycle:
        count = 10_000
    else:
        # Enough for a closed loop far faster than this machine's HTTP stack
        # (the no-store server); the generator says so if it runs out.
        count = int(args.max_rate * (args.seconds + args.warmup))
    requests = list(signed_requests(args.port, args.prefix, count))
    _check_against_reference(requests[0])
    # No collection while timing: a full one over what the imports and the
    # requests left stopped the open loop for 63 ms at its 1,108th send.
    gc.collect()
    gc.freeze()
    gc.disable()
    if args.rate:
        figures = asyncio.run(open_loop(args.port, requests, args.connections, args.rate))
    else:
        figures = asyncio.run(
            closed_loop(args.port, requests, args.connections, args.warmup, args.seconds, args.cycle)
        )
    print(json.dumps(figures), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--peer", action="store_true", help="be the no-store server (run by the bench)")
    mode.add_argument("--canned", action="store_true", help="be the canned-answer server (run by the bench)")
    mode.add_argument("--load", action="store_true", help="be the load generator (run by the bench)")
    parser.add_argument("--port", type=int)
    parser.add_argument("--connections", type=int, default=CONNECTIONS)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--rate", type=float, help="open loop at this many deliveries/s")
    parser.add_argument(
        "--max-rate", type=float, default=8000, help="closed loop: requests built, per second"
    )
    parser.add_argument("--prefix", default="")
    parser.add_argument("--cycle", action="store_true", help="reuse the requests (the canned server only)")
    args = parser.parse_args(argv)
    if args.peer:
        serve_peer()
    elif args.canned:
        serve_canned()
    elif args.load:
        load(args)
    else:  # the part itself is bench.py's: it starts this file for each role
        parser.error("run `scripts/bench.py --webhooks` (make bench BENCH_ARGS=--webhooks)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
