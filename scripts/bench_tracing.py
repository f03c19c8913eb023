"""Traces (issue 47): what tracing costs, off (the default) and on with every
message sampled, in one run on one server, rounds interleaved so noise
cancels in the ratios.

1. start-up: a process's imports and its ``tracing.switch_on``, timed in a
   fresh interpreter each: without the ``[otel]`` extra (its modules
   hidden), with it installed and tracing off, and with tracing on;
2. ingest + ack of a pre-loaded stream whose every entry carries a
   ``traceparent`` (sampled), tracing off against on;
3. end to end: the same entries to todos done by the no-op handler
   (ingester, acker and two worker processes), off against on.

Tracing on exports by OTLP/HTTP to the dev kit's collector
(``ingest.embedded.otlp_collector``) in this process, counting the exports
without decoding them: a collector runs elsewhere, not on the two cores it
would take from the pipeline (the tests decode every span). Targets (issue 47): off unchanged beyond noise
(it is the default every other part measures), on at least 0.8x of off for
ingest and for end to end. ``python scripts/bench_tracing.py``; ``make
bench`` runs it (``--tracing`` alone).
"""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psycopg
import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import bench_kit  # noqa: E402

from backhalf.db import libpq_url  # noqa: E402
from ingest.embedded.otlp_collector import Collector  # noqa: E402
from ingest.embedded.processes import SwitchboardProcess, wait_for, wait_ready  # noqa: E402
from ingest.embedded.servers import PostgresServer, embedded_servers  # noqa: E402

ROUNDS = 5  # a shared machine: three rounds swung 0.57-0.80 around one median
STARTUP_RUNS = 7
TARGET = 0.8
# Per second; CPU us per message by process; PostgreSQL's background work
# during the run (bench_kit.background_work).
Measured = tuple[float, dict[str, float], dict[str, int]]

# A process's start: the modules the ingester, the receiver and the worker
# import, then tracing switched on (or not) as each process does.
STARTUP_CODE = """
import sys, time
started = time.perf_counter()
if {hide!r}:
    sys.modules["opentelemetry"] = None  # the extra not installed
import ingest.processes.pull.ingester, ingest.processes.push.receiver, ingest.processes.workers.worker
from backhalf import tracing
tracing.switch_on("ingest")
print(time.perf_counter() - started)
tracing.shutdown(100)
"""


def preload_traced(r: redis.Redis, n: int) -> None:
    """``n`` entries, each with its producer's ``traceparent`` (sampled)."""
    r.delete(bench_kit.STREAM)
    for start in range(0, n, 5000):
        pipe = r.pipeline(transaction=False)
        for i in range(start, min(n, start + 5000)):
            traceparent = f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"
            pipe.xadd(bench_kit.STREAM, {"body": bench_kit.body(i), "traceparent": traceparent})
        pipe.execute()
    r.xgroup_create(bench_kit.STREAM, bench_kit.GROUP, id="0")


def startup_s(mode: str, collector: Collector) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    if mode == "on":
        env |= collector.env()
    code = STARTUP_CODE.format(hide=mode == "no extra")
    out = subprocess.run(  # noqa: S603 - our interpreter, fixed code
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
        check=True,
    )
    return float(out.stdout.strip().splitlines()[-1])


def _prepared(pg: PostgresServer, rs_url: str, n: int, run: str) -> tuple[redis.Redis, str]:
    """A fresh database for ``run`` and ``n`` traced entries in the stream."""
    r = redis.Redis.from_url(rs_url)
    url = bench_kit.fresh_db(pg, run)
    preload_traced(r, n)
    return r, url


def ingest_and_ack(
    base: Path, pg: PostgresServer, rs_url: str, n: int, env: dict[str, str], run: str
) -> Measured:
    """msg/s of ingest + ack over ``n`` traced entries (clock: adapter enabled -> every entry XACKed)."""
    r, url = _prepared(pg, rs_url, n, run)
    config_path = bench_kit.write_config(base / f"{run}.toml", url, rs_url, 2000)
    acker = bench_kit.start("ack", config_path, base / f"{run}-acker.log", env)
    ingester = bench_kit.start("ingest", config_path, base / f"{run}-ingester.log", env)
    try:
        wait_ready(acker)
        wait_ready(ingester)
        pids = {"ingester": ingester.pid, "acker": acker.pid, "postgres": pg.pid}

        def drained() -> None:
            wait_for(lambda: bench_kit.stream_drained(r), timeout_s=600, what="every entry XACKed",
                     interval_s=bench_kit.POLL_S)  # fmt: skip

        measured = _timed(url, n, pids, drained)
    finally:
        ingester.terminate()
        acker.terminate()
    pg.drop_database(run)
    return measured


def _timed(url: str, n: int, pids: dict[str, int], finished: Callable[[], None]) -> Measured:
    """Enable the adapter, wait until ``finished`` returns: the rate, and the
    CPU per message of each process in ``pids`` over the same span."""
    background_before = bench_kit.background_work(url)
    cpu_before = {name: bench_kit.tree_cpu_seconds(pid) for name, pid in pids.items()}
    started = time.perf_counter()
    bench_kit.set_enabled(url, True)
    finished()
    elapsed = time.perf_counter() - started
    cpu_us = {
        name: (bench_kit.tree_cpu_seconds(pid) - cpu_before[name]) / n * 1e6 for name, pid in pids.items()
    }
    background = bench_kit.background_work(url)
    return n / elapsed, cpu_us, {k: v - background_before[k] for k, v in background.items()}


