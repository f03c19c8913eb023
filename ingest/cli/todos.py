"""``switchboard todos list / show / retry / cancel``: the operators' view of
the todos and their ``todo_events`` history, and their two actions.

Each id of a retry or cancel is its own transaction: the todo's row is
locked, its status checked (and for a retry, that no other active todo holds
its (queue, key)), then the change and its ``todo_events`` row are written
(:mod:`backhalf.todos`). A refused id is one line on stderr naming it and
why; the others go ahead; the exit code is 1 if any was refused.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any

import psycopg
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine

from backhalf import todo_views, todos
from backhalf.db import create_engine
from backhalf.redaction import redact
from ingest.cli.text_table import one_line, printable, table
from ingest.config import Settings
from ingest.exit_codes import EXIT_FAILURE, EXIT_OK
from schema import ACTIVE_TODO_STATUSES, TODO_STATUSES

# ``todo_events.detail`` of an operator's change.
RETRIED_BY_OPERATOR = "retried by an operator"
CANCELLED_BY_OPERATOR = "cancelled by an operator"

# What ``retry_todos`` takes back to pending (its SQL says the same).
RETRYABLE_STATUSES = ("failed", "cancelled")
# The partial unique index that allows one active todo per (queue, key).
ACTIVE_KEY_INDEX = "uq_todos_queue_key_active"

_PROG = "switchboard todos"


class Refused(Exception):
    """An id the action is not for; its message names the todo and why."""


def add_parser(verbs: Any, common: argparse.ArgumentParser, positive_int: Callable[[str], int]) -> None:
    todos_cmd = verbs.add_parser("todos", parents=[common], help="list and show todos; retry or cancel them")
    actions = todos_cmd.add_subparsers(dest="todos_verb", required=True, metavar="ACTION")
    listing = actions.add_parser("list", parents=[common], help="todos, newest first")
    listing.add_argument("--queue", help="only this queue")
    listing.add_argument(
        "--status",
        choices=TODO_STATUSES,
        metavar="STATUS",
        help=f"only todos in this status ({', '.join(TODO_STATUSES)})",
    )
    listing.add_argument("--limit", type=positive_int, default=50, help="at most this many todos (50)")
    listing.add_argument("--json", action="store_true", help="machine-readable output")
    show = actions.add_parser("show", parents=[common], help="one todo and its todo_events history")
    show.add_argument("id", type=positive_int, metavar="ID", help="todo id")
    show.add_argument("--json", action="store_true", help="machine-readable output")
    retry = actions.add_parser(
        "retry", parents=[common], help="make failed or cancelled todos pending again, attempts reset"
    )
    retry.add_argument("ids", nargs="+", type=positive_int, metavar="ID", help="todo id")
    cancel = actions.add_parser(
        "cancel", parents=[common], help="cancel pending, dispatched or running todos"
    )
    cancel.add_argument("ids", nargs="+", type=positive_int, metavar="ID", help="todo id")


async def run(settings: Settings, args: argparse.Namespace) -> int:
    engine = create_engine(settings.database)
    try:
        if args.todos_verb == "list":
            return await _list(engine, args)
        if args.todos_verb == "show":
            return await _show(engine, args.id, as_json=args.json)
        act = _retry_one if args.todos_verb == "retry" else _cancel_one
        refused = 0
        for todo_id in dict.fromkeys(args.ids):  # each id once, in the order given
            try:
                print(await act(engine, todo_id))
            except Refused as exc:
                refused += 1
                print(f"{_PROG} {args.todos_verb}: {exc}", file=sys.stderr)
        return EXIT_FAILURE if refused else EXIT_OK
    finally:
        await engine.dispose()


async def _list(engine: AsyncEngine, args: argparse.Namespace) -> int:
    async with engine.connect() as conn:
        rows = await todo_views.list_todos(conn, queue=args.queue, status=args.status, limit=args.limit)
    if args.json:
        print(json.dumps([dataclasses.asdict(r) for r in rows], indent=2, default=_json_value))
    elif not rows:
        print("no todos match")
    else:
        print("\n".join(list_table(rows)))
    return EXIT_OK


async def _show(engine: AsyncEngine, todo_id: int, *, as_json: bool) -> int:
    async with engine.connect() as conn:
        todo = await todo_views.get_todo(conn, todo_id)
        events = await todo_views.history(conn, todo_id) if todo is not None else []
    if todo is None:
        print(f"{_PROG} show: todo {todo_id} does not exist", file=sys.stderr)
        return EXIT_FAILURE
    if as_json:
        document = {**dataclasses.asdict(todo), "history": [dataclasses.asdict(e) for e in events]}
        print(json.dumps(document, indent=2, default=_json_value, ensure_ascii=False))
    else:
        print("\n".join(show_lines(todo, events)))
    return EXIT_OK


async def _retry_one(engine: AsyncEngine, todo_id: int) -> str:
    state: todo_views.TodoState | None = None
    try:
        async with engine.begin() as conn:
            state = await todo_views.lock_todo(conn, todo_id)
            if state is None:
                raise Refused(f"todo {todo_id} does not exist")
            if state.status not in RETRYABLE_STATUSES:
                raise Refused(
                    f"todo {todo_id} is {state.status}, not failed or cancelled: only those can be retried"
                )
            holder = await todo_views.active_holder(
                conn, state.queue, state.idempotency_key, other_than=todo_id
            )
            if holder is not None:
                raise Refused(_held_by(state, holder))
            retried = await todos.retry(conn, [todo_id], RETRIED_BY_OPERATOR)
            if retried != [todo_id]:  # not expected: its row is locked since the check
                raise Refused(f"todo {todo_id} was not retried (its status changed meanwhile)")
    except IntegrityError as exc:
        if state is None or not _violates_active_key(exc):
            raise
        # An active todo with the same key was committed between the check
        # and the UPDATE (the store creating one for a redelivery): the
        # transaction is rolled back; say who holds the key now.
        async with engine.connect() as conn:
            holder = await todo_views.active_holder(
                conn, state.queue, state.idempotency_key, other_than=todo_id
            )
        if holder is None:
            raise Refused(
                f"todo {todo_id} was not retried: another todo with queue {state.queue!r} and key"
                f" {state.idempotency_key!r} was active at that moment; try again"
            ) from exc
        raise Refused(_held_by(state, holder)) from exc
    return f"todo {todo_id}: pending again (was {state.status}), attempts reset to 0"


def _held_by(state: todo_views.TodoState, holder: todo_views.TodoState) -> str:
    return (
        f"todo {state.id} was not retried: todo {holder.id} ({holder.status}) is the active todo of"
        f" queue {state.queue!r} and key {state.idempotency_key!r}, and a key has one active todo at"
        f" a time (cancel todo {holder.id}, or let it finish, first)"
    )


def _violates_active_key(exc: IntegrityError) -> bool:
    orig = exc.orig
    return isinstance(orig, psycopg.errors.UniqueViolation) and orig.diag.constraint_name == ACTIVE_KEY_INDEX


async def _cancel_one(engine: AsyncEngine, todo_id: int) -> str:
    async with engine.begin() as conn:
        state = await todo_views.lock_todo(conn, todo_id)
        if state is None:
            raise Refused(f"todo {todo_id} does not exist")
        if state.status not in ACTIVE_TODO_STATUSES:
            raise Refused(
                f"todo {todo_id} is {state.status}, already finished:"
                " only pending, dispatched or running todos can be cancelled"
            )
        cancelled = await todos.cancel(conn, [todo_id], CANCELLED_BY_OPERATOR)
        if cancelled != [todo_id]:  # not expected: its row is locked since the check
            raise Refused(f"todo {todo_id} was not cancelled (its status changed meanwhile)")
    if state.status == "running":
        return f"todo {todo_id}: cancelled (was running: its handler finishes, and its result is discarded)"
    return f"todo {todo_id}: cancelled (was {state.status})"


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
            one_line(
                redact(r.last_error) if r.last_error else r.last_error
            ),  # rows stored before redaction at the source
        )
        for r in rows
    ]
    return table(header, cells, right=frozenset({0, 3}))


def show_lines(todo: todo_views.TodoDetail, events: Sequence[todo_views.TodoEvent]) -> list[str]:
    fields = (
        ("id", str(todo.id)),
        ("queue", todo.queue),
        ("status", todo.status),
        ("attempts", str(todo.attempts)),
        ("idempotency_key", printable(todo.idempotency_key)),
        ("created_at", _utc(todo.created_at, millis=True) + " UTC"),
        ("updated_at", _utc(todo.updated_at, millis=True) + " UTC"),
        ("dispatched_at", _utc(todo.dispatched_at, millis=True) + (" UTC" if todo.dispatched_at else "")),
        ("lease_until", _utc(todo.lease_until, millis=True) + (" UTC" if todo.lease_until else "")),
        ("last_error", printable(redact(todo.last_error)) if todo.last_error is not None else "-"),
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
