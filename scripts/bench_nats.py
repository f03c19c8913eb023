"""``make bench``'s NATS part (issue 26): Switchboard's ingest + ack from a
JetStream stream beside what a capable user writes with nats-py, and beside
Switchboard's own Redis stream figure, all in one run on the same servers.

Per round, the order rotated each round, each run in a fresh database:

1. raw: the database's limit for the same three rows per message
   (``bench_kit.bench_raw``, psycopg ``unnest``, 1000 messages a transaction).
2. switchboard nats: the real ``switchboard ingest`` and ``switchboard ack``
   processes with a ``transport = "nats"`` adapter on an embedded
   nats-server (``ingest.embedded.nats_server``: file storage, every write
   synced). N messages are published (each acknowledged by the server) to
   a stream once, before the rounds (the server syncs each write: a few
   thousand a second); each run reads them all through a durable pull
   consumer of its own (deliver all), created with the adapter's own
   settings before the processes start, as the Redis bench creates its
   group, and deleted after. The clock starts when the adapter is enabled and stops when the consumer has
   nothing unacked and nothing undelivered (``num_ack_pending`` and
   ``num_pending`` 0, polled every 10 ms) and every inbox row is marked
   acked (counted only once the server says so, to keep the polls off
   PostgreSQL while it works).
3. direct nats-py: this file run as ``--consume``, a process of its own: a
   durable pull consumer of its own (the same settings) fetched ``batch_size`` at a
   time; each batch stored in one transaction, one statement: the rows
   ``bench_kit.bench_naive`` stores per message (a todo, its event, the inbox
   row marked acked, linked), with ``unnest`` and binary parameters; then
   ``msg.ack()`` for each message. The clock starts when it is told to go,
   after its imports and connections, and stops as Switchboard's does.
4. switchboard redis: ``bench_kit.bench_switchboard``, the Redis stream pipeline
   of the rest of the bench.

Printed: each figure's median msg/s; Switchboard NATS / direct nats-py and
Switchboard NATS / Switchboard Redis as the median of the rounds' ratios
(targets: at least 0.8 each); CPU per message by process.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import nats
import psycopg
from nats.aio.client import Client
from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, StorageType
from nats.js.errors import NotFoundError

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import bench_kit  # noqa: E402

from backhalf.db import libpq_url  # noqa: E402
from ingest.embedded import config  # noqa: E402
from ingest.embedded.nats_server import NatsServer, nats_server  # noqa: E402
from ingest.embedded.processes import wait_for, wait_ready  # noqa: E402
from ingest.embedded.servers import PostgresServer  # noqa: E402

STREAM = "BENCH"
SUBJECT = f"{STREAM}.new"
# The adapter's defaults (docs/transports.md), written into its config and
# given to both consumers, so the pre-created one needs no update.
ACK_WAIT_MS = 60_000
MAX_ACK_PENDING = 20_000
PUBLISH_WINDOW = 1000  # publishes awaited at once while loading the stream
ROUNDS = 3
RUN_TIMEOUT_S = 600
# The nats-py consumer's environment: no password in its argv.
URL_ENV, DB_ENV = "BENCH_NATS_URL", "BENCH_DATABASE_URL"


def consumer_config(durable: str) -> ConsumerConfig:
    """What the adapter asks for (ingest.adapters.nats.jetstream._wanted)."""
    return ConsumerConfig(
        name=durable,
        durable_name=durable,
        ack_policy=AckPolicy.EXPLICIT,
        deliver_policy=DeliverPolicy.ALL,
        max_deliver=-1,
        ack_wait=ACK_WAIT_MS / 1000,
        max_ack_pending=MAX_ACK_PENDING,
    )


class Broker:
    """The bench's own connection to the nats-server, on one event loop kept
    for the run (nats-py is asyncio only; the bench drives processes)."""

    def __init__(self, url: str) -> None:
        self._runner = asyncio.Runner()
        self._client: Client = self._runner.run(nats.connect(url, allow_reconnect=False, connect_timeout=5))
        self._js = self._client.jetstream(timeout=10)

    def load(self, n: int) -> None:
        """A fresh stream of ``n`` messages (bench_kit.body), each acknowledged
        by the server. Loaded once: each run reads it through a consumer of
        its own (deliver all), as the stream keeps what is acked."""

        async def run() -> None:
            with contextlib.suppress(NotFoundError):
                await self._js.delete_stream(STREAM)
            await self._js.add_stream(name=STREAM, subjects=[f"{STREAM}.>"], storage=StorageType.FILE)
            for start in range(0, n, PUBLISH_WINDOW):
                stop = min(n, start + PUBLISH_WINDOW)
                await asyncio.gather(
                    *(self._js.publish(SUBJECT, bench_kit.body(i), timeout=60) for i in range(start, stop))
                )
            info = await self._js.stream_info(STREAM)
            if info.state.messages != n:
                raise SystemExit(f"bench: the stream holds {info.state.messages} messages, not {n}")

        self._runner.run(run())

    def add_consumer(self, durable: str) -> None:
        """A durable consumer with the adapter's settings, nothing delivered yet."""
        self._runner.run(self._js.add_consumer(STREAM, config=consumer_config(durable)))

    def delete_consumer(self, durable: str) -> None:
        self._runner.run(self._js.delete_consumer(STREAM, durable))

    def figures(self, durable: str) -> tuple[int, int]:
        """(unacked, undelivered) of the consumer."""

        async def run() -> tuple[int, int]:
            info = await self._js.consumer_info(STREAM, durable)
            return int(info.num_ack_pending or 0), int(info.num_pending or 0)

        return self._runner.run(run())

    def settled(self, durable: str) -> bool:
        return self.figures(durable) == (0, 0)

    def close(self) -> None:
        try:
            self._runner.run(self._client.close())
        finally:
            self._runner.close()


