"""``switchboard ingest``: the ingester, a poll loop per adapter."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import replace

from ingest.cli.running import run_until_stopped
from ingest.cli.verb import Subparsers, Verb, add_metrics_port
from ingest.config import Settings
from ingest.errors import ConfigError


def add_parser(verbs: Subparsers, common: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = verbs.add_parser(
        "ingest", parents=[common], help="run the ingester (a poll loop per adapter)"
    )
    parser.add_argument(
        "--consumer", help="consumer name for every adapter (default: config, else host name)"
    )
    add_metrics_port(parser)
    return parser


def adjust(settings: Settings, args: argparse.Namespace) -> Settings:
    if not settings.adapters:
        served = " (webhook adapters are served by `switchboard receive`)" if settings.webhooks else ""
        raise ConfigError(f"[[adapters]]: `switchboard ingest` needs at least one adapter{served}")
    if args.consumer:
        consumer = args.consumer
        settings = replace(settings, adapters=tuple(replace(a, consumer=consumer) for a in settings.adapters))
    return settings


def run(args: argparse.Namespace, settings: Settings, env: Mapping[str, str]) -> int:
    from ingest.processes.pull.ingester import run_ingester  # the ingester's modules: this verb's alone

    return run_until_stopped("ingest", settings, lambda stop: run_ingester(settings, stop))


VERB = Verb(add_parser, run, process=True, own_signals=True, adjust=adjust)
