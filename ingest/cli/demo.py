"""``switchboard demo``: the whole pipeline on embedded PostgreSQL and Redis,
no set-up and no config file (the ``embedded`` extra)."""

from __future__ import annotations

import argparse
from collections.abc import Mapping

from ingest.cli.verb import Subparsers, Verb, positive_int
from ingest.config import Settings


def add_parser(verbs: Subparsers, common: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = verbs.add_parser(
        "demo", help="the whole pipeline on embedded PostgreSQL and Redis"
    )
    parser.add_argument("--messages", type=positive_int, default=5000, help="how many messages to produce")
    parser.add_argument(
        "--transport",
        choices=("redis", "nats", "sqs", "amqp"),
        default="redis",
        help="the broker the orders come through: a Redis stream, a NATS JetStream stream on an"
        " embedded nats-server, an SQS queue on an embedded SQS emulator (moto), or a RabbitMQ"
        " queue on a RabbitMQ of its own, from the system's rabbitmq-server package (Debian:"
        " apt-get install rabbitmq-server) (default: redis)",
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
