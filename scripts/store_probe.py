"""Issue 16 probe: PostgreSQL's CPU per message for the store and the ack
claim, as Switchboard runs them and in the variants issue 16 proposes, with
no Redis and no Python in the way of the figures.

One connection (sync psycopg) writes batches of ``--batch`` new stream
entries with the store's own statement (``backhalf.queries.STORE_NATIVE``,
the NOTIFY included), then claims and marks them with the acker's (claim
plan + ``CLAIM_ACKS``), transaction after transaction, in a fresh database
per run. The backend's user + system CPU (``/proc/<pid>/stat``) is divided by
the messages: the figure is repeatable to about 1% on a shared machine,
unlike throughput. Variants, each in its own database, interleaved per round:

* ``base``: Switchboard as it is: stream acks found by the adapter's ack
  cursor (``inbox.ack_xid``), as ``ingest/acker.py`` drains them (the cursor
  claim, the empty queue claim, the mark).
* ``peer``: the FastStream peer's statements with its bookkeeping
  (``scripts/bench_faststream.py``): inbox first, todo, its log row and the
  event; the inbox marked acked in a second transaction.
* ``queue``: the design before issue 16: every ack through an
  ``ack_queue`` row, inserted by the store, claimed and deleted by the acker.
* ``nolog``: the store without the todo's 'pending' ``todo_events`` row.
* ``noevidx``: the events table without its two secondary indexes.
* ``claimnolock``: the queue design's claim without its join that locks the
  inbox row.

Diagnostic only: ``scripts/bench.py`` stays the reference benchmark.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import psycopg

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import bench_peer_sql  # noqa: E402

from backhalf import queries  # noqa: E402
from backhalf.db import libpq_url  # noqa: E402
from backhalf.housekeeping import migrate, partitions  # noqa: E402
from ingest.embedded.servers import embedded_servers  # noqa: E402

CLK_TCK = os.sysconf("SC_CLK_TCK")
CLAIM_ARGS = {"adapters": ["bench"], "limit": 0}


def backend_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def body(i: int) -> bytes:
    return json.dumps({"order_id": i, "sku": f"SKU-{i % 97}", "qty": 1 + i % 7, "note": "bench"}).encode()


def store_params(start: int, n: int) -> dict[str, Any]:
    """What backhalf.writes.store._write binds for ``n`` first deliveries."""
    ids = [f"1700000{start + i:09d}-0" for i in range(n)]
    bodies = [body(start + i) for i in range(n)]
    return {
        "adapter": "bench", "queue": "bench", "todo_detail": "created by the probe", "consumer": "probe",
        "family": "queue", "trust_mode": "queue", "verified": False, "verify_detail": "probe",
        "ack_kind": "xack", "ack_group": "g", "ack_after": "store", "ack_state": "pending",
        "keys": [f"redis:bench:{m}" for m in ids], "ids": ids, "bodies": bodies,
        "payloads": [b.decode() for b in bodies], "ack_key": "bench", "ack_keys": None, "entry_is_id": True,
        "entry_ids": None, "copies": None, "deliveries": None, "errors": None, "sizes": None, "digests": None,
        "attributes": None, "trace_contexts": None,
        "by_cursor": True, "by_body": False, "stream": "bench", "group": "g",
    }  # fmt: skip


# --- the variants' statements, derived from the real ones -----------------------------------


def _replaced(text: str, old: str, new: str) -> str:
    if old not in text:
        raise SystemExit(f"store_probe: the statement changed; update the probe (looked for {old[:60]!r})")
    return text.replace(old, new)


STORE_NO_LOG = _replaced(
    queries.STORE_NATIVE,
    "logged AS (\n    INSERT INTO todo_events (todo_id, from_status, to_status, detail)\n"
    "    SELECT id, NULL, 'pending', %(todo_detail)s FROM t WHERE created\n),\n",
    "",
)
CLAIM_NO_LOCK = _replaced(
    queries.CLAIM_ACKS, "FROM ack_queue q JOIN inbox i ON i.id = q.inbox_id", "FROM ack_queue q"
)


def run(conn: psycopg.Connection[Any], variant: str, n: int, batch: int) -> tuple[float, float, float]:
    """(CPU us per message in all, of which the claim's, msg/s)."""
    pid = conn.execute("SELECT pg_backend_pid()").fetchone()[0]  # type: ignore[index]
    store_sql = STORE_NO_LOG if variant == "nolog" else queries.STORE_NATIVE
    claim_s = 0.0
    cpu0, t0 = backend_cpu_s(pid), time.perf_counter()
    for start in range(0, n, batch):
        params = store_params(start, batch)
        params["by_cursor"] = variant != "queue"
        if variant == "peer":
            with conn.transaction():
                ids = conn.execute(bench_peer_sql.STORE_SQL.format(logged=bench_peer_sql.LOGGED), params)
                inbox_ids = ids.fetchone()[0]  # type: ignore[index]
            c1 = backend_cpu_s(pid)
            with conn.transaction():
                conn.execute(bench_peer_sql.MARK_SQL, {"ids": inbox_ids})
            claim_s += backend_cpu_s(pid) - c1
            continue
        with conn.transaction():
            conn.execute(store_sql, params).fetchall()
            conn.execute(
                queries.NOTIFY_STORE,
                {
                    "acks": True,
                    "ack_channel": "probe",
                    "adapter": "bench",
                    "todos": True,
                    "todo_channel": "probe_todos",
                    "queue": "bench",
                },
            )
        c1 = backend_cpu_s(pid)
        with conn.transaction():
            if variant in ("queue", "claimnolock"):
                conn.execute(queries.CLAIM_PLAN)
                claim = CLAIM_NO_LOCK if variant == "claimnolock" else queries.CLAIM_ACKS
                conn.execute(claim, {**CLAIM_ARGS, "limit": batch}).fetchall()
            else:  # as ingest/acker.py's drain_adapter: cursor, queue, mark
                rows = conn.execute(queries.CURSOR_ACKS, {"adapter": "bench", "limit": batch}).fetchall()
                conn.execute(queries.CLAIM_PLAN)
                conn.execute(queries.CLAIM_ACKS, {**CLAIM_ARGS, "limit": batch}).fetchall()
                last = rows[-1]
                mark = {"ids": [r[3] for r in rows], "xmin": rows[0][1], "to_xid": last[10], "to_id": last[3]}
                bounds = partitions.id_bounds(mark["ids"])
                conn.execute(queries.MARK_CURSOR_ACKS, {**mark, **bounds, "adapter": "bench"})
        claim_s += backend_cpu_s(pid) - c1
    elapsed = time.perf_counter() - t0
    return (backend_cpu_s(pid) - cpu0) / n * 1e6, claim_s / n * 1e6, n / elapsed


VARIANTS = ("base", "peer", "queue", "nolog", "noevidx", "claimnolock")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "variants", nargs="*", metavar="VARIANT", help=f"of {', '.join(VARIANTS)} (default: all)"
    )
    parser.add_argument("--messages", type=int, default=60_000)
    parser.add_argument("--batch", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    variants = args.variants or list(VARIANTS)
    if unknown := set(variants) - set(VARIANTS):
        parser.error(f"unknown variants: {', '.join(sorted(unknown))}")
    # make bench's server settings
    pg_conf = "track_commit_timestamp = on\nshared_buffers = 1GB\nmax_wal_size = 4GB\n"
    results: dict[str, list[tuple[float, float, float]]] = {v: [] for v in variants}
    with embedded_servers("switchboard-store-probe-", postgres_conf=pg_conf) as servers:
        pg = servers.postgres
        for i in range(args.rounds):
            for variant in variants:
                name = f"probe{i}_{variant}"
                url = pg.create_database(name)
                migrate.upgrade(url)
                with psycopg.connect(libpq_url(url), autocommit=True) as conn:
                    conn.execute("INSERT INTO adapters (name, transport, mode, enabled)"
                                 " VALUES ('bench', 'redis', 'stream', true)")  # fmt: skip
                    if variant == "noevidx":
                        conn.execute(
                            "DROP INDEX ix_events_adapter_idempotency_key; DROP INDEX ix_events_todo_id"
                        )
                    conn.execute("CHECKPOINT")
                # autocommit: each conn.transaction() is a transaction, not a savepoint
                with psycopg.connect(libpq_url(url), autocommit=True) as conn:
                    results[variant].append(run(conn, variant, args.messages, args.batch))
                pg.drop_database(name)
    print(f"store_probe: PostgreSQL CPU per message, {args.messages:,} messages in batches of {args.batch},"
          f" {args.rounds} rounds")  # fmt: skip
    for variant, runs in results.items():
        cpu = sorted(r[0] for r in runs)[len(runs) // 2]
        claim = sorted(r[1] for r in runs)[len(runs) // 2]
        rate = sorted(r[2] for r in runs)[len(runs) // 2]
        print(f"  {variant:<12} {cpu:5.1f} us (store {cpu - claim:5.1f}, ack claim {claim:5.1f})"
              f"  {rate:>8,.0f} msg/s   runs: " + " ".join(f"{r[0]:.1f}" for r in runs))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
