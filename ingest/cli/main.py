"""The ``switchboard`` command: parse the arguments, load the settings, run
one verb. Every failure a user can cause, bad arguments included, ends as one
line and an exit code (:mod:`ingest.cli.errors`); nothing a user did shows a
traceback, and nothing shows a password."""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import os
import sys
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import NoReturn

import structlog

from backhalf import db_errors, failpoints, migrate
from backhalf.db import redact_url
from ingest import signals
from ingest.cli import adapters as adapters_command
from ingest.cli import errors as cli_errors
from ingest.cli import inbox as inbox_command
from ingest.cli import prune as prune_command
from ingest.cli import todos as todos_command
from ingest.cli import trace as trace_command
from ingest.config import DEFAULT_CONFIG_PATH, Settings, from_mapping, load
from ingest.errors import ConfigError
from ingest.exit_codes import EXIT_CONFIG, EXIT_DATABASE, EXIT_FAILURE, EXIT_OK, EXIT_UNHEALTHY
from ingest.lifecycle import leftover_tasks
from ingest.observe import logs, status
from ingest.processes.acker import run_acker
from ingest.processes.ingester import run_ingester
from ingest.signals import stop_on_signals

log = structlog.get_logger("switchboard")

_DESCRIPTION = f"""\
Messages from Redis made durable, deduplicated work in PostgreSQL.
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


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"must be a positive integer (got {text!r})") from exc
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer (got {text!r})")
    return value


def _port(text: str) -> int:
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"must be a port, 0..65535 (got {text!r})")
    return int(text)


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
    verbs.add_parser("migrate", parents=[common], help="upgrade the database to the newest migration")
    ingest = verbs.add_parser("ingest", parents=[common], help="run the ingester (a poll loop per adapter)")
    ingest.add_argument(
        "--consumer", help="consumer name for every adapter (default: config, else host name)"
    )
    acker = verbs.add_parser("ack", parents=[common], help="run the acker (committed ack intents -> broker)")
    adapters_command.add_parser(verbs, common)
    inbox_command.add_parser(verbs, common, _positive_int)
    worker = verbs.add_parser("worker", parents=[common], help="run dramatiq workers for the todos")
    worker.add_argument("--processes", type=_positive_int, default=2, help="worker processes (2)")
    worker.add_argument("--threads", type=_positive_int, default=8, help="threads per process (8)")
    worker.add_argument(
        "--queues", nargs="+", default=[], metavar="QUEUE", help="only these [queues.*] (default: all)"
    )
    for process in (ingest, acker, worker):
        process.add_argument(
            "--metrics-port",
            type=_port,
            metavar="PORT",
            help="this process's /metrics and /healthz port, over [metrics] port (0: off)",
        )
    todos_command.add_parser(verbs, common, _positive_int)
    trace_command.add_parser(verbs, common, _positive_int)
    prune_command.add_parser(verbs, common)
    st = verbs.add_parser("status", parents=[common], help="backlog, pending acks and todos per adapter")
    st.add_argument("--json", action="store_true", help="machine-readable output")
    demo = verbs.add_parser("demo", help="the whole pipeline on embedded PostgreSQL and Redis")
    demo.add_argument("--messages", type=_positive_int, default=5000, help="how many messages to produce")
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
    if args.verb == "ingest":
        if not settings.adapters:
            raise ConfigError("[[adapters]]: `switchboard ingest` needs at least one adapter")
        if args.consumer:
            consumer = args.consumer
            settings = replace(
                settings, adapters=tuple(replace(a, consumer=consumer) for a in settings.adapters)
            )
    return settings


def _run(coro_fn: Callable[[asyncio.Event], Awaitable[None]]) -> int:
    """Run a long-lived process body until SIGTERM/SIGINT; check nothing leaks."""

    async def main() -> int:
        stop = asyncio.Event()
        with stop_on_signals(stop):
            await coro_fn(stop)
        leaked = leftover_tasks()
        if leaked:
            log.error("tasks_leaked", tasks=leaked)
            return EXIT_FAILURE
        return EXIT_OK

    code = asyncio.run(main())
    threads = [t.name for t in threading.enumerate() if t is not threading.main_thread() and t.is_alive()]
    if threads:
        log.error("threads_leaked", threads=threads)
        return EXIT_FAILURE
    return code


async def _status_command(settings: Settings, as_json: bool) -> int:
    procs = await status.collect_processes(settings)
    report = await status.collect(settings, procs)
    print(status.render(report, as_json, procs))
    return status.exit_code(report, procs)


def _until_stopped(verb: str, settings: Settings, body: Callable[[asyncio.Event], Awaitable[None]]) -> int:
    """``_run``; a permanent database error at start-up is one line naming the
    database, as the short commands' are, and EXIT_DATABASE."""
    try:
        return _run(body)
    except db_errors.DatabaseUnusable as exc:
        target = cli_errors.database_target(settings)
        print(f"switchboard {verb}: {exc.problem.message} [{target}]", file=sys.stderr)
        problem = exc.problem
        # The message is the whole story: no traceback.
        log.error("database_unusable", kind=problem.kind, sqlstate=problem.sqlstate, error=str(exc))  # noqa: TRY400
        return EXIT_DATABASE


