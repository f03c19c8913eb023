"""``switchboard ack``: the acker, committed ack intents to the broker; and
the rescuer, todos whose worker died put back."""

from __future__ import annotations

import argparse
from collections.abc import Mapping

from ingest.cli.running import run_until_stopped
from ingest.cli.verb import Subparsers, Verb, add_metrics_port
from ingest.config import Settings


def add_parser(verbs: Subparsers, common: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = verbs.add_parser(
        "ack",
        parents=[common],
        help="run the acker (committed ack intents -> broker; lapsed claims put back)",
    )
    add_metrics_port(parser)
    return parser


def run(args: argparse.Namespace, settings: Settings, env: Mapping[str, str]) -> int:
    from ingest.processes.ack.acker import run_acker  # the acker's modules: this verb's alone

    return run_until_stopped("ack", settings, lambda stop: run_acker(settings, stop))


VERB = Verb(add_parser, run, process=True, own_signals=True)
