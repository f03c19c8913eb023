"""History (issue 45): ingest + ack on an empty database beside the same on a
database that retains N finished messages, in one run on one server, rounds
interleaved so noise cancels in the ratio.

The history is what the pipeline leaves for a done todo, written server-side
with ``generate_series`` in the store's order: an inbox row (acked), its
event, its todo (``done``) and the todo's three ``todo_events`` rows, spread
evenly over the last ``--days`` days (30) in id order, then ANALYZEd as
autovacuum would have. ``python scripts/bench_history.py [--retained N]
[--packaged-postgres]``; ``make bench`` runs it with a smaller N.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import psycopg
import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import bench  # noqa: E402

from backhalf.db import libpq_url  # noqa: E402
from ingest.embedded import history  # noqa: E402
from ingest.embedded.processes import wait_for  # noqa: E402
from ingest.embedded.servers import PostgresServer, embedded_servers, packaged_postgres_bindir  # noqa: E402

ROUNDS = 3

SIZES = """
SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0)
FROM pg_class c WHERE c.relname IN ('inbox', 'events', 'todos', 'todo_events') AND c.relkind IN ('r', 'p')
"""


def fill(url: str, rows: int, days: int) -> float:
    """``rows`` finished messages over the last ``days`` days; seconds taken."""
    started = time.perf_counter()

    def progress(done: int) -> None:
        print(f"  history: {done:,} of {rows:,} ({time.perf_counter() - started:,.0f} s)", flush=True)

    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        history.fill(conn, rows, days=days, on_chunk=progress)
        conn.execute("VACUUM (ANALYZE) inbox, events, todos, todo_events")
        conn.execute("CHECKPOINT")
    return time.perf_counter() - started


def table_bytes(url: str) -> int:
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        row = conn.execute(SIZES).fetchone()
        return int(row[0]) if row else 0


def newest_id(url: str) -> int:
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        row = conn.execute("SELECT coalesce(max(id), 0) FROM inbox").fetchone()
        return int(row[0]) if row else 0


def ingest_and_ack(base: Path, url: str, r: redis.Redis, redis_url: str, n: int, run: str) -> float:
    """msg/s of ``switchboard ingest`` + ``ack`` over ``n`` preloaded entries."""
    floor = newest_id(url)
    bench.preload(r, n)
    ingester, acker = bench.start_pipeline(base, url, redis_url, 2000, run)
    try:
        started = time.perf_counter()
        bench.set_enabled(url, True)
        wait_for(
            lambda: bench.stream_drained(r), timeout_s=900, what="every entry XACKed", interval_s=bench.POLL_S
        )
        elapsed = time.perf_counter() - started
    finally:
        ingester.terminate()
        acker.terminate()
    bench.set_enabled(url, False)
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM inbox WHERE id > %s AND ack_state = 'acked'", (floor,)
        ).fetchone()
    if not row or row[0] != n:
        raise SystemExit(f"bench history: {run}: {row[0] if row else 0} of {n} rows acked")
    return n / elapsed


def compare(
    base: Path, pg: PostgresServer, redis_url: str, retained: int, n: int, days: int = 30
) -> dict[str, Any]:
    """Interleaved rounds on an empty database and a retaining one; prints and returns the figures."""
    r = redis.Redis.from_url(redis_url)
    empty = bench.fresh_db(pg, "hist_empty")
    full = bench.fresh_db(pg, "hist_full")
    took = fill(full, retained, days)
    size = table_bytes(full)
    print(
        f"bench: history of {retained:,} finished messages over {days} days:"
        f" {size / 2**30:.2f} GiB, filled in {took:,.0f} s"
    )
    rates: dict[str, list[float]] = {"empty": [], "retained": []}
    for i in range(ROUNDS):
        order = [("empty", empty), ("retained", full)]
        for name, url in order if i % 2 == 0 else reversed(order):
            rates[name].append(ingest_and_ack(base, url, r, redis_url, n, f"hist-{name}-{i}"))
    ratios = [f / e for e, f in zip(rates["empty"], rates["retained"], strict=True)]
    empty_rate, full_rate = statistics.median(rates["empty"]), statistics.median(rates["retained"])
    print(f"  ingest + ack, empty database       {empty_rate:>10,.0f} msg/s")
    print(f"  ingest + ack, {retained:>10,} retained {full_rate:>10,.0f} msg/s")
    print(
        f"  ratio retained/empty (median of {ROUNDS} rounds)"
        f" {statistics.median(ratios):.2f}x (target >= 0.9x)"
    )
    return {"empty": empty_rate, "retained": full_rate, "ratio": statistics.median(ratios)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--retained", type=int, default=1_000_000, help="finished messages retained")
    parser.add_argument("--messages", type=int, default=50_000, help="messages per ingest + ack run")
    parser.add_argument("--days", type=int, default=30, help="days the history spans")
    parser.add_argument("--packaged-postgres", action="store_true", help="Debian's PostgreSQL, JIT on")
    args = parser.parse_args(argv)
    postgres_bin = packaged_postgres_bindir() if args.packaged_postgres else None
    if args.packaged_postgres and postgres_bin is None:
        raise SystemExit("bench history: --packaged-postgres: no /usr/lib/postgresql/*/bin/postgres here")
    conf = "track_commit_timestamp = on\nshared_buffers = 1GB\nmax_wal_size = 4GB\n"
    with embedded_servers(
        "switchboard-history-", appendfsync="everysec", postgres_conf=conf, postgres_bin=postgres_bin
    ) as servers:
        bench.print_postgres(servers.postgres)
        compare(servers.base, servers.postgres, servers.redis.url, args.retained, args.messages, args.days)
    return 0


if __name__ == "__main__":
    sys.exit(main())