def end_to_end(
    base: Path, pg: PostgresServer, rs_url: str, n: int, env: dict[str, str], run: str
) -> Measured:
    """todos/s from entries to done (clock: every process ready, adapter enabled -> none active)."""
    r, url = _prepared(pg, rs_url, n, run)
    config_path = bench_kit.e2e_config(base, url, rs_url, 2000, run)
    acker = bench_kit.start("ack", config_path, base / f"{run}-acker.log", env)
    ingester = bench_kit.start("ingest", config_path, base / f"{run}-ingester.log", env)
    worker = SwitchboardProcess("worker", config_path, base / f"{run}-worker.log", cwd=ROOT, env=env)
    try:
        wait_ready(acker)
        wait_ready(ingester)
        wait_for(lambda: bench_kit.workers_ready(worker), timeout_s=120, what=f"{run}: the workers ready")
        pids = {"workers": worker.pid, "ingester": ingester.pid, "acker": acker.pid, "postgres": pg.pid}
        with psycopg.connect(libpq_url(url), autocommit=True) as watcher:

            def done() -> None:
                def none_left() -> bool:
                    return bench_kit.stream_drained(r) and not bench_kit.any_on(
                        watcher, bench_kit.ANY_ACTIVE_TODOS
                    )

                wait_for(none_left, timeout_s=900, what="every todo done", interval_s=bench_kit.POLL_S)

            measured = _timed(url, n, pids, done)
    finally:
        for proc in (worker, ingester, acker):
            proc.terminate()
    finished = bench_kit.todos_done(url)
    pg.drop_database(run)
    if finished != n:
        raise SystemExit(f"bench: {run} finished {finished} of {n} todos; logs in {base}")
    return measured


def _rounds(
    measure: Callable[[dict[str, str], str], Measured], collector: Collector, name: str
) -> list[float]:
    """The on/off ratio of each round, the order swapped every round; the
    CPU per message by process, both ways."""
    ratios = []
    for i in range(ROUNDS):
        runs: dict[bool, Measured] = {}
        for on in (False, True) if i % 2 == 0 else (True, False):
            collector.clear()
            runs[on] = measure(_traced_env(collector) if on else {}, f"{name}{i}{'on' if on else 'off'}")
        ratios.append(runs[True][0] / runs[False][0])
        print(f"    round {i + 1}: off {runs[False][0]:,.0f}/s, on {runs[True][0]:,.0f}/s, {ratios[-1]:.2f}x")
        for on in (False, True):
            cpu = ", ".join(f"{k} {v:.0f}" for k, v in runs[on][1].items())
            meanwhile = ", ".join(f"{v} {k}" for k, v in runs[on][2].items())
            print(f"      CPU us per message, {'on ' if on else 'off'}: {cpu}; meanwhile {meanwhile}")
    return ratios


def _traced_env(collector: Collector) -> dict[str, str]:
    """Tracing on as a deployment runs it: the collector's endpoint, the
    SDK's own batching (the tests' quick export delay aside)."""
    env = collector.env()
    del env["OTEL_BSP_SCHEDULE_DELAY"]
    return env


def _verdict(ratios: list[float]) -> str:
    ratio = statistics.median(ratios)
    met = "met" if ratio >= TARGET else "not met"
    return f"{ratio:.2f}x (rounds {min(ratios):.2f}-{max(ratios):.2f}), target >= {TARGET}: {met}"


PARTS = ("start-up", "ingest", "end-to-end")


def compare(base: Path, pg: PostgresServer, rs_url: str, n: int, parts: tuple[str, ...] = PARTS) -> None:
    print(f"bench: tracing (issue 47), {n:,} messages a run, every one sampled, {ROUNDS} rounds interleaved")
    with Collector(decode=False) as collector:
        if "start-up" in parts:
            _startup(collector)
        if "ingest" in parts:
            print("  ingest + ack, tracing on / off:")
            ingest = _rounds(lambda env, run: ingest_and_ack(base, pg, rs_url, n, env, run), collector, "tri")
            print(f"  ingest + ack on / off: {_verdict(ingest)}")
        if "end-to-end" in parts:
            print("  end to end, tracing on / off:")
            e2e = _rounds(lambda env, run: end_to_end(base, pg, rs_url, n, env, run), collector, "tre")
            print(f"  end to end on / off: {_verdict(e2e)}  ({collector.exports} exports received)")


def _startup(collector: Collector) -> None:
    times: dict[str, list[float]] = {"no extra": [], "off": [], "on": []}
    for _ in range(STARTUP_RUNS):
        for mode in times:
            times[mode].append(startup_s(mode, collector))
    start = {mode: statistics.median(values) * 1000 for mode, values in times.items()}
    print(
        f"  start-up (imports + switch_on), medians of {STARTUP_RUNS}: without the extra"
        f" {start['no extra']:.0f} ms, installed and off {start['off']:.0f} ms, on {start['on']:.0f} ms"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--messages",
        type=int,
        default=40_000,
        # End to end at 20,000 ran 5 s, short enough for a neighbour's burst to swing a round.
        help="messages per run, ingest + ack and end to end",
    )
    parser.add_argument("--only", choices=PARTS, action="append", help="this part alone (repeatable)")
    args = parser.parse_args(argv)
    with embedded_servers("switchboard-bench-tracing-", appendfsync="everysec") as servers:
        compare(servers.base, servers.postgres, servers.redis.url, args.messages, tuple(args.only or PARTS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