def drained(broker: Broker, durable: str, url: str, n: int) -> bool:
    """Nothing unacked or undelivered at the server, then every inbox row
    acked: PostgreSQL is asked only once the server says so."""
    return broker.settled(durable) and bench_kit.acked_count(url) == n


def nats_config(path: Path, db_url: str, nats_url: str, durable: str, batch_size: int) -> Path:
    """bench_kit.write_config's settings, with a NATS adapter in place of the stream's."""
    adapter = {"name": "bench", "transport": "nats", "mode": "jetstream", "source": STREAM, "group": durable,
               "queue": "bench", "url": nats_url, "batch_size": batch_size, "block_ms": 100,
               "ack_wait_ms": ACK_WAIT_MS, "max_ack_pending": MAX_ACK_PENDING,
               "max_message_bytes": bench_kit.MAX_MESSAGE_BYTES}  # fmt: skip
    return config.write_config(
        path,
        database_url=db_url,
        adapters=[adapter],
        # [ingest] settings from bench.py's command line (its --commits-in-flight).
        ingest={"enabled_refresh_ms": 50, **bench_kit.INGEST_OVERRIDES},
        acker={"batch_size": batch_size * 2, "poll_interval_ms": 100},
    )


def cpu_snapshot(pids: dict[str, int]) -> dict[str, float]:
    return {name: bench_kit.tree_cpu_seconds(pid) for name, pid in pids.items()}


def cpu_per_message(pids: dict[str, int], before: dict[str, float], n: int) -> dict[str, float]:
    return {name: (bench_kit.tree_cpu_seconds(pid) - before[name]) / n * 1e6 for name, pid in pids.items()}


def bench_switchboard_nats(
    workdir: Path, url: str, broker: Broker, nats_url: str, n: int, batch_size: int, servers: dict[str, int],
    run: str,
) -> tuple[float, dict[str, float]]:  # fmt: skip
    """The ingester and the acker draining the stream through a consumer of
    their own, named ``run``, created before they start (as the Redis bench
    creates its group)."""
    broker.add_consumer(run)
    config_path = nats_config(workdir / f"{run}.toml", url, nats_url, run, batch_size)
    acker = bench_kit.start("ack", config_path, workdir / f"{run}-acker.log")
    ingester = bench_kit.start("ingest", config_path, workdir / f"{run}-ingester.log")
    try:
        wait_ready(acker)
        wait_ready(ingester)
        pids = {"ingester": ingester.pid, "acker": acker.pid, **servers}
        before = cpu_snapshot(pids)
        started = time.perf_counter()
        bench_kit.set_enabled(url, True)
        wait_for(lambda: drained(broker, run, url, n), timeout_s=RUN_TIMEOUT_S,
                 what=f"{run}: every message acked", interval_s=bench_kit.POLL_S)  # fmt: skip
        elapsed = time.perf_counter() - started
        cpu = cpu_per_message(pids, before, n)
    finally:
        ingester.terminate()
        acker.terminate()
    broker.delete_consumer(run)
    return n / elapsed, cpu


