"""``switchboard worker``: dramatiq workers for the todos (dramatiq's own
CLI takes this process over, with its processes, threads and signals)."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path

from ingest.cli.verb import Subparsers, Verb, add_metrics_port, positive_int
from ingest.config import DEFAULT_CONFIG_PATH, Settings


def add_parser(verbs: Subparsers, common: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = verbs.add_parser(
        "worker", parents=[common], help="run dramatiq workers for the todos (claimed from PostgreSQL)"
    )
    parser.add_argument("--processes", type=positive_int, default=2, help="worker processes (2)")
    parser.add_argument("--threads", type=positive_int, default=8, help="threads per process (8)")
    parser.add_argument(
        "--queues", nargs="+", default=[], metavar="QUEUE", help="only these [queues.*] (default: all)"
    )
    add_metrics_port(parser)
    return parser


def run(args: argparse.Namespace, settings: Settings, env: Mapping[str, str]) -> int:
    from ingest.processes.workers.worker import exec_workers  # dramatiq: only for this verb

    path = Path(getattr(args, "config", None) or env.get("SWITCHBOARD_CONFIG") or DEFAULT_CONFIG_PATH)
    exec_workers(path, settings, processes=args.processes, threads=args.threads, queues=args.queues)
    raise AssertionError("exec_workers returned")  # it replaces this process


# Long-running, but its signals are dramatiq's (the process is exec'd).
VERB = Verb(add_parser, run, process=True)
