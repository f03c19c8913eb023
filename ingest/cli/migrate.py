"""``switchboard migrate``: upgrade the database to the newest migration."""

from __future__ import annotations

import argparse
from collections.abc import Mapping

import structlog

from backhalf import migrate
from backhalf.db import redact_url
from ingest.cli.verb import Subparsers, Verb
from ingest.config import Settings
from ingest.exit_codes import EXIT_OK

log = structlog.get_logger("switchboard")


def add_parser(verbs: Subparsers, common: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = verbs.add_parser(
        "migrate", parents=[common], help="upgrade the database to the newest migration"
    )
    parser.add_argument(
        "--lock-wait",
        type=_seconds,
        default=migrate.MIGRATION_LOCK_WAIT_MS / 1000,
        metavar="SECONDS",
        help="how long to wait for another migrate's lock before giving up (%(default)g)",
    )
    return parser


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 86_400:
        raise argparse.ArgumentTypeError(f"must be seconds, more than 0 and at most 86400 (got {text!r})")
    return value


def run(args: argparse.Namespace, settings: Settings, env: Mapping[str, str]) -> int:
    migrate.upgrade(settings.database.url, lock_wait_s=args.lock_wait)
    log.info("migrated", database=redact_url(settings.database.url))
    return EXIT_OK


VERB = Verb(add_parser, run)
