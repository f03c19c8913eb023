"""``switchboard adapters list / enable / disable``: the registered adapters
and their runtime flag (:mod:`ingest.actions.adapters` acts; this formats)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from backhalf.db import create_engine
from backhalf.writes.registry import AdapterRow
from ingest.actions import adapters as actions
from ingest.actions.outcomes import Refused
from ingest.cli.text_table import table
from ingest.cli.verb import Verb, in_loop
from ingest.config import Settings
from ingest.exit_codes import EXIT_FAILURE, EXIT_OK

_PROG = "switchboard adapters"


def add_parser(verbs: Any, common: argparse.ArgumentParser) -> None:
    adapters = verbs.add_parser("adapters", parents=[common], help="list, enable or disable adapters")
    adapter_verbs = adapters.add_subparsers(dest="adapters_verb", required=True, metavar="ACTION")
    adapter_verbs.add_parser("list", parents=[common], help="registered adapters and their flag")
    for action in ("enable", "disable"):
        p = adapter_verbs.add_parser(action, parents=[common], help=f"{action} an adapter at runtime")
        p.add_argument("name")


async def run(settings: Settings, args: argparse.Namespace) -> int:
    engine = create_engine(settings.database)
    try:
        if args.adapters_verb == "list":
            return _print_list(await actions.list_adapters(engine))
        outcome = await actions.set_enabled(engine, args.name, args.adapters_verb == "enable")
    finally:
        await engine.dispose()
    if isinstance(outcome, Refused):
        print(f"{_PROG}: {outcome.reason}", file=sys.stderr)
        return EXIT_FAILURE
    print(f"{outcome.name}: {'enabled' if outcome.enabled else 'disabled'}")
    return EXIT_OK


def _print_list(rows: Sequence[AdapterRow]) -> int:
    if not rows:
        print("no adapters registered (start `switchboard ingest` once)")
        return EXIT_OK
    cells = [
        (
            r.name,
            "enabled" if r.enabled else "disabled",
            f"{r.family}/{r.transport}/{r.mode}",
            str(r.settings.get("source")),
        )
        for r in rows
    ]
    print("\n".join(table(("NAME", "STATE", "KIND", "SOURCE"), cells)))
    return EXIT_OK


VERB = Verb(add_parser, in_loop(run))
