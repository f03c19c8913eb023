"""``switchboard prune [--dry-run] [--json]``: one pass of every retention
walk the config asks for (``retain_*`` keys of ``[[adapters]]`` and
``[queues.NAME]``), the same walks the acker runs every ``[acker]
prune_interval_ms`` (:mod:`ingest.processes.ack.prune`).

Prints one line per adapter and queue with what was deleted from each table
(with ``--dry-run``: what would be, and nothing is), and on stderr a progress
line every few seconds while a long walk runs. Ctrl-C stops it between or
inside a batch: a batch is one transaction, so it is all deleted or not.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from backhalf.db import create_engine
from backhalf.housekeeping.partitions import partition_name
from ingest.cli.verb import Verb, add_json, in_loop
from ingest.config import Settings
from ingest.exit_codes import EXIT_OK
from ingest.processes.ack.partitions import partitioned, upkeep_once
from ingest.processes.ack.prune import TABLES, Pruner, WalkResult, walks

# How often a long walk reports on stderr.
PROGRESS_INTERVAL_S = 5.0


def add_parser(verbs: Any, common: argparse.ArgumentParser) -> None:
    prune = verbs.add_parser(
        "prune", parents=[common], help="delete inbox rows, events and todos past their retention"
    )
    prune.add_argument("--dry-run", action="store_true", help="count what would be deleted; delete nothing")
    add_json(prune)


def _progress(result: WalkResult) -> None:
    counts = ", ".join(f"{table} {n:,}" for table, n in result.deleted.items())
    rate = sum(result.deleted.values()) / max(result.elapsed_s, 1e-9)
    print(
        f"switchboard prune: {result.walk.owner} ({result.walk.kind}): {counts} so far,"
        f" {result.batches:,} batches, {rate:,.0f} rows/s",
        file=sys.stderr,
        flush=True,
    )


def summarize(results: list[WalkResult]) -> dict[str, dict[str, int]]:
    """Rows by owner (``adapter NAME``, ``queue NAME``) and table."""
    owners: dict[str, dict[str, int]] = {}
    for r in results:
        tables = owners.setdefault(r.walk.owner, {})
        for table in TABLES[r.walk.kind]:
            tables[table] = tables.get(table, 0) + r.deleted.get(table, 0)
    return owners


async def run(settings: Settings, args: argparse.Namespace) -> int:
    found = walks(settings)
    history = partitioned(settings)
    if not found and not history:
        message = (
            "nothing to prune: no retain_* key is set in [[adapters]] or [queues.*], nor [acker]"
            " retain_history_days (rows are kept forever)"
        )
        print(json.dumps({"dry_run": args.dry_run, "owners": {}}) if args.json else message)
        return EXIT_OK
    engine = create_engine(settings.database)
    dropped: dict[str, list[str]] = {}
    try:
        if history and not args.dry_run:
            # Whole partitions first: what they take, no walk need read.
            done = await upkeep_once(engine, settings)
            dropped = {t: [partition_name(t, n) for n in ns] for t, ns in done.dropped.items()}
        pruner = Pruner(
            engine,
            found,
            batch_size=settings.acker.prune_batch_size,
            pause_ms=settings.acker.prune_pause_ms,
            deadline_ms=settings.database.transaction_deadline_ms,
        )
        results = (
            await pruner.run(
                dry_run=args.dry_run, progress=_progress, progress_interval_s=PROGRESS_INTERVAL_S
            )
            if found
            else []
        )
    finally:
        await engine.dispose()
    owners = summarize(results)
    if args.json:
        walked = [
            {
                "owner": r.walk.owner,
                "kind": r.walk.kind,
                "older_than_days": r.walk.age.total_seconds() / 86_400,
                "batches": r.batches,
                "scanned": r.scanned,
                "longest_batch_ms": round(r.longest_batch_s * 1000, 1),
                "elapsed_s": round(r.elapsed_s, 3),
                **r.deleted,
            }
            for r in results
        ]
        print(
            json.dumps(
                {"dry_run": args.dry_run, "owners": owners, "walks": walked, "partitions_dropped": dropped},
                indent=2,
            )
        )
        return EXIT_OK
    for table, names in dropped.items():
        print(f"history: dropped {table} partitions " + ", ".join(names))
    verb = "would delete" if args.dry_run else "deleted"
    for owner, tables in owners.items():
        print(f"{owner}: {verb} " + ", ".join(f"{table} {n}" for table, n in tables.items()))
    return EXIT_OK


VERB = Verb(add_parser, in_loop(run))
