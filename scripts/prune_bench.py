"""The pruner on a large inbox (issue 14): fill ``inbox`` and ``events`` with
N old rows (10M by default) server-side with ``generate_series``, then prune
them with the real pruner (``ingest.processes.ack.prune.Pruner``, the acker's settings)
while a writer inserts new rows the way the store does, one transaction per
batch of 100 (inbox row, event). Reports rows/s deleted, the longest batch
transaction, the writer's commit latency before and during the prune, the
plan of one batch, and table and index sizes and dead tuples before, after,
and after a VACUUM.

Starts its own PostgreSQL (the ``pgserver`` wheel, as ``scripts/bench.py``
does). Not part of the test suite: ``python scripts/prune_bench.py [--rows N]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import psycopg
from sqlalchemy.dialects import postgresql

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backhalf.db import DatabaseSettings, create_engine, libpq_url
from backhalf.housekeeping import migrate, retention
from ingest.config import AckerSettings
from ingest.embedded.servers import embedded_servers
from ingest.processes.ack.prune import Pruner, Walk, WalkResult

CHUNK = 1_000_000
RETAIN = timedelta(days=7)


# stored_at rises with the id, from 30 days ago to 8 days ago: all past a
# 7-day retention, in insertion order as the store writes.
FILL_EVENTS = """
INSERT INTO events (family, adapter, trust_mode, verified, verify_detail, idempotency_key,
                    source_message_id, payload, todo_id, received_at)
SELECT 'queue', 'bench', 'queue', false, 'redis acl: default', 'redis:bench:' || n || '-0', n || '-0',
       jsonb_build_object('order_id', n, 'sku', 'SKU-' || n %% 97, 'qty', 1 + n %% 7), n,
       now() - interval '30 days' + (n::float8 / %(rows)s) * interval '22 days'
FROM generate_series(%(first)s::int8, %(last)s::int8) AS n
"""
FILL_INBOX = """
INSERT INTO inbox (adapter, idempotency_key, source_message_id, consumer, body, ack_kind, ack_key,
                   ack_group, ack_entry_id, ack_state, acked_at, status, todo_id, event_id, stored_at)
SELECT 'bench', 'redis:bench:' || n || '-0', n || '-0', 'bench-1',
       convert_to(jsonb_build_object('order_id', n, 'sku', 'SKU-' || n %% 97, 'qty', 1 + n %% 7,
                                     'note', 'bench')::text, 'UTF8'),
       'xack', 'bench', 'switchboard', n || '-0', 'acked',
       now() - interval '30 days' + (n::float8 / %(rows)s) * interval '22 days', 'stored', n, n,
       now() - interval '30 days' + (n::float8 / %(rows)s) * interval '22 days'