def bench_direct(
    workdir: Path, url: str, broker: Broker, nats_url: str, n: int, batch_size: int, servers: dict[str, int],
    run: str,
) -> tuple[float, dict[str, float]]:  # fmt: skip
    """The nats-py consumer (this file, ``--consume``) draining the same
    pre-loaded stream through a consumer of its own, named ``run``; its
    clock as bench_kit.bench_peer's."""
    broker.add_consumer(run)
    argv = [sys.executable, str(Path(__file__).resolve()), "--consume", "--durable", run,
            "--batch-size", str(batch_size), "--expect", str(n)]  # fmt: skip
    env = {**os.environ, URL_ENV: nats_url, DB_ENV: libpq_url(url)}
    with (workdir / f"{run}.log").open("wb") as log:
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env)  # noqa: S603
        assert proc.stdin is not None
        assert proc.stdout is not None
        try:
            line = proc.stdout.readline()  # bounded: the process dies with an error, closing its stdout
            if line.strip() != b"ready":
                raise SystemExit(
                    f"bench: the nats-py consumer did not start (said {line!r}); log in {workdir}"
                )
            pids = {"consumer": proc.pid, **servers}
            before = cpu_snapshot(pids)
            started = time.perf_counter()
            proc.stdin.write(b"go\n")
            proc.stdin.flush()

            def done() -> bool:
                # Not reaped (WNOWAIT): its CPU is read from /proc after. It
                # exits 0 once it has acked the last message.
                ended = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
                if ended is not None and ended.si_status != 0:
                    raise SystemExit(f"bench: the nats-py consumer failed; log in {workdir / f'{run}.log'}")
                return drained(broker, run, url, n)

            wait_for(
                done, timeout_s=RUN_TIMEOUT_S, what=f"{run}: every message acked", interval_s=bench_kit.POLL_S
            )
            elapsed = time.perf_counter() - started
            cpu = cpu_per_message(pids, before, n)
        finally:
            bench_kit.finish_peer(proc)
    broker.delete_consumer(run)
    return n / elapsed, cpu


NAMES = ("raw", "switchboard nats", "direct nats-py", "switchboard redis")


def compare(
    base: Path,
    pg: PostgresServer,
    redis_pid: int,
    redis_run: Callable[[str, dict[str, int], str], tuple[float, dict[str, float]]],
    n: int,
    batch_size: int,
    rounds: int = ROUNDS,
) -> None:
    """The four runs, ``rounds`` times interleaved, the order rotated each
    round; prints medians and the medians of the rounds' ratios.
    ``redis_run(url, servers, run)``: bench_kit.bench_switchboard's msg/s and
    CPU per message for a fresh database ``url``."""
    with nats_server(base / "nats") as server:
        nats_proc: NatsServer = server
        broker = Broker(nats_proc.url)
        try:
            _compare(base, pg, redis_pid, nats_proc, broker, redis_run, n, batch_size, rounds)
        finally:
            broker.close()


def _compare(
    base: Path, pg: PostgresServer, redis_pid: int, server: NatsServer, broker: Broker,
    redis_run: Callable[[str, dict[str, int], str], tuple[float, dict[str, float]]],
    n: int, batch_size: int, rounds: int,
) -> None:  # fmt: skip
    nats_servers = {"postgres": pg.pid, "nats": server.pid}
    rates: dict[str, list[float]] = {name: [] for name in NAMES}
    cpus: dict[str, list[dict[str, float]]] = {name: [] for name in NAMES}
    print(f"  NATS (issue 26): {n:,} messages per run, batch {batch_size}, {rounds} rounds, order rotated")
    started = time.perf_counter()
    broker.load(n)
    loaded_s = time.perf_counter() - started
    print(f"    {n:,} messages published to JetStream in {loaded_s:.1f} s (every write synced)")
    for i in range(rounds):
        for name in NAMES[i % len(NAMES) :] + NAMES[: i % len(NAMES)]:
            db = f"nats{i}_{NAMES.index(name)}"
            url = bench_kit.fresh_db(pg, db)
            cpu: dict[str, float] = {}
            if name == "raw":
                rate = bench_kit.bench_raw(url, n)
            elif name == "switchboard nats":
                rate, cpu = bench_switchboard_nats(
                    base, url, broker, server.url, n, batch_size, nats_servers, db
                )
            elif name == "direct nats-py":
                rate, cpu = bench_direct(base, url, broker, server.url, n, batch_size, nats_servers, db)
            else:
                rate, cpu = redis_run(url, {"postgres": pg.pid, "redis": redis_pid}, db)
            # Dropped once measured: its autovacuum would be billed to the next run.
            pg.drop_database(db)
            rates[name].append(rate)
            cpus[name].append(cpu)
        print(
            f"    round {i + 1}: " + ", ".join(f"{name} {rates[name][-1]:,.0f}" for name in NAMES) + " msg/s"
        )

    def ratio(a: str, b: str) -> str:
        each = [x / y for x, y in zip(rates[a], rates[b], strict=True)]
        return f"{statistics.median(each):>10.2f}x  (rounds {min(each):.2f}-{max(each):.2f})"

    sb = "switchboard nats"
    for name in NAMES:
        print(f"  {name:<34}{statistics.median(rates[name]):>10,.0f} msg/s  (median of {rounds})")
    print(f"  {sb} / direct nats-py       {ratio(sb, 'direct nats-py')}  target >= 0.8")
    print(f"  {sb} / switchboard redis    {ratio(sb, 'switchboard redis')}  target >= 0.8")
    print(f"  {sb} / raw                  {ratio(sb, 'raw')}")
    for name in NAMES[1:]:
        medians = {k: statistics.median(c[k] for c in cpus[name]) for k in cpus[name][0]}
        print(f"    CPU per message, {name:<18} " + ", ".join(f"{k} {v:.1f} us" for k, v in medians.items()))


