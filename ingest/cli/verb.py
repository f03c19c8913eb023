"""What a verb of the ``switchboard`` command is, and the argument types
verbs share. Every verb is a module of ``ingest.cli`` that defines ``VERB``;
``ingest.cli.main`` registers them all one way and dispatches by name."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ingest.config import Settings

# argparse's subparsers action: its type is private to argparse.
Subparsers = Any
AddParser = Callable[[Subparsers, argparse.ArgumentParser], object]
Run = Callable[[argparse.Namespace, Settings, Mapping[str, str]], int]


@dataclass(frozen=True, slots=True)
class Verb:
    """``add_parser`` adds the verb's subparser (``common`` carries --config);
    ``run`` runs it with the settings loaded and returns the
    exit code.

    ``process``: a long-running process, whose stderr is a log: it logs its
    start and its failure as events (a short command's failure is its one
    line). ``own_signals``: SIGTERM and SIGINT are turned into a graceful
    stop (``ingest``, ``ack``); every other verb restores the default
    handlers, so Ctrl-C acts at once (``worker`` is taken over by dramatiq's
    CLI, which handles its own). ``adjust``: the verb's own check or change
    of the loaded settings (its flags over the file's). ``standalone``: a
    verb that needs no settings (``demo``) runs this instead of ``run``."""

    add_parser: AddParser
    run: Run
    process: bool = False
    own_signals: bool = False
    adjust: Callable[[Settings, argparse.Namespace], Settings] | None = None
    standalone: Callable[[argparse.Namespace], int] | None = None


def in_loop(run: Callable[[Settings, argparse.Namespace], Coroutine[Any, Any, int]]) -> Run:
    """A verb whose work is one coroutine, run on a loop of its own."""

    def verb(args: argparse.Namespace, settings: Settings, env: Mapping[str, str]) -> int:
        return asyncio.run(run(settings, args))

    return verb


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"must be a positive integer (got {text!r})") from exc
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer (got {text!r})")
    return value


def add_json(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def add_list_and_show(
    actions: Subparsers,
    common: argparse.ArgumentParser,
    *,
    rows: str,
    row: str,
    listed: str,
    shown: str,
    filters: Callable[[argparse.ArgumentParser], None],
) -> None:
    """A read verb's ``list [FILTERS] [--limit N] [--json]`` (newest first,
    ``listed`` its help, ``filters`` adding its own options) and ``show ID
    [--json]`` (one ``row`` whole, ``shown``)."""
    listing = actions.add_parser("list", parents=[common], help=listed)
    filters(listing)
    listing.add_argument("--limit", type=positive_int, default=50, help=f"at most this many {rows} (50)")
    add_json(listing)
    show = actions.add_parser("show", parents=[common], help=shown)
    show.add_argument("id", type=positive_int, metavar="ID", help=f"{row} id")
    add_json(show)


def print_listed(
    rows: Sequence[Any],
    *,
    as_json: bool,
    none: str,
    table: Callable[[Sequence[Any]], list[str]],
    json_value: Callable[[object], str] = str,
) -> None:
    """A ``list`` verb's rows (dataclasses): as JSON, as a table, or
    ``none`` when there are none."""
    if as_json:
        print(json.dumps([dataclasses.asdict(r) for r in rows], indent=2, default=json_value))
    elif not rows:
        print(none)
    else:
        print("\n".join(table(rows)))


def port(text: str) -> int:
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"must be a port, 0..65535 (got {text!r})")
    return int(text)


def add_metrics_port(parser: argparse.ArgumentParser) -> None:
    """The long-running processes' own endpoint port, over ``[metrics] port``."""
    parser.add_argument(
        "--metrics-port",
        type=port,
        metavar="PORT",
        help="this process's /metrics and /healthz port, over [metrics] port (0: off)",
    )
