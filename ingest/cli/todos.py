"""``switchboard todos list / show / retry / cancel``: the operators' view of
the todos and their ``todo_events`` history, and their two actions.

Retry and cancel are :mod:`ingest.actions.todos`, one transaction per id;
this module formats their outcomes. A refused id is one line on stderr
naming it and why; the others go ahead; the exit code is 1 if any was
refused.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from backhalf.db import create_engine
from backhalf.reads import todo_views
from ingest.actions import todos as todo_actions
from ingest.actions.outcomes import Refused
from ingest.cli.text_table import one_line, printable, table
from ingest.cli.verb import Verb, add_list_and_show, in_loop, positive_int, print_listed
from ingest.config import Settings
from ingest.exit_codes import EXIT_FAILURE, EXIT_OK
from schema import TODO_STATUSES

_PROG = "switchboard todos"


def add_parser(verbs: Any, common: argparse.ArgumentParser) -> None:
    todos_cmd = verbs.add_parser("todos", parents=[common], help="list and show todos; retry or cancel them")
    actions = todos_cmd.add_subparsers(dest="todos_verb", required=True, metavar="ACTION")
    add_list_and_show(
        actions,
        common,
        rows="todos",
        row="todo",
        listed="todos, newest first",
        shown="one todo and its todo_events history",
        filters=_list_filters,
    )
    retry = actions.add_parser(
        "retry", parents=[common], help="make failed or cancelled todos pending again, attempts reset"
    )
    retry.add_argument("ids", nargs="+", type=positive_int, metavar="ID", help="todo id")
    cancel = actions.add_parser("cancel", parents=[common], help="cancel pending or running todos")
    cancel.add_argument("ids", nargs="+", type=positive_int, metavar="ID", help="todo id")


async def run(settings: Settings, args: argparse.Namespace) -> int:
    engine = create_engine(settings.database)
    try:
        if args.todos_verb == "list":
            return await _list(engine, args)
        if args.todos_verb == "show":
            return await _show(engine, args.id, as_json=args.json)
        act = todo_actions.retry if args.todos_verb == "retry" else todo_actions.cancel
        refused = 0
        for todo_id in dict.fromkeys(args.ids):  # each id once, in the order given
            outcome = await act(engine, todo_id)
            if isinstance(outcome, Refused):
                refused += 1
                print(f"{_PROG} {args.todos_verb}: {outcome.reason}", file=sys.stderr)
            else:
                print(_done_line(outcome))
        return EXIT_FAILURE if refused else EXIT_OK
    finally:
        await engine.dispose()


def _list_filters(listing: argparse.ArgumentParser) -> None:
    listing.add_argument("--queue", help="only this queue")
    listing.add_argument(
        "--status",
        choices=TODO_STATUSES,
        metavar="STATUS",
        help=f"only todos in this status ({', '.join(TODO_STATUSES)})",
    )


async def _list(engine: AsyncEngine, args: argparse.Namespace) -> int:
    wanted = todo_views.TodoQuery(queue=args.queue, status=args.status, limit=args.limit)
    rows = await todo_actions.listed(engine, wanted)
    print_listed(rows, as_json=args.json, none="no todos match", table=list_table, json_value=_json_value)
    return EXIT_OK


async def _show(engine: AsyncEngine, todo_id: int, *, as_json: bool) -> int:
    shown = await todo_actions.show(engine, todo_id)
    if shown is None:
        print(f"{_PROG} show: todo {todo_id} does not exist", file=sys.stderr)
        return EXIT_FAILURE
    if as_json:
        document = {
            **dataclasses.asdict(shown.todo),
            "waiting": shown.waiting,
            "history": [dataclasses.asdict(e) for e in shown.history],
        }
        print(json.dumps(document, indent=2, default=_json_value, ensure_ascii=False))
    else:
        print("\n".join(show_lines(shown.todo, shown.history, shown.waiting)))
    return EXIT_OK


def _done_line(outcome: todo_actions.Retried | todo_actions.Cancelled) -> str:
    if isinstance(outcome, todo_actions.Retried):
        return f"todo {outcome.todo_id}: pending again (was {outcome.was}), attempts reset to 0"
    if outcome.was == "running":
        return (
            f"todo {outcome.todo_id}: cancelled (was running: its handler finishes, and its result is"
            " discarded)"
        )
    return f"todo {outcome.todo_id}: cancelled (was {outcome.was})"


def _json_value(value: object) -> str:
    """Timestamps in JSON: ISO 8601 in UTC, whatever the session's time zone."""
    if isinstance(value, datetime):
        return value.astimezone(UTC).isoformat()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


# -- text output ---------------------------------------------------------------


def _utc(moment: datetime | None, *, millis: bool = False) -> str:
    if moment is None:
        return "-"
    text = moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S.%f" if millis else "%Y-%m-%d %H:%M:%S")
    return text[:-3] if millis else text


def list_table(rows: Sequence[todo_views.TodoRow]) -> list[str]:
    header = ("ID", "QUEUE", "STATUS", "ATTEMPTS", "UPDATED_AT (UTC)", "KEY", "LAST_ERROR")
    cells = [
        (
            str(r.id),
            r.queue,
            r.status,
            str(r.attempts),
            _utc(r.updated_at),
            printable(r.idempotency_key),
            one_line(r.last_error),  # rows stored before redaction at the source
        )
        for r in rows
    ]
    return table(header, cells, right=frozenset({0, 3}))


def show_lines(
    todo: todo_views.TodoDetail, events: Sequence[todo_views.TodoEvent], waiting: str | None = None
) -> list[str]:
    fields = (
        ("id", str(todo.id)),
        ("queue", todo.queue),
        ("status", todo.status if waiting is None else f"{todo.status}: {waiting}"),
        ("attempts", str(todo.attempts)),
        ("idempotency_key", printable(todo.idempotency_key)),
        ("created_at", _utc(todo.created_at, millis=True) + " UTC"),
        ("updated_at", _utc(todo.updated_at, millis=True) + " UTC"),
        ("run_after", _utc(todo.run_after, millis=True) + " UTC"),
        ("lease_until", _utc(todo.lease_until, millis=True) + (" UTC" if todo.lease_until else "")),
        ("last_error", printable(todo.last_error) if todo.last_error is not None else "-"),
        ("trace_id", printable(todo.trace_id or "-")),
    )
    width = max(len(name) for name, _ in fields)
    lines: list[str] = []
    for name, value in fields:
        first, *more = value.splitlines() or [""]
        lines.append(f"{name.ljust(width)}  {first}".rstrip())
        lines.extend(f"{' ' * width}  {line}".rstrip() for line in more)
    lines.append("payload:")
    payload = json.dumps(todo.payload, indent=2, ensure_ascii=False)
    lines.extend(f"  {line}" for line in payload.splitlines())
    if not events:
        lines.append("history: no todo_events rows")
        return lines
    lines.append("history:")
    cells = [
        (_utc(e.created_at, millis=True), f"{e.from_status or '(new)'} -> {e.to_status}", one_line(e.detail))
        for e in events
    ]
    lines.extend(f"  {line}" for line in table(("CREATED_AT (UTC)", "CHANGE", "DETAIL"), cells))
    return lines


VERB = Verb(add_parser, in_loop(run))
