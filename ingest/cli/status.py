"""``switchboard status [--json]``: per adapter the broker's and the
database's view and a verdict; exit ``EXIT_UNHEALTHY`` when one is unhealthy."""

from __future__ import annotations

import argparse

from ingest.cli.verb import Subparsers, Verb, add_json, in_loop
from ingest.config import Settings
from ingest.errors import ConfigError
from ingest.observe import status
from ingest.observe.logs import redact


def add_parser(verbs: Subparsers, common: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = verbs.add_parser(
        "status", parents=[common], help="backlog, pending acks and todos per adapter"
    )
    add_json(parser)
    return parser


def handler_check(settings: Settings) -> status.HandlerCheck:
    """Whether this Python can import a queue's handler, as a worker would
    (run here only for a queue no worker serves)."""

    def check(queue: str) -> str | None:
        from ingest.processes.workers.worker import resolve_handler  # dramatiq's import, only when asked

        try:
            resolve_handler(settings.queues[queue])
        except ConfigError as exc:
            return str(exc)
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - the user's module failed while it was imported
            return redact(f"[queues.{queue}]: importing its handler raised {type(exc).__name__}")
        return None

    return check


async def run(settings: Settings, args: argparse.Namespace) -> int:
    procs = await status.collect_processes(settings)
    report = await status.collect(settings, procs, handler_check(settings))
    print(status.render(report, args.json, procs))
    return status.exit_code(report, procs)


VERB = Verb(add_parser, in_loop(run))