# Processes whose stderr is a log (JSON lines, shipped): they log their
# start and their failure as events. A short command's failure is its one line.
_LONG_RUNNING = ("ingest", "ack", "worker")


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.verb not in ("ingest", "ack"):
        # Short commands: Ctrl-C and SIGTERM act at once, as usual.
        if signals.stop_requested_early():
            return EXIT_OK
        signals.restore_default_handlers()
    env = os.environ
    logs.configure()
    logs.redact_uncaught_tracebacks()
    if args.verb == "demo":
        from ingest.embedded.demo import run as run_demo  # embedded servers are an optional extra

        return run_demo(messages=args.messages)
    try:
        failpoints.configure(env.get("SWITCHBOARD_FAILPOINTS", ""))
        settings = _settings(args, env)
    except (ConfigError, ValueError) as exc:
        print(f"switchboard: config error: {exc}", file=sys.stderr)
        if args.verb in _LONG_RUNNING:
            log.error("config_error", error=str(exc))  # noqa: TRY400 - the message is the whole story
        return EXIT_CONFIG
    if args.verb in _LONG_RUNNING:
        log.info("starting", verb=args.verb, database=redact_url(settings.database.url))
    try:
        return _dispatch(args, settings, env)
    except Exception as exc:  # noqa: BLE001 - the CLI boundary: every failure ends here
        return _failed(args.verb, settings, exc)


def _failed(verb: str, settings: Settings, exc: Exception) -> int:
    """One line on stderr and the exit code; a bug also logs its traceback
    (redacted, as every log line is)."""
    failure = cli_errors.explain(exc, settings)
    if failure is None:
        log.error("unexpected_error", verb=verb, exc_info=exc)
        print(
            f"switchboard {verb}: unexpected {type(exc).__name__}: a bug;"
            " its traceback is in the log line above",
            file=sys.stderr,
        )
        return EXIT_FAILURE
    print(f"switchboard {verb}: {failure.message}", file=sys.stderr)
    if verb in _LONG_RUNNING:  # their log lines are what operators ship
        log.error("failed", error=failure.message, exit_code=failure.exit_code)
    return failure.exit_code


def _dispatch(args: argparse.Namespace, settings: Settings, env: Mapping[str, str]) -> int:
    if args.verb == "migrate":
        migrate.upgrade(settings.database.url)
        log.info("migrated", database=redact_url(settings.database.url))
        return EXIT_OK
    if args.verb == "ingest":
        return _until_stopped("ingest", settings, lambda stop: run_ingester(settings, stop))
    if args.verb == "ack":
        return _until_stopped("ack", settings, lambda stop: run_acker(settings, stop))
    if args.verb == "adapters":
        return asyncio.run(adapters_command.run(settings, args))
    if args.verb == "status":
        return asyncio.run(_status_command(settings, args.json))
    if args.verb == "inbox":
        return asyncio.run(inbox_command.run(settings, args))
    if args.verb == "todos":
        return asyncio.run(todos_command.run(settings, args))
    if args.verb == "trace":
        return asyncio.run(trace_command.run(settings, args))
    if args.verb == "prune":
        return asyncio.run(prune_command.run(settings, args))
    if args.verb == "worker":
        from ingest.processes.worker import exec_workers  # dramatiq: only for this verb

        path = Path(getattr(args, "config", None) or env.get("SWITCHBOARD_CONFIG") or DEFAULT_CONFIG_PATH)
        exec_workers(path, settings, processes=args.processes, threads=args.threads, queues=args.queues)
    raise AssertionError(f"unhandled verb {args.verb}")
