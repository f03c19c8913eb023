"""``switchboard inbox list / show / replay``: the inbox rows of rejected and
lost messages, seen whole and re-run once their cause is fixed.

``replay ID...`` replays those rows; ``replay`` with a filter (``--adapter``,
``--since``, ``--until``, ``--error-contains``, or ``--all-rejected`` for
every rejected row) replays the rejected rows it matches, oldest first, at
most ``--limit``, after ``--after-id`` if given (the next page: the hint
printed when more rows match names the id); ``--dry-run`` says what each
would do and writes nothing.
The replays are :mod:`ingest.actions.inbox`, each row its own transaction,
so one that fails leaves the others replayed; this module formats their
outcomes, each row's line as it is done; the exit code is 1 if any failed. A
replay by filter with no filter at all is refused (exit 2): "every rejected
row" is a decision, spelled ``--all-rejected``.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import json
import sys
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from backhalf.db import create_engine
from backhalf.reads import inbox_views
from ingest.actions import inbox as inbox_actions
from ingest.actions.inbox import DEFAULT_REPLAY_LIMIT
from ingest.actions.outcomes import Refused
from ingest.cli.text_table import one_line, printable, table
from ingest.cli.verb import Verb, add_list_and_show, in_loop, positive_int, print_listed
from ingest.config import Settings
from ingest.exit_codes import EXIT_CONFIG, EXIT_FAILURE, EXIT_OK
from ingest.observe import inbox_text

_PROG = "switchboard inbox"
_FILTERS = ("adapter", "since", "until", "error_contains")


def time_bound(text: str) -> datetime | timedelta:
    """``--since`` / ``--until``: :func:`ingest.observe.inbox_text.time_bound`."""
    try:
        return inbox_text.time_bound(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def body_view(body: bytes, *, body_size: int | None, body_sha256: bytes | None) -> inbox_text.BodyView:
    """The body made readable, no terminal control in it."""
    return inbox_text.body_view(body, body_size=body_size, body_sha256=body_sha256, clean=printable)


def add_parser(verbs: Any, common: argparse.ArgumentParser) -> None:
    inbox_cmd = verbs.add_parser(
        "inbox", parents=[common], help="list and show inbox rows; replay rejected ones"
    )
    actions = inbox_cmd.add_subparsers(dest="inbox_verb", required=True, metavar="ACTION")
    add_list_and_show(
        actions,
        common,
        rows="rows",
        row="inbox row",
        listed="recent inbox rows, newest first",
        shown="one inbox row whole: its body and error",
        filters=_list_filters,
    )
    rerun = actions.add_parser(
        "replay", parents=[common], help="re-run rejected messages: by id, or by filter (--dry-run first)"
    )
    rerun.add_argument("ids", nargs="*", type=positive_int, metavar="ID", help="inbox row id")
    rerun.add_argument("--adapter", help="filter: rejected rows of this adapter")
    rerun.add_argument("--since", type=time_bound, metavar="TIME", help="filter: stored at or after (or: 1h)")
    rerun.add_argument("--until", type=time_bound, metavar="TIME", help="filter: stored before (or: 10m)")
    rerun.add_argument("--error-contains", metavar="TEXT", help="filter: error contains TEXT (any case)")
    rerun.add_argument(
        "--all-rejected", action="store_true", help="filter: every rejected row (other filters narrow it)"
    )
    rerun.add_argument(
        "--limit",
        type=positive_int,
        metavar="N",
        help=f"by filter: at most N rows, oldest first ({DEFAULT_REPLAY_LIMIT})",
    )
    rerun.add_argument(
        "--after-id",
        type=positive_int,
        metavar="ID",
        help="by filter: only rows after inbox row ID (the next page: the last id a run examined)",
    )
    rerun.add_argument(
        "--dry-run", action="store_true", help="by filter: say what each would do, change nothing"
    )


def usage_error(args: argparse.Namespace) -> str | None:
    """What is wrong with ``inbox replay``'s arguments, or None: argparse
    cannot say "ids, or a filter, and not neither"."""
    if args.inbox_verb != "replay":
        return None
    by_filter = any(getattr(args, f) is not None for f in _FILTERS) or args.all_rejected
    with_filter = (args.dry_run, args.limit is not None, args.after_id is not None)
    if args.ids and (by_filter or any(with_filter)):
        return (
            "give inbox row ids, or a filter, not both (--dry-run, --limit and --after-id go with a filter)"
        )
    if not args.ids and not by_filter:
        return (
            "no ids and no filter: give inbox row ids, or --adapter, --since, --until,"
            " --error-contains, or --all-rejected to replay every rejected row"
        )
    return None


async def run(settings: Settings, args: argparse.Namespace) -> int:
    problem = usage_error(args)
    if problem is not None:
        prog = f"{_PROG} {args.inbox_verb}"
        print(f"{prog}: {problem} (see `{prog} --help`)", file=sys.stderr)
        return EXIT_CONFIG
    engine = create_engine(settings.database)
    try:
        if args.inbox_verb == "list":
            return await _list(engine, args)
        if args.inbox_verb == "show":
            return await _show(engine, args.id, as_json=args.json)
        if args.ids:
            failed = 0
            for inbox_id in args.ids:
                outcome = await inbox_actions.replay_one(engine, settings, inbox_id)
                failed += isinstance(outcome, Refused)
                _print_replayed(outcome)
            return EXIT_FAILURE if failed else EXIT_OK
        return await _replay_matching(engine, settings, args)
    finally:
        await engine.dispose()


def _list_filters(listing: argparse.ArgumentParser) -> None:
    listing.add_argument("--rejected", action="store_true", help="only rejected (poison, lost) messages")
    listing.add_argument("--unacked", action="store_true", help="only rows whose ack is still pending")
    listing.add_argument("--adapter", help="only this adapter")


async def _list(engine: AsyncEngine, args: argparse.Namespace) -> int:
    wanted = inbox_views.InboxQuery(
        rejected=args.rejected, unacked=args.unacked, adapter=args.adapter, limit=args.limit
    )
    rows = await inbox_actions.listed(engine, wanted)
    print_listed(rows, as_json=args.json, none="no inbox rows match", table=inbox_table)
    return EXIT_OK


def inbox_table(rows: Sequence[inbox_views.InboxRow]) -> list[str]:
    header = ("ID", "STORED_AT (UTC)", "ADAPTER", "STATUS", "ACK", "DELIVERIES", "KEY", "ERROR")
    cells = [
        (
            str(r.id),
            _utc(r.stored_at),
            r.adapter,
            r.status,
            r.ack_state,
            str(r.deliveries),
            printable(r.idempotency_key),
            one_line(r.error),
        )
        for r in rows
    ]
    return table(header, cells, right=frozenset({0, 5}))


# -- replay ----------------------------------------------------------------------


def _print_replayed(outcome: inbox_actions.ReplayOutcome) -> None:
    if isinstance(outcome, Refused):
        print(f"{_PROG}: {outcome.reason}", file=sys.stderr)
    else:
        print(f"inbox row {outcome.inbox_id}: stored, todo {outcome.todo_id}")


def _print_checked(row: inbox_views.InboxRow, outcome: inbox_actions.DryRunOutcome) -> None:
    head = f"inbox row {row.id} ({row.adapter}, stored {_utc(row.stored_at)}, {one_line(row.error)})"
    if isinstance(outcome, inbox_actions.Gone):
        print(f"{head}: gone since it was selected")
    elif isinstance(outcome, inbox_actions.WouldRefuse):
        print(f"{head}: would fail: {outcome.reason}")
    else:
        print(f"{head}: would be stored")


def _print_row(done: inbox_actions.RowOutcome) -> None:
    outcome = done.outcome
    if isinstance(outcome, inbox_actions.Replayed | Refused):
        _print_replayed(outcome)
    else:
        _print_checked(done.row, outcome)


async def _replay_matching(engine: AsyncEngine, settings: Settings, args: argparse.Namespace) -> int:
    where = inbox_views.ReplayFilter(
        adapter=args.adapter,
        since=args.since,
        until=args.until,
        error_contains=args.error_contains,
        after_id=args.after_id,
    )
    selection = await inbox_actions.select_rejected(engine, where, limit=args.limit or DEFAULT_REPLAY_LIMIT)
    rows, limit = selection.rows, selection.limit
    if not rows:
        print("no rejected inbox rows match")
        return EXIT_OK
    if selection.more:
        # The next page starts after the last row taken: re-running without
        # --after-id would take the same oldest rows again, and if they keep
        # failing, never reach the rest.
        print(
            f"more than {limit} rows match: the {limit} oldest are taken (--limit), up to inbox row"
            f" {rows[-1].id}; for the rest, run again with the same filters and --after-id {rows[-1].id}"
        )
    # Each row's line as it is done, not all at the end: an interrupted run
    # has said which rows it replayed.
    report = await inbox_actions.replay_selection(
        engine, settings, selection, dry_run=args.dry_run, on_row=_print_row
    )
    if report.dry_run:
        print(
            f"dry run: {report.matched} rows match, {report.stored} would be stored,"
            f" {report.failed} would fail; nothing was changed"
        )
        return EXIT_OK
    print(
        f"replayed {report.stored} of {report.matched} rows"
        + (f" ({report.failed} failed)" if report.failed else "")
    )
    return EXIT_FAILURE if report.failed else EXIT_OK


# -- show ------------------------------------------------------------------------


async def _show(engine: AsyncEngine, inbox_id: int, *, as_json: bool) -> int:
    row = await inbox_actions.show(engine, inbox_id)
    if row is None:
        print(f"{_PROG} show: inbox row {inbox_id} does not exist", file=sys.stderr)
        return EXIT_FAILURE
    view = body_view(row.body, body_size=row.body_size, body_sha256=row.body_sha256)
    if as_json:
        print(json.dumps(show_document(row, view), indent=2, default=_json_value, ensure_ascii=False))
    else:
        print("\n".join(show_lines(row, view)))
    return EXIT_OK


def show_document(row: inbox_views.InboxDetail, view: inbox_text.BodyView) -> dict[str, Any]:
    fields = {k: v for k, v in dataclasses.asdict(row).items() if k not in ("body", "body_sha256")}
    text = inbox_text.decode(row.body, whole=row.body_size is None)
    return {
        **fields,
        "body_sha256": row.body_sha256.hex() if row.body_sha256 is not None else None,
        "body": {
            "stored_bytes": len(row.body),
            "whole": row.body_size is None,
            "encoding": view.encoding,
            "text": text,
            "base64": base64.b64encode(row.body).decode("ascii"),
        },
    }


def show_lines(row: inbox_views.InboxDetail, view: inbox_text.BodyView) -> list[str]:
    ack = f"{row.ack_kind} {row.ack_key or '-'} {row.ack_group or '-'} {row.ack_entry_id or '-'}"
    fields = (
        ("id", str(row.id)),
        ("adapter", row.adapter),
        ("idempotency_key", row.idempotency_key),
        ("source_message_id", row.source_message_id or "-"),
        ("consumer", row.consumer or "-"),
        ("status", row.status),
        ("deliveries", str(row.deliveries)),
        ("stored_at", _utc(row.stored_at, millis=True) + " UTC"),
        ("ack", f"{ack} (copies {row.ack_copies}, after {row.ack_after})"),
        ("ack_state", row.ack_state),
        ("acked_at", _utc(row.acked_at, millis=True) + " UTC" if row.acked_at else "-"),
        ("todo_id", str(row.todo_id) if row.todo_id is not None else "-"),
        ("event_id", str(row.event_id) if row.event_id is not None else "-"),
        ("error", row.error if row.error is not None else "-"),
    )
    width = max(len(name) for name, _ in fields)
    lines: list[str] = []
    for name, value in fields:
        # Keys, ids and the error can carry text from the message: untrusted.
        first, *more = printable(value).splitlines() or [""]
        lines.append(f"{name.ljust(width)}  {first}".rstrip())
        lines.extend(f"{' ' * width}  {line}".rstrip() for line in more)
    lines.append(f"body: {view.note}")
    lines.extend(f"  {line}".rstrip() for line in view.lines)
    return lines


def _utc(moment: datetime | None, *, millis: bool = False) -> str:
    if moment is None:
        return "-"
    text = moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S.%f" if millis else "%Y-%m-%d %H:%M:%S")
    return text[:-3] if millis else text


def _json_value(value: object) -> str:
    if isinstance(value, datetime):
        return value.astimezone(UTC).isoformat()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


VERB = Verb(add_parser, in_loop(run))