# --- the nats-py consumer (``--consume``) ---------------------------------------------------

# One statement a batch: bench_naive's three rows per message (todo, event,
# inbox row stored and marked acked, linked), for the whole batch at once.
DIRECT_SQL = """
WITH u AS (
    SELECT * FROM unnest(%(keys)b::text[], %(ids)b::text[], %(bodies)b::bytea[], %(payloads)b::text[],
                         %(replies)b::text[]) AS u(k, m, b, p, r)
), t AS (
    INSERT INTO todos (queue, idempotency_key, payload)
    SELECT 'bench', u.k, u.p::jsonb FROM u
    RETURNING id, idempotency_key
), ev AS (
    INSERT INTO events (family, adapter, trust_mode, verified, verify_detail, idempotency_key,
                        source_message_id, payload, todo_id)
    SELECT 'queue', 'bench', 'queue', false, 'nats user: switchboard', u.k, u.m, u.p::jsonb, t.id
    FROM u JOIN t ON t.idempotency_key = u.k
    RETURNING id, idempotency_key, todo_id
)
INSERT INTO inbox (adapter, idempotency_key, source_message_id, consumer, body, ack_kind, ack_key, ack_group,
                   ack_entry_id, ack_state, acked_at, status, todo_id, event_id)
SELECT 'bench', u.k, u.m, 'direct', u.b, 'jsack', %(stream)s, %(durable)s, u.r, 'acked', now(), 'stored',
       ev.todo_id, ev.id
FROM u JOIN ev ON ev.idempotency_key = u.k
"""


async def consume(durable: str, batch_size: int, expect: int, timeout_s: float) -> None:
    """Fetch, store, ack, until ``expect`` messages are stored and acked."""
    client = await nats.connect(os.environ[URL_ENV], allow_reconnect=False, connect_timeout=5)
    conn = await psycopg.AsyncConnection.connect(os.environ[DB_ENV])
    try:
        js = client.jetstream(timeout=10)
        sub = await js.pull_subscribe_bind(durable=durable, stream=STREAM)
        print("ready", flush=True)
        go = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        if go.strip() != "go":
            return
        deadline = time.monotonic() + timeout_s
        stored = 0
        while stored < expect:
            if time.monotonic() > deadline:
                raise SystemExit(f"bench_nats: {stored} of {expect} stored after {timeout_s}s")
            try:
                msgs = await sub.fetch(batch_size, timeout=0.1)
            except (TimeoutError, NatsTimeout):
                continue
            params: dict[str, Any] = {"keys": [], "ids": [], "bodies": [], "payloads": [], "replies": [],
                                      "stream": STREAM, "durable": durable}  # fmt: skip
            for msg in msgs:
                seq = str(msg.metadata.sequence.stream)
                params["keys"].append(f"nats:{STREAM}:{seq}")
                params["ids"].append(seq)
                params["bodies"].append(msg.data)
                params["payloads"].append(msg.data.decode())
                params["replies"].append(msg.reply)
            async with conn.transaction():
                await conn.execute(DIRECT_SQL, params)
            for msg in msgs:
                await msg.ack()
            stored += len(msgs)
        await client.flush(timeout=10)
    finally:
        await conn.close()
        await client.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--consume", action="store_true", help="be the nats-py consumer (run by the bench)")
    parser.add_argument("--durable", default="direct", help="the consumer, created by the bench")
    parser.add_argument("--batch-size", type=int, default=2000)
    parser.add_argument("--expect", type=int, required=True, help="messages to store, then exit")
    args = parser.parse_args(argv)
    if not args.consume:
        parser.error("run `scripts/bench.py --nats`; this file alone is the consumer it starts")
    asyncio.run(consume(args.durable, args.batch_size, args.expect, RUN_TIMEOUT_S))
    return 0


if __name__ == "__main__":
    sys.exit(main())
