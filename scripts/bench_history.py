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
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psycopg
import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import bench_kit  # noqa: E402

from backhalf.db import libpq_url  # noqa: E402
from ingest.embedded import config, history  # noqa: E402
from ingest.embedded.processes import wait_for  # noqa: E402
from ingest.embedded.servers import PostgresServer, embedded_servers, packaged_postgres_bindir  # noqa: E402

ROUNDS = 3

# Every table that holds the history's rows: the partitions (a partitioned
# table holds none itself), todos' (live, finished, late), and the native keys.
SIZES = """
SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0) FROM pg_class c
WHERE c.relkind = 'r' AND c.relnamespace = 'public'::regnamespace
  AND (c.relname ~ '^(inbox|events|todo_events|todos_done)(_p[0-9]{6})?$'
       OR c.relname IN ('todos_live', 'todos_done_late', 'inbox_keys'))
"""


def fill(url: str, rows: int, days: int) -> float:
    """``rows`` finished messages over the last ``days`` days; seconds taken."""
    started = time.perf_counter()

    def progress(done: int) -> None:
        print(f"  history: {done:,} of {rows:,} ({time.perf_counter() - started:,.0f} s)", flush=True)

    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        # Each day's rows in partitions of their own, as the acker leaves them.
        history.fill(conn, rows, days=days, on_chunk=progress, by_day=True)
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
    bench_kit.preload(r, n)
    ingester, acker = bench_kit.start_pipeline(base, url, redis_url, 2000, run)
    try:
        started = time.perf_counter()
        bench_kit.set_enabled(url, True)
        wait_for(
            lambda: bench_kit.stream_drained(r),
            timeout_s=900,
            what="every entry XACKed",
            interval_s=bench_kit.POLL_S,
        )
        elapsed = time.perf_counter() - started
    finally:
        ingester.terminate()
        acker.terminate()
    bench_kit.set_enabled(url, False)
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM inbox WHERE id > %s AND ack_state = 'acked'", (floor,)
        ).fetchone()
    if not row or row[0] != n:
        raise SystemExit(f"bench history: {run}: {row[0] if row else 0} of {n} rows acked")
    return n / elapsed


WAL_LSN = "SELECT pg_current_wal_lsn()::text"
WAL_SINCE = "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %s::pg_lsn)::int8"


def _acked_entries(r: redis.Redis) -> int:
    """Entries the group has read and acked (Redis's count: no PostgreSQL
    poll is billed to the measurement)."""
    (group,) = r.xinfo_groups(bench_kit.STREAM)
    return int(group["entries-read"] or 0) - int(group["pending"])


def retention_under_ingest(
    base: Path,
    url: str,
    r: redis.Redis,
    redis_url: str,
    empty_rate: float,
    keep_days: int,
    bytes_per_new: float,
) -> dict[str, float]:
    """``switchboard prune`` of everything older than ``keep_days`` while the
    ingester and acker drain a stream at full speed: the prune's seconds and
    WAL, ingest meanwhile against ``empty_rate``, the tables' size before,
    after and after a VACUUM."""
    before_bytes = table_bytes(url)
    prune_config = config.write_config(
        base / "hist-prune.toml",
        database_url=url,
        adapters=[
            {
                "name": "bench",
                "mode": "stream",
                "source": bench_kit.STREAM,
                "queue": "bench",
                "url": redis_url,
            }
        ],
        # The history's partitions past keep_days go whole, and so do the
        # finished todos' (every queue has a retain_done_days).
        acker={"prune_interval_ms": 0, "retain_history_days": keep_days},
        queues={
            "bench": {
                "handler": "ingest.embedded.demo_handlers:fulfil",
                "retain_done_days": keep_days,
                "retain_failed_days": keep_days,
            }
        },
    )
    # More entries than the prune outlasts at full speed; what is left is dropped.
    bench_kit.preload(r, max(200_000, int(empty_rate * 60)))
    ingester, acker = bench_kit.start_pipeline(base, url, redis_url, 2000, "hist-prune-pipeline")
    try:
        bench_kit.set_enabled(url, True)
        time.sleep(3)  # past the start: a steady drain when the prune begins
        with psycopg.connect(libpq_url(url), autocommit=True) as conn:
            row = conn.execute(WAL_LSN).fetchone()
            lsn = str(row[0]) if row else "0/0"
        acked_at_start, started = _acked_entries(r), time.perf_counter()
        pruned = subprocess.run(  # noqa: S603 - our own CLI, fixed arguments
            [sys.executable, "-m", "ingest", "--config", str(prune_config), "prune"],
            capture_output=True, text=True, check=True, timeout=3600,
        )  # fmt: skip
        prune_s = time.perf_counter() - started
        ingested = _acked_entries(r) - acked_at_start
        during = ingested / prune_s
        with psycopg.connect(libpq_url(url), autocommit=True) as conn:
            row = conn.execute(WAL_SINCE, (lsn,)).fetchone()
            wal = int(row[0]) if row else 0
    finally:
        ingester.terminate()
        acker.terminate()
    bench_kit.set_enabled(url, False)
    ingested_in_all = _acked_entries(r)
    r.delete(bench_kit.STREAM)
    after_bytes = table_bytes(url)
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        conn.execute("VACUUM inbox, events, todos, todo_events, inbox_keys")  # partitioned: each partition
    vacuumed = table_bytes(url)
    print(f"  retention of all but {keep_days} days, while ingest runs (switchboard prune):")
    for line in (pruned.stdout + pruned.stderr).splitlines():
        print(f"    | {line}")
    print(
        f"    the prune                        {prune_s:>10,.1f} s,"
        f" WAL {wal / 2**30:,.2f} GiB (ingest's included)"
    )
    print(
        f"    ingest + ack meanwhile           {during:>10,.0f} msg/s,"
        f" {during / empty_rate:.2f}x empty (target >= 0.8x)"
    )
    # The messages ingested while the pipeline ran take room too: counted at
    # what each took in the empty database (which holds only such messages).
    new_bytes = ingested_in_all * bytes_per_new
    print(
        f"    tables {before_bytes / 2**30:.2f} GiB before, {after_bytes / 2**30:.2f} after,"
        f" {vacuumed / 2**30:.2f} after VACUUM: {vacuumed / before_bytes:.2f}x"
        f" ({(vacuumed - new_bytes) / before_bytes:.2f}x net of those ingested meanwhile; target <= 0.5x)"
    )
    return {"prune_s": prune_s, "wal": wal, "during": during, "size_ratio": vacuumed / before_bytes}


def compare(
    base: Path,
    pg: PostgresServer,
    redis_url: str,
    retained: int,
    n: int,
    days: int = 30,
    *,
    retention: bool = True,
) -> dict[str, Any]:
    """Interleaved rounds on an empty database and a retaining one; prints and returns the figures."""
    r = redis.Redis.from_url(redis_url)
    empty = bench_kit.fresh_db(pg, "hist_empty")
    full = bench_kit.fresh_db(pg, "hist_full")
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
    figures: dict[str, Any] = {"empty": empty_rate, "retained": full_rate, "ratio": statistics.median(ratios)}
    if retention:
        figures.update(
            retention_under_ingest(
                base, full, r, redis_url, empty_rate, days * 7 // 30, table_bytes(empty) / (ROUNDS * n)
            )
        )
    return figures


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
        bench_kit.print_postgres(servers.postgres)
        compare(servers.base, servers.postgres, servers.redis.url, args.retained, args.messages, args.days)
    return 0


if __name__ == "__main__":
    sys.exit(main())
