"""Issue 5 probe: drain one pre-loaded stream with the real ``switchboard
ingest`` + ``switchboard ack`` processes (as ``make bench --backlog`` does)
and record, while it runs, what grows with the database:

* drain rate and the ingester's ``store_ms`` per batch, per tenth of the run;
* every statement's server-side duration (``log_min_duration_statement = 0``,
  parameters not logged), grouped by statement and by tenth of the run;
* ``pg_stat_user_tables`` (inserts, updates, HOT updates, dead tuples,
  autovacuums), relation and index sizes, WAL bytes and full-page images,
  checkpoints, at the start, at each tenth and at the end;
* ``EXPLAIN (ANALYZE, BUFFERS)`` of the acker's claim (its read-only SELECT)
  at a few points of the run.

Diagnostic only; ``scripts/bench.py`` stays the reference benchmark.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import psycopg
import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import bench_kit  # noqa: E402

from backhalf import queries  # noqa: E402
from backhalf.db import libpq_url  # noqa: E402
from ingest.embedded.processes import wait_for, wait_ready  # noqa: E402
from ingest.embedded.servers import embedded_servers  # noqa: E402

TABLES = ("inbox", "events", "todos", "todo_events", "ack_queue")

# The read-only part of the acker's claim (backhalf.queries.CLAIM_ACKS).
CLAIM_SELECT = """
SELECT q.inbox_id FROM ack_queue q JOIN inbox i ON i.id = q.inbox_id
WHERE q.adapter = ANY(ARRAY['bench'])
ORDER BY q.inbox_id LIMIT 4000
"""


def snapshot(conn: psycopg.Connection[Any]) -> dict[str, Any]:
    snap: dict[str, Any] = {"t": time.perf_counter()}
    for row in conn.execute(
        "SELECT relname, n_tup_ins, n_tup_upd, n_tup_hot_upd, n_tup_del, n_live_tup, n_dead_tup,"
        " autovacuum_count, autoanalyze_count FROM pg_stat_user_tables WHERE relname = ANY(%s)",
        (list(TABLES),),
    ):
        snap[row[0]] = dict(
            zip(("ins", "upd", "hot", "del", "live", "dead", "autovac", "autoanalyze"), row[1:], strict=True)
        )
    snap["queue"] = conn.execute(
        "SELECT n_tup_ins, n_tup_del, n_dead_tup FROM pg_stat_user_tables WHERE relname = 'ack_queue'"
    ).fetchone()
    snap["sizes"] = dict(
        conn.execute(
            "SELECT c.relname, pg_relation_size(c.oid) FROM pg_class c"
            " JOIN pg_namespace n ON n.oid = c.relnamespace"
            " WHERE n.nspname = 'public' AND c.relkind IN ('r', 'i') ORDER BY 1"
        ).fetchall()
    )
    db = conn.execute("SELECT pg_database_size(current_database()) / 1048576").fetchone()
    snap["db_mb"] = db[0] if db else None
    io = conn.execute(
        "SELECT coalesce(sum(writes), 0), coalesce(sum(extends), 0), coalesce(sum(evictions), 0)"
        " FROM pg_stat_io WHERE backend_type = 'client backend' AND object = 'relation'"
    ).fetchone()
    snap["io"] = dict(zip(("writes", "extends", "evictions"), io, strict=True)) if io else {}
    wal = conn.execute("SELECT wal_records, wal_fpi, wal_bytes FROM pg_stat_wal").fetchone()
    snap["wal"] = {"records": wal[0], "fpi": wal[1], "bytes": int(wal[2])} if wal else {}
    cp = conn.execute(
        "SELECT checkpoints_timed, checkpoints_req, buffers_checkpoint, buffers_backend FROM pg_stat_bgwriter"
    ).fetchone()
    snap["ckpt"] = dict(zip(("timed", "req", "buf_ckpt", "buf_backend"), cp, strict=True)) if cp else {}
    return snap


def explain_claim(conn: psycopg.Connection[Any]) -> str:
    with conn.transaction():
        conn.execute(queries.CLAIM_PLAN)
        rows = conn.execute("EXPLAIN (ANALYZE, BUFFERS, TIMING OFF) " + CLAIM_SELECT).fetchall()
    out = "\n".join(r[0] for r in rows)
    # The store's known-keys read, for 2000 keys that are not stored yet
    # (the common case) next to the newest stored ones.
    keys = [k for (k,) in conn.execute("SELECT idempotency_key FROM inbox ORDER BY id DESC LIMIT 2000")]
    rows = conn.execute(
        "EXPLAIN (ANALYZE, BUFFERS, TIMING OFF) " + queries.EXISTING_NATIVE,
        {"adapter": "bench", "keys": [k + "x" for k in keys]},
    ).fetchall()
    plan = [r[0] for r in rows if "::text[]" not in r[0]]  # leave out the 2000 keys
    return out + "\n--- EXPLAIN EXISTING_NATIVE (2000 absent keys)\n" + "\n".join(plan)


STATEMENT_RE = re.compile(
    r"^(?P<ts>\S+ \S+) \S+ \[(?P<pid>\d+)\] (?P<app>\S*) LOG:  duration: (?P<ms>[\d.]+) ms  "
    r"(?:execute \S+|statement): (?P<sql>.*)$"
)


def classify(sql_text: str) -> str:
    s = " ".join(sql_text.split())[:60]
    for prefix, name in (
        ("WITH picked AS (", "acker CLAIM_ACKS"),
        ("SELECT u.k FROM unnest", "store EXISTING_NATIVE"),
        ("WITH u AS ( SELECT * FROM unnest", "store STORE_NATIVE"),
        ("SELECT pg_notify", "store NOTIFY"),
        ("COMMIT", "COMMIT"),
    ):
        if s.startswith(prefix):
            return name
    return "other"


def parse_pg_log(path: Path) -> list[tuple[float, str, float]]:
    """(epoch seconds, statement class, ms) for every logged execution; a
    statement of no known class is named by its backend's role (the acker's
    backend runs the claim, the store's the inbox insert) and its first words."""
    from datetime import datetime

    raw = []
    role: dict[str, str] = {}
    lines = path.read_text(errors="replace").splitlines()
    for i, line in enumerate(lines):
        m = STATEMENT_RE.match(line)
        if not m:
            continue
        text = m["sql"]
        j = i + 1
        while not text.strip() and j < len(lines):  # the statement starts on the next line
            text = lines[j]
            j += 1
        ts = datetime.strptime(m["ts"][:23], "%Y-%m-%d %H:%M:%S.%f").timestamp()
        cls = classify(text)
        if m["app"] == "probe":
            continue
        if cls.startswith(("acker", "store")):
            role[m["pid"]] = cls.split()[0]
        raw.append((ts, m["pid"], cls, " ".join(text.split()[:3]), float(m["ms"])))
    out = []
    for ts, pid, cls, words, ms in raw:
        if cls in ("COMMIT", "other") and pid in role:
            cls = f"{role[pid]} {words[:40]}"
        elif cls == "other":
            cls = f"other {words[:40]}"
        out.append((ts, cls, ms))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--messages", type=int, default=300_000)
    parser.add_argument("--batch-size", type=int, default=2000)
    parser.add_argument("--no-acker", action="store_true", help="ingester only (acks left pending)")
    parser.add_argument("--no-statement-log", action="store_true")
    parser.add_argument("--json", type=Path, help="write the raw samples here")
    parser.add_argument("--pg-conf", action="append", default=[], help="extra postgresql.conf line")
    args = parser.parse_args(argv)
    n: int = args.messages

    pg_conf = "track_commit_timestamp = on\nshared_buffers = 1GB\nmax_wal_size = 4GB\n"
    pg_conf += "log_checkpoints = on\nlog_autovacuum_min_duration = 0\n"
    pg_conf += "log_line_prefix = '%m [%p] %a '\n"
    if not args.no_statement_log:
        pg_conf += "log_min_duration_statement = 0\nlog_parameter_max_length = 0\n"
    pg_conf += "".join(line + "\n" for line in args.pg_conf)
    with embedded_servers("switchboard-probe-", appendfsync="everysec", postgres_conf=pg_conf) as servers:
        base, pg, rs = servers.base, servers.postgres, servers.redis
        r = redis.Redis.from_url(rs.url)
        url = bench_kit.fresh_db(pg, "probe")
        bench_kit.preload(r, n)
        config = bench_kit.write_config(base / "probe.toml", url, rs.url, args.batch_size)
        acker = None if args.no_acker else bench_kit.start("ack", config, base / "acker.log")
        ingester = bench_kit.start("ingest", config, base / "ingester.log")
        if acker:
            wait_ready(acker)
        wait_ready(ingester)

        mon = psycopg.connect(libpq_url(url), autocommit=True)
        mon.execute("SET application_name = 'probe'")
        snaps = [snapshot(mon)]
        explains: list[tuple[int, str]] = []
        samples: list[tuple[float, int]] = []
        started = time.perf_counter()
        started_epoch = time.time()
        bench_kit.set_enabled(url, True)
        next_tenth = 1
        explain_at = {n // 10, n // 2, (9 * n) // 10}

        def done() -> bool:
            (group,) = r.xinfo_groups(bench_kit.STREAM)
            if args.no_acker:
                return bool(group["lag"] == 0 and "batch_stored" in ingester.raw_log() and _stored_all())
            return bool(group["lag"] == 0 and group["pending"] == 0)

        def _stored_all() -> bool:
            lines = [ln for ln in ingester.raw_log().splitlines() if "batch_stored" in ln]
            stored: int = sum(json.loads(ln)["messages"] for ln in lines)
            return stored >= n

        while not done():
            (group,) = r.xinfo_groups(bench_kit.STREAM)
            drained = n - int(group["lag"] or 0)
            now = time.perf_counter()
            samples.append((now, drained))
            while next_tenth < 10 and drained >= next_tenth * n // 10:
                snaps.append(snapshot(mon))
                next_tenth += 1
            for mark in sorted(explain_at):
                if drained >= mark:
                    explain_at.discard(mark)
                    explains.append((drained, explain_claim(mon)))
            time.sleep(0.25)
        elapsed = time.perf_counter() - started
        finished_epoch = time.time()
        samples.append((time.perf_counter(), n))
        snaps.append(snapshot(mon))
        if not args.no_acker:
            wait_for(
                lambda: bench_kit.acked_count(url) == n, timeout_s=60, what="every inbox row marked acked"
            )
        explains.append((n, explain_claim(mon)))
        mon.execute("ANALYZE inbox")
        explains.append((-n, explain_claim(mon)))  # negative: after ANALYZE
        ingester.terminate()
        if acker:
            acker.terminate()

        print(
            f"probe: {n:,} messages in {elapsed:.1f} s = {n / elapsed:,.0f} msg/s"
            f" (acker: {not args.no_acker})"
        )
        # Drain rate per tenth (by messages read).
        t0 = samples[0][0]
        print("tenth  drain msg/s   store_ms mean (ingester batch_stored)")
        stores = []
        for ln in ingester.raw_log().splitlines():
            if "batch_stored" in ln:
                d = json.loads(ln)
                stores.append((d["timestamp"], d["messages"], d["store_ms"]))
        cum = 0
        store_by_tenth: dict[int, list[float]] = defaultdict(list)
        for _ts, msgs, ms in stores:
            store_by_tenth[min(9, cum * 10 // n)].append(ms / msgs * 2000)
            cum += msgs
        for k in range(10):
            lo, hi = k * n // 10, (k + 1) * n // 10
            part = [s for s in samples if lo <= s[1] <= hi]
            rate = (
                (part[-1][1] - part[0][1]) / max(part[-1][0] - part[0][0], 1e-9)
                if len(part) > 1
                else float("nan")
            )
            st = store_by_tenth.get(k, [])
            print(f"{k + 1:>5}  {rate:>11,.0f}   {sum(st) / max(len(st), 1):8.1f} ms/2000 (n={len(st)})")
        del t0

        if not args.no_statement_log:
            execs = parse_pg_log(pg.log_path)
            run = [e for e in execs if started_epoch - 0.5 <= e[0] <= finished_epoch]
            if run:
                first, last = run[0][0], run[-1][0]
                per: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
                for ts, cls, ms in run:
                    per[cls][min(9, int((ts - first) / max(last - first, 1e-9) * 10))].append(ms)
                header = "statement durations by tenth of the run (wall clock): mean ms [calls]"
                print(header + "  first / middle / last")
                for cls, by in sorted(per.items()):
                    cells = []
                    for k in (0, 4, 9):
                        v = by.get(k, [])
                        cells.append(f"{sum(v) / max(len(v), 1):8.2f} [{len(v)}]")
                    total = sum(sum(v) for v in by.values())
                    print(f"  {cls:<22} {' / '.join(cells)}  total {total / 1000:.1f} s")

        print("snapshots (inbox): upd  hot  dead  autovac | sizes MB: inbox, indexes | WAL MB, FPI")
        for i, s in enumerate(snaps):
            ib = s.get("inbox", {})
            sizes = s["sizes"]
            idx = {
                k: v
                for k, v in sizes.items()
                if k.startswith(("pk_inbox", "uq_inbox", "ix_inbox", "ack_queue"))
            }
            print(
                f"  [{i}] upd {ib.get('upd')} hot {ib.get('hot')} dead {ib.get('dead')}"
                f" av {ib.get('autovac')}"
                f" | inbox {sizes.get('inbox', 0) / 2**20:.1f} "
                + " ".join(f"{k}={v / 2**20:.1f}" for k, v in sorted(idx.items()))
                + f" | db {s['db_mb']} MB, backend io {s['io']}"
                + f" | wal {s['wal'].get('bytes', 0) / 2**20:.0f} fpi {s['wal'].get('fpi')} ckpt {s['ckpt']}"
            )
        for drained, text in explains:
            print(f"--- EXPLAIN claim SELECT at {drained:,} drained\n{text}")
        if args.json:
            args.json.write_text(json.dumps({"snaps": snaps, "samples": samples}, default=str))
        shutil.copy(pg.log_path, Path(tempfile.gettempdir()) / "probe-postgres.log")
    return 0


if __name__ == "__main__":
    sys.exit(main())
