"""The ``switchboard`` command (DESIGN.md section 7, a contract)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.metadata
import json
import os
import sys
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path

import structlog

from backhalf import db_errors, failpoints, migrate, registry, replay
from backhalf.db import create_engine, redact_url
from backhalf.normalize import body_payload
from ingest import logs, registered, signals, status
from ingest.acker import run_acker
from ingest.adapters.base import FAMILY, TRUST_MODE
from ingest.config import DEFAULT_CONFIG_PATH, DEFAULT_REDIS_URL, Settings, from_mapping, load
from ingest.errors import ConfigError
from ingest.exit_codes import EXIT_CONFIG, EXIT_DATABASE, EXIT_FAILURE, EXIT_OK
from ingest.ingester import run_ingester
from ingest.lifecycle import leftover_tasks
from ingest.signals import stop_on_signals

log = structlog.get_logger("switchboard")


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--config",
        default=argparse.SUPPRESS,
        help=f"TOML config (default: $SWITCHBOARD_CONFIG or {DEFAULT_CONFIG_PATH})",
    )
    parser = argparse.ArgumentParser(prog="switchboard", parents=[common], description=__doc__)
    version = importlib.metadata.version("switchboard-ingest")
    parser.add_argument("--version", action="version", version=f"%(prog)s {version}")
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="COMMAND")
    verbs.add_parser("migrate", parents=[common], help="upgrade the database to the newest migration")
    ingest = verbs.add_parser("ingest", parents=[common], help="run the ingester (a poll loop per adapter)")
    ingest.add_argument(
        "--consumer", help="consumer name for every adapter (default: config, else host name)"
    )
    verbs.add_parser("ack", parents=[common], help="run the acker (committed ack intents -> broker)")
    adapters = verbs.add_parser("adapters", parents=[common], help="list, enable or disable adapters")
    adapter_verbs = adapters.add_subparsers(dest="adapters_verb", required=True, metavar="ACTION")
    adapter_verbs.add_parser("list", parents=[common], help="registered adapters and their flag")
    for action in ("enable", "disable"):
        p = adapter_verbs.add_parser(action, parents=[common], help=f"{action} an adapter at runtime")
        p.add_argument("name")
    inbox_cmd = verbs.add_parser("inbox", parents=[common], help="list inbox rows; replay rejected ones")
    inbox_verbs = inbox_cmd.add_subparsers(dest="inbox_verb", required=True, metavar="ACTION")
    listing = inbox_verbs.add_parser("list", parents=[common], help="recent inbox rows, newest first")
    listing.add_argument("--rejected", action="store_true", help="only rejected (poison, lost) messages")
    listing.add_argument("--unacked", action="store_true", help="only rows whose ack is still pending")
    listing.add_argument("--adapter", help="only this adapter")
    listing.add_argument("--limit", type=int, default=50)
    listing.add_argument("--json", action="store_true", help="machine-readable output")
    rerun = inbox_verbs.add_parser("replay", parents=[common], help="re-run rejected messages")
    rerun.add_argument("ids", nargs="+", type=int, metavar="ID", help="inbox row id")
    st = verbs.add_parser("status", parents=[common], help="backlog, pending acks and todos per adapter")
    st.add_argument("--json", action="store_true", help="machine-readable output")
    demo = verbs.add_parser("demo", help="the whole pipeline on embedded PostgreSQL and Redis")
    demo.add_argument("--messages", type=int, default=5000, help="how many messages to produce")
    return parser


def _settings(args: argparse.Namespace, env: Mapping[str, str]) -> Settings:
    explicit = getattr(args, "config", None) or env.get("SWITCHBOARD_CONFIG")
    path = Path(explicit or DEFAULT_CONFIG_PATH)
    if not explicit and not path.exists() and env.get("SWITCHBOARD_DATABASE_URL"):
        # No file and no adapters: enough for migrate, adapters and status.
        settings = from_mapping({}, env)
    else:
        settings = load(path, env)
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


async def _adapters_command(settings: Settings, args: argparse.Namespace) -> int:
    engine = create_engine(settings.database)
    try:
        async with engine.begin() as conn:
            if args.adapters_verb == "list":
                rows = await registry.list_adapters(conn)
                if not rows:
                    print("no adapters registered (start `switchboard ingest` once)")
                for r in rows:
                    state = "enabled" if r.enabled else "disabled"
                    kind = f"{r.family}/{r.transport}/{r.mode}"
                    print(f"{r.name:<24} {state:<9} {kind:<18} {r.settings.get('source')}")
                return EXIT_OK
            enabled = args.adapters_verb == "enable"
            if not await registry.set_enabled(conn, args.name, enabled):
                print(f"switchboard: no adapter named {args.name!r} is registered", file=sys.stderr)
                return EXIT_FAILURE
            print(f"{args.name}: {'enabled' if enabled else 'disabled'}")
            return EXIT_OK
    finally:
        await engine.dispose()


async def _inbox_command(settings: Settings, args: argparse.Namespace) -> int:
    engine = create_engine(settings.database)
    try:
        if args.inbox_verb == "list":
            async with engine.connect() as conn:
                rows = await replay.list_rows(
                    conn, rejected=args.rejected, unacked=args.unacked, adapter=args.adapter, limit=args.limit
                )
            if args.json:
                print(json.dumps([dataclasses.asdict(r) for r in rows], indent=2, default=str))
            for r in [] if args.json else rows:
                print(
                    f"{r.id:>10} {r.adapter:<16} {r.status:<9} ack={r.ack_state:<8} "
                    f"deliveries={r.deliveries:<3} {r.idempotency_key}  {r.error or ''}"
                )
            return EXIT_OK
        failed = 0
        for inbox_id in args.ids:
            try:
                async with engine.begin() as conn:
                    todo_id = await replay.replay(
                        conn,
                        inbox_id,
                        queue_for=lambda name: settings.adapter(name).queue,
                        normalize_for=lambda name: _normalizer(settings, name),
                        family=FAMILY,  # every configured adapter is a pull adapter
                        trust_mode=TRUST_MODE,
                    )
            except (replay.ReplayError, ConfigError) as exc:
                failed += 1
                print(f"switchboard: inbox row {inbox_id}: {exc}", file=sys.stderr)
            else:
                print(f"inbox row {inbox_id}: stored, todo {todo_id}")
        return EXIT_FAILURE if failed else EXIT_OK
    finally:
        await engine.dispose()


def _normalizer(settings: Settings, adapter: str) -> replay.Normalizer:
    cfg = settings.adapter(adapter)
    # The adapter's current rules, schema included: a replay after the schema
    # was fixed checks against the fixed one.
    return lambda body: body_payload(body, cfg.format, cfg.max_message_bytes, cfg.body_schema)


async def _status_command(settings: Settings, as_json: bool, broker_url: str) -> int:
    report = await status.collect(settings, broker_url)
    print(status.render(report, as_json))
    return status.exit_code(report)


def _until_stopped(verb: str, body: Callable[[asyncio.Event], Awaitable[None]]) -> int:
    """``_run``; a permanent database error at start-up is one line and EXIT_DATABASE."""
    try:
        return _run(body)
    except db_errors.DatabaseUnusable as exc:
        print(f"switchboard {verb}: {exc.problem.message}", file=sys.stderr)
        problem = exc.problem
        # The message is the whole story: no traceback.
        log.error("database_unusable", kind=problem.kind, sqlstate=problem.sqlstate, error=str(exc))  # noqa: TRY400
        return EXIT_DATABASE


def _registered_broker_url(settings: Settings, env: Mapping[str, str]) -> str:
    """The broker of adapters known only from the adapters table (``ack`` and
    ``status`` with no adapters configured); checked only then."""
    return registered.broker_url(env) if not settings.adapters else DEFAULT_REDIS_URL


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.verb not in ("ingest", "ack"):
        # Short commands: Ctrl-C and SIGTERM act at once, as usual.
        if signals.stop_requested_early():
            return EXIT_OK
        signals.restore_default_handlers()
    env = os.environ
    logs.configure()
    if args.verb == "demo":
        from ingest.embedded.demo import run as run_demo  # embedded servers are an optional extra

        return run_demo(messages=args.messages)
    try:
        failpoints.configure(env.get("SWITCHBOARD_FAILPOINTS", ""))
        settings = _settings(args, env)
    except (ConfigError, ValueError) as exc:
        print(f"switchboard: config error: {exc}", file=sys.stderr)
        log.error("config_error", error=str(exc))  # noqa: TRY400 - the message is the whole story
        return EXIT_CONFIG
    log.info("starting", verb=args.verb, database=redact_url(settings.database.url))
    if args.verb == "migrate":
        migrate.upgrade(settings.database.url)
        log.info("migrated")
        return EXIT_OK
    if args.verb in ("ack", "status"):
        try:
            broker_url = _registered_broker_url(settings, env)
        except ConfigError as exc:
            print(f"switchboard: config error: {exc}", file=sys.stderr)
            log.error("config_error", error=str(exc))  # noqa: TRY400 - the message is the whole story
            return EXIT_CONFIG
    if args.verb == "ingest":
        return _until_stopped("ingest", lambda stop: run_ingester(settings, stop))
    if args.verb == "ack":
        return _until_stopped("ack", lambda stop: run_acker(settings, stop, broker_url=broker_url))
    if args.verb == "adapters":
        return asyncio.run(_adapters_command(settings, args))
    if args.verb == "status":
        return asyncio.run(_status_command(settings, args.json, broker_url))
    if args.verb == "inbox":
        return asyncio.run(_inbox_command(settings, args))
    raise AssertionError(f"unhandled verb {args.verb}")
