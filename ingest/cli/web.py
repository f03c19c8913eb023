"""``switchboard web [--listen HOST:PORT] [--read-only]``: the operator
console (DESIGN.md section 13), a long-running process like ``receive``."""

from __future__ import annotations

import argparse
from collections.abc import Mapping

from ingest.cli.receive import HTTP_PACKAGES, listen_argument, missing_extra
from ingest.cli.running import run_until_stopped
from ingest.cli.verb import Subparsers, Verb, add_metrics_port
from ingest.config import Settings

DEFAULT_LISTEN = "127.0.0.1:8089"  # ingest.web.server's (not imported here: the `web` extra's)
WEB_PACKAGES = (*HTTP_PACKAGES, "jinja2", "markupsafe")


def add_parser(verbs: Subparsers, common: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = verbs.add_parser(
        "web",
        parents=[common],
        help="run the operator console (a browser's view of adapters, trails, inbox, todos, processes)",
    )
    parser.add_argument(
        "--listen",
        type=listen_argument,
        default=DEFAULT_LISTEN,
        metavar="HOST:PORT",
        help=f"where to serve, in plain HTTP (default {DEFAULT_LISTEN}: loopback, with a TLS-terminating"
        " proxy in front); an address off loopback needs SWITCHBOARD_WEB_TOKEN",
    )
    parser.add_argument(
        "--read-only", action="store_true", help="show no actions and refuse every POST (403)"
    )
    add_metrics_port(parser)
    return parser


def run(args: argparse.Namespace, settings: Settings, env: Mapping[str, str]) -> int:
    # Imported here: Starlette, uvicorn and Jinja2 are the console's (the `web` extra).
    try:
        from ingest.web.server import WebOptions, run_web
    except ImportError as exc:
        raise missing_extra(exc, WEB_PACKAGES, "web", "its HTTP server and templates", "web") from exc

    options = WebOptions(listen=args.listen, read_only=args.read_only)
    return run_until_stopped("web", settings, lambda stop: run_web(settings, stop, options, env=env))


VERB = Verb(add_parser, run, process=True, own_signals=True)
