"""``switchboard receive``: the push ingester, an HTTP server for the
webhook adapters (DESIGN.md section 12)."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import replace

from ingest.cli.running import run_until_stopped
from ingest.cli.verb import Subparsers, Verb, add_metrics_port
from ingest.config import Settings
from ingest.config.webhook import check_listen
from ingest.errors import ConfigError

HTTP_PACKAGES = ("starlette", "uvicorn", "h11", "anyio")  # the `http` extra's


def missing_extra(
    exc: ImportError, packages: tuple[str, ...], verb: str, needs: str, extra: str
) -> ConfigError:
    """A verb's install extra missing, as the config error that says which
    to install; any other ImportError (a bug, or a broken install) is raised
    as it is."""
    if exc.name not in packages:
        raise exc
    return ConfigError(
        f"switchboard {verb} needs {needs} ({exc.name or exc}): pip install 'switchboard-ingest[{extra}]'"
    )


def listen_argument(text: str) -> str:
    """A ``--listen HOST:PORT`` argument, checked."""
    try:
        return check_listen("--listen", text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--listen ")) from exc


def add_parser(verbs: Subparsers, common: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = verbs.add_parser(
        "receive", parents=[common], help="run the webhook receiver (POST /hooks/{adapter})"
    )
    parser.add_argument("--listen", type=listen_argument, metavar="HOST:PORT", help="over [receiver] listen")
    add_metrics_port(parser)
    return parser


def adjust(settings: Settings, args: argparse.Namespace) -> Settings:
    if args.listen:
        settings = replace(settings, receiver=replace(settings.receiver, listen=args.listen))
    return settings


def run(args: argparse.Namespace, settings: Settings, env: Mapping[str, str]) -> int:
    # Imported here: Starlette and uvicorn are the receiver's alone (the
    # `http` extra).
    try:
        from ingest.processes.push.receiver import run_receiver
    except ImportError as exc:
        raise missing_extra(exc, HTTP_PACKAGES, "receive", "its HTTP server", "http") from exc

    return run_until_stopped("receive", settings, lambda stop: run_receiver(settings, stop, env=env))


VERB = Verb(add_parser, run, process=True, own_signals=True, adjust=adjust)
