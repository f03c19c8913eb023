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
    return parser


def run(args: argparse.Namespace, settings: Settings, env: Mapping[str, str]) -> int:
    migrate.upgrade(settings.database.url)
    log.info("migrated", database=redact_url(settings.database.url))
    return EXIT_OK


VERB = Verb(add_parser, run)
