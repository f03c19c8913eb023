"""``switchboard demo``: the whole pipeline on embedded servers, no set-up
and no config file (the ``embedded`` extra)."""

from __future__ import annotations

import argparse
from collections.abc import Mapping

from ingest.cli.verb import Subparsers, Verb, positive_int
from ingest.config import Settings
from ingest.config.transports import REGISTERED


def add_parser(verbs: Subparsers, common: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = verbs.add_parser("demo", help="the whole pipeline on embedded servers")
    parser.add_argument("--messages", type=positive_int, default=5000, help="how many messages to produce")
    parser.add_argument(
        "--transport",
        choices=REGISTERED,
        default=REGISTERED[0],
        help="the transport the orders come through, on a server of the demo's own (one that comes"
        " from a system package says how to get it when it is missing) (default: %(default)s)",
    )
    parser.add_argument(
        "--trace",
        action="store_true",
        help="trace one order from its producer to the handler with OpenTelemetry (a collector of the"
        " demo's own, over OTLP/HTTP) and print its spans",
    )
    return parser


def standalone(args: argparse.Namespace) -> int:
    from ingest.embedded.demo import run as run_demo  # embedded servers are an optional extra

    return run_demo(messages=args.messages, transport=args.transport, trace=args.trace)


def run(args: argparse.Namespace, settings: Settings, env: Mapping[str, str]) -> int:
    return standalone(args)


VERB = Verb(add_parser, run, standalone=standalone)
