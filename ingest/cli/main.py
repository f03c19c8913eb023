"""The ``switchboard`` command: parse the arguments, load the settings, run
one verb. Every failure a user can cause, bad arguments included, ends as one
line and an exit code (:mod:`ingest.cli.errors`); nothing a user did shows a
traceback, and nothing shows a password."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import NoReturn

import structlog

from backhalf import failpoints
from backhalf.db import redact_url
from ingest import signals
from ingest.cli import (
    ack,
    adapters,
    demo,
    help_pages,
    inbox,
    migrate,
    prune,
    receive,
    roles,
    status,
    todos,
    trace,
    web,
    worker,
)
from ingest.cli import errors as cli_errors
from ingest.cli import ingest as ingest_verb
from ingest.cli.verb import Verb
from ingest.config import DEFAULT_CONFIG_PATH, Settings, from_mapping, load
from ingest.config.transports import REGISTERED
from ingest.errors import ConfigError
from ingest.exit_codes import EXIT_CONFIG, EXIT_DATABASE, EXIT_FAILURE, EXIT_OK, EXIT_UNHEALTHY
from ingest.observe import logs, transport

# Every verb, one module each, registered one way, in the order `--help` lists them.
VERBS: Mapping[str, Verb] = {
    "migrate": migrate.VERB,
    "ingest": ingest_verb.VERB,
    "ack": ack.VERB,
    "receive": receive.VERB,
    "adapters": adapters.VERB,
    "inbox": inbox.VERB,
    "worker": worker.VERB,
    "todos": todos.VERB,
    "trace": trace.VERB,
    "prune": prune.VERB,
    "status": status.VERB,
    "web": web.VERB,
    "demo": demo.VERB,
}

log = structlog.get_logger("switchboard")

_DESCRIPTION = f"""\
Messages from brokers ({", ".join(REGISTERED)}) and signed webhooks made
durable, deduplicated work in PostgreSQL, and that work done.
`switchboard COMMAND --help` shows a command's options.

exit codes: {EXIT_OK} success or a graceful stop; {EXIT_FAILURE} a failure (the database or
broker out of reach, among others); {EXIT_CONFIG} a config error or bad arguments;
{EXIT_DATABASE} the database refuses for good (not migrated, login refused, no such
database); {EXIT_UNHEALTHY} `status`: an adapter is unhealthy."""


class _Parser(argparse.ArgumentParser):
    """Bad arguments are one line too: what is wrong, and where help is.
    Exit 2, as argparse has it: like a config error, nothing ran."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_CONFIG, f"{self.prog}: {message} (see `{self.prog} --help`)\n")


def _parser() -> argparse.ArgumentParser:
    common = _Parser(add_help=False)
    common.add_argument(
        "--config",
        default=argparse.SUPPRESS,
        help=f"TOML config (default: $SWITCHBOARD_CONFIG or {DEFAULT_CONFIG_PATH})",
    )
    parser = _Parser(
        prog="switchboard",
        parents=[common],
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    version = importlib.metadata.version("switchboard-ingest")
    parser.add_argument("--version", action="version", version=f"%(prog)s {version}")
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="COMMAND")
    for verb in VERBS.values():
        verb.add_parser(verbs, common)
    help_pages.describe(parser)
    return parser


def _settings(args: argparse.Namespace, env: Mapping[str, str]) -> Settings:
    explicit = getattr(args, "config", None) or env.get("SWITCHBOARD_CONFIG")
    path = Path(explicit or DEFAULT_CONFIG_PATH)
    if not explicit and not path.exists() and env.get("SWITCHBOARD_DATABASE_URL"):
        # No file and no adapters: enough for migrate, adapters and status.
        settings = from_mapping({}, env)
    else:
        settings = load(path, env)
    if getattr(args, "metrics_port", None) is not None:
        settings = replace(settings, metrics=replace(settings.metrics, port=args.metrics_port))
    adjust = VERBS[args.verb].adjust
    return settings if adjust is None else adjust(settings, args)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    verb = VERBS[args.verb]
    if not verb.own_signals:
        # Short commands: Ctrl-C and SIGTERM act at once, as usual.
        if signals.stop_requested_early():
            return EXIT_OK
        signals.restore_default_handlers()
    env = os.environ
    logs.configure()
    logs.redact_uncaught_tracebacks()
    if verb.standalone is not None:
        return verb.standalone(args)
    try:
        failpoints.configure(env.get("SWITCHBOARD_FAILPOINTS", ""))
        settings = _settings(args, env)
    except (ConfigError, ValueError) as exc:
        print(f"switchboard: config error: {exc}", file=sys.stderr)
        if verb.process:
            log.error("config_error", error=str(exc))  # noqa: TRY400 - the message is the whole story
        return EXIT_CONFIG
    for notice in settings.notices:
        log.warning("config_key_ignored", notice=notice)
    if verb.process:
        log.info("starting", verb=args.verb, database=redact_url(settings.database.url))
    try:
        if verb.process:  # a warning per server reached without TLS over the network
            transport.warn_plaintext(settings, args.verb, env)
        return verb.run(args, settings, env)
    except Exception as exc:  # noqa: BLE001 - the CLI boundary: every failure ends here
        return _failed(args.verb, settings, exc, roles.role_hint(args))


def _failed(verb: str, settings: Settings, exc: Exception, role_hint: str | None = None) -> int:
    """One line on stderr and the exit code; a bug also logs its traceback
    (redacted, as every log line is)."""
    failure = cli_errors.explain(exc, settings, role_hint)
    if failure is None:
        log.error("unexpected_error", verb=verb, exc_info=exc)
        print(
            f"switchboard {verb}: unexpected {type(exc).__name__}: a bug;"
            " its traceback is in the log line above",
            file=sys.stderr,
        )
        return EXIT_FAILURE
    print(f"switchboard {verb}: {failure.message}", file=sys.stderr)
    if VERBS[verb].process:  # their log lines are what operators ship
        log.error("failed", error=failure.message, exit_code=failure.exit_code)
    return failure.exit_code
