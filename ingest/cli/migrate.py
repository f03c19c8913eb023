"""``switchboard migrate``: upgrade the database to the newest migration,
then one pass of the history's partitions (``ingest.processes.ack.partitions``)."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Mapping

import structlog

from backhalf.db import create_engine, redact_url
from backhalf.housekeeping import migrate
from ingest.cli.verb import Subparsers, Verb
from ingest.config import Settings
from ingest.exit_codes import EXIT_OK
from ingest.processes.ack.partitions import upkeep_once

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
    # The history's partitions: the owner's to make and drop, so a daily
    # migrate keeps them where the acker runs as a role that may not.
    asyncio.run(_upkeep(settings))
    return EXIT_OK


async def _upkeep(settings: Settings) -> None:
    engine = create_engine(settings.database)
    try:
        await upkeep_once(engine, settings)
    finally:
        await engine.dispose()


VERB = Verb(add_parser, run)