FROM generate_series(%(first)s::int8, %(last)s::int8) AS n
"""


def fill(url: str, rows: int) -> float:
    """N events and N inbox rows (linked), stored 30 to 8 days ago in id order."""
    started = time.perf_counter()
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        conn.execute("INSERT INTO adapters (name, transport, mode) VALUES ('bench', 'redis', 'stream')")
        for first in range(1, rows + 1, CHUNK):
            last = min(first + CHUNK - 1, rows)
            span = {"first": first, "last": last, "rows": rows}
            conn.execute(FILL_EVENTS, span)
            conn.execute(FILL_INBOX, span)
            print(f"  filled {last:,} rows ({time.perf_counter() - started:,.0f} s)", flush=True)
    return time.perf_counter() - started


SIZES = """
SELECT c.relname, pg_relation_size(c.oid), pg_indexes_size(c.oid), s.n_live_tup, s.n_dead_tup
FROM pg_class c JOIN pg_stat_user_tables s ON s.relid = c.oid
WHERE c.relname IN ('inbox', 'events') ORDER BY c.relname
"""


def sizes(url: str, label: str) -> None:
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        conn.execute("SELECT pg_stat_force_next_flush()")
        for name, heap, indexes, live, dead in conn.execute(SIZES).fetchall():
            print(
                f"  {label:<14} {name:<7} heap {heap / 2**20:>8,.0f} MB  indexes {indexes / 2**20:>7,.0f} MB"
                f"  live {live:>12,}  dead {dead:>12,}"
            )


def vacuum(url: str) -> float:
    started = time.perf_counter()
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        conn.execute("VACUUM (ANALYZE) inbox")
        conn.execute("VACUUM (ANALYZE) events")
    return time.perf_counter() - started


def explain_one_batch(url: str) -> None:
    """EXPLAIN (ANALYZE, BUFFERS) of one real batch, rolled back."""
    values = {
        "adapter": "bench",
        "status": "stored",
        "age": RETAIN,
        "cursor": 0,
        "limit": AckerSettings().prune_batch_size,
    }
    # (status, dry_run, by_ids): the cursor walk of stored rows. SQLAlchemy's
    # psycopg dialect takes **kwargs unannotated.
    dialect = postgresql.dialect()  # type: ignore[no-untyped-call]
    compiled = retention._INBOX[("stored", False, False)].compile(dialect=dialect)
    state = compiled.construct_expanded_state(values)
    with psycopg.connect(libpq_url(url)) as conn:
        plan = conn.execute(
            f"EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) {state.statement}", state.parameters
        ).fetchall()
        conn.rollback()
    print("  plan of one batch (rolled back):")
    for (line,) in plan:
        print(f"    {line}")


class Writer(threading.Thread):
    """New inbox rows and events, 100 per transaction, at ``rate`` rows/s
    (a steady ingest, not a saturating one); the latency of every commit is kept."""

    def __init__(self, url: str, rate: int) -> None:
        super().__init__(name="writer", daemon=True)
        self._url = url
        self._interval_s = 100 / rate
        self.stop = threading.Event()
        self.latencies_s: list[float] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with psycopg.connect(libpq_url(self._url)) as conn:
                n = 0
                next_at = time.perf_counter()
                while not self.stop.is_set():
                    next_at += self._interval_s
                    started = time.perf_counter()
                    conn.execute(
                        "WITH ev AS (INSERT INTO events (family, adapter, trust_mode, verified,"
                        " idempotency_key, payload) SELECT 'queue', 'bench', 'queue', false,"
                        " 'redis:new:' || %(run)s || '-' || g, '{}'::jsonb FROM generate_series(1, 100) AS g"
                        " RETURNING id, idempotency_key)"
                        " INSERT INTO inbox (adapter, idempotency_key, source_message_id, body, ack_kind,"
                        " ack_state, status, event_id) SELECT 'bench', idempotency_key, idempotency_key,"
                        " 'x', 'xack', 'acked', 'stored', id FROM ev",
                        {"run": n},
                    )
                    conn.commit()
                    self.latencies_s.append(time.perf_counter() - started)
                    n += 1
                    self.stop.wait(max(0.0, next_at - time.perf_counter()))
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            self.error = exc


def writer_figures(label: str, latencies_s: list[float]) -> None:
    if not latencies_s:
        print(f"  writer {label}: no commits")
        return
    ordered = sorted(latencies_s)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    print(
        f"  writer {label:<17} {len(ordered) * 100:>9,} rows,"
        f" commit p50 {statistics.median(ordered) * 1000:6.1f} ms  p99 {p99 * 1000:6.1f} ms"
        f"  max {ordered[-1] * 1000:7.1f} ms"
    )


async def prune(url: str, batch_size: int, pause_ms: int, timeout_s: float) -> WalkResult:
    engine = create_engine(
        DatabaseSettings(url=url, statement_timeout_ms=30_000, transaction_deadline_ms=60_000)
    )
    pruner = Pruner(
        engine, [Walk("acked", "bench", RETAIN)], batch_size=batch_size, pause_ms=pause_ms, deadline_ms=60_000
    )

    def progress(r: WalkResult) -> None:
        rate = r.deleted["inbox"] / max(r.elapsed_s, 1e-9)
        print(
            f"  pruned {r.deleted['inbox']:>11,} inbox rows, {r.batches:,} batches, {rate:,.0f} rows/s,"
            f" longest batch {r.longest_batch_s * 1000:.0f} ms",
            flush=True,
        )

    stop = asyncio.Event()
    try:
        async with asyncio.timeout(timeout_s):
            [result] = await pruner.run(stop, progress=progress, progress_interval_s=30)
    finally:
        await engine.dispose()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=10_000_000, help="old inbox rows (and events) to prune")
    parser.add_argument("--batch-size", type=int, default=AckerSettings().prune_batch_size)
    parser.add_argument("--pause-ms", type=int, default=AckerSettings().prune_pause_ms)
    parser.add_argument("--writer-rate", type=int, default=5000, help="the writer's rows/s (inbox + event)")
    parser.add_argument("--timeout-s", type=float, default=3600, help="the prune's own bound")
    args = parser.parse_args(argv)
    # A small production server, not the test suite's 16 MB; autovacuum on,
    # as in production, so its work during the prune is measured with it.
    pg_conf = "shared_buffers = 1GB\nmax_wal_size = 8GB\ncheckpoint_timeout = 15min\n"
    with embedded_servers("switchboard-prune-bench-", postgres_conf=pg_conf) as servers:
        pg = servers.postgres
        url = pg.create_database("prune")
        migrate.upgrade(url)
        print(
            f"prune bench: {os.cpu_count()} CPUs, {args.rows:,} rows, batch {args.batch_size},"
            f" pause {args.pause_ms} ms"
        )
        print(f"  fill: {fill(url, args.rows):,.0f} s")
        print(f"  vacuum before: {vacuum(url):,.0f} s")
        sizes(url, "before")
        explain_one_batch(url)

        writer = Writer(url, args.writer_rate)
        writer.start()
        time.sleep(10)
        baseline = list(writer.latencies_s)
        started = time.perf_counter()
        result = asyncio.run(prune(url, args.batch_size, args.pause_ms, args.timeout_s))
        elapsed = time.perf_counter() - started
        during = writer.latencies_s[len(baseline) :]
        writer.stop.set()
        writer.join(timeout=30)
        if writer.error is not None:
            raise SystemExit(f"the writer failed: {writer.error!r}")
        deleted = result.deleted["inbox"]
        print(
            f"  pruned: {deleted:,} inbox rows and {result.deleted['events']:,} events in {elapsed:,.0f} s:"
            f" {deleted / elapsed:,.0f} inbox rows/s ({(deleted + result.deleted['events']) / elapsed:,.0f}"
            f" rows/s both tables), {result.batches:,} batches,"
            f" longest batch {result.longest_batch_s * 1000:.0f} ms"
        )
        writer_figures("before the prune", baseline)
        writer_figures("during the prune", during)
        sizes(url, "after")
        print(f"  vacuum after: {vacuum(url):,.0f} s")
        sizes(url, "after vacuum")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
