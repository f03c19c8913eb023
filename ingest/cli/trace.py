"""``switchboard trace KEY_OR_ENTRY_ID [--json]`` (or ``--inbox-id ID``): the
whole trail of one message as PostgreSQL recorded it, with timings.

For each inbox row that holds the message (an entry id can match one row
per stream adapter): its broker coordinates, the row itself, its event, its
todo with every ``todo_events`` row, and its ack; then a timeline, oldest
first, each step's offset from the first. Where a message's id says when
the broker took it (its transport's ``sent``), the timeline starts there,
on the broker's clock; the other steps are PostgreSQL's ``now()`` of the
transaction that wrote them (two clocks: an offset below zero, or a large
first one, says they disagree). The search is :mod:`ingest.actions.trail`'s.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from backhalf.db import create_engine
from backhalf.reads import trace
from ingest.actions import trail as trail_actions
from ingest.cli.text_table import printable
from ingest.cli.verb import Verb, add_json, in_loop, positive_int
from ingest.config import Settings
from ingest.exit_codes import EXIT_CONFIG, EXIT_FAILURE, EXIT_OK
from ingest.observe.trail import ack_command, offset, sent_at, timeline

_PROG = "switchboard trace"


def add_parser(verbs: Any, common: argparse.ArgumentParser) -> None:
    p = verbs.add_parser(
        "trace", parents=[common], help="the whole trail of one message (inbox, event, todo, ack), timed"
    )
    p.add_argument(
        "target",
        nargs="?",
        metavar="KEY_OR_ENTRY_ID",
        help=(
            "an idempotency key (PREFIX:SOURCE:ID), a bare stream entry id (1700000000000-0),"
            " inbox:ID, todo:ID, or a bare number (that inbox row and that todo)"
        ),
    )
    p.add_argument("--inbox-id", type=positive_int, metavar="ID", help="trace this inbox row instead")
    add_json(p)


def usage_error(args: argparse.Namespace) -> str | None:
    """What is wrong with the arguments (argparse cannot say "exactly one of a
    positional and an option"), or None."""
    if (args.target is None) == (args.inbox_id is None):
        return "give exactly one of KEY_OR_ENTRY_ID and --inbox-id"
    return None


async def run(settings: Settings, args: argparse.Namespace) -> int:
    problem = usage_error(args)
    if problem is not None:
        print(f"{_PROG}: {problem} (see `{_PROG} --help`)", file=sys.stderr)
        return EXIT_CONFIG
    query = f"inbox:{args.inbox_id}" if args.inbox_id is not None else args.target
    engine = create_engine(settings.database)
    try:
        found = await trail_actions.find(engine, query)
    finally:
        await engine.dispose()
    if not found.trails:
        print(f"{_PROG}: {found.missing}", file=sys.stderr)
        return EXIT_FAILURE
    if args.json:
        documents = [{**document(t), "waiting": w} for t, w in zip(found.trails, found.waiting, strict=True)]
        print(json.dumps(documents, indent=2, default=_json_value, ensure_ascii=False))
    else:
        print("\n".join(lines_of(found.trails, found.waiting)))
    return EXIT_OK


def text_lines(t: trace.Trail, waiting: str | None = None) -> list[str]:
    row = t.inbox
    kind = f"{t.transport or '?'} {t.mode or '?'}"
    lines = [f"inbox row {row.id}: adapter {row.adapter} ({kind}, source {t.source or '?'})"]
    fields: list[tuple[str, str]] = [
        ("key", row.idempotency_key),
        ("entry id", row.source_message_id or "- (no native id)"),
        ("consumer", row.consumer or "-"),
        ("deliveries", str(row.deliveries)),
        ("status", row.status),
        ("error", row.error or "-"),
        ("ack", f"{ack_command(t)}, after {row.ack_after}: {row.ack_state}"),
    ]
    if t.event is None:
        fields.append(("event", "-"))
    else:
        e = t.event
        verified = "verified" if e.verified else "not verified"
        fields.append(("event", f"{e.id} ({e.family}, trust {e.trust_mode}, {verified}: {e.verify_detail})"))
    if t.todo is None:
        fields.append(("todo", "-" if row.todo_id is None else f"{row.todo_id} (no longer exists)"))
    else:
        todo = t.todo
        note = ""
        if todo.created_at < row.stored_at:
            note = ", created before this row: the message was deduplicated to it"
        fields.append(
            ("todo", f"{todo.id}: queue {todo.queue}, {todo.status}, attempts {todo.attempts}{note}")
        )
        if waiting is not None:
            fields.append(("waiting", waiting))
        if todo.last_error:
            fields.append(("last error", todo.last_error))
    width = max(len(name) for name, _ in fields)
    for name, value in fields:
        # Errors, keys and ids can carry text from the message: untrusted,
        # so no terminal control reaches the terminal as one.
        first, *more = printable(value).splitlines() or [""]
        lines.append(f"  {name.ljust(width)}  {first}".rstrip())
        lines.extend(f"  {' ' * width}  {line}".rstrip() for line in more)
    steps = timeline(t)
    lines.append("  timeline (UTC, offsets from the first step):")
    start = steps[0].at
    lines.extend(f"    {_utc(s.at)}  {offset(s.at, start):>10}  {printable(s.what)}" for s in steps)
    return lines


def inbox_document(t: trace.Trail) -> dict[str, Any]:
    """The inbox row of a trail, with its adapter's transport, mode and
    source, as ``--json`` has always named them."""
    row = dataclasses.asdict(t.inbox)
    head = {"inbox_id": row.pop("id"), "adapter": row.pop("adapter")}
    return {**head, "transport": t.transport, "mode": t.mode, "source": t.source, **row}


def document(t: trace.Trail) -> dict[str, Any]:
    """The ``--json`` form of one trail."""
    steps = timeline(t)
    start = steps[0].at
    return {
        "inbox": inbox_document(t),
        "xadd_at": sent_at(t),  # DESIGN.md: the broker's time of the message, where its id holds one
        "event": None if t.event is None else dataclasses.asdict(t.event),
        "todo": None if t.todo is None else dataclasses.asdict(t.todo),
        "todo_events": [dataclasses.asdict(e) for e in t.todo_events],
        "timeline": [
            {"at": s.at, "offset_s": round((s.at - start).total_seconds(), 6), "what": s.what} for s in steps
        ],
    }


def _utc(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def _json_value(value: object) -> str:
    if isinstance(value, datetime):
        return value.astimezone(UTC).isoformat()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def lines_of(found: Sequence[trace.Trail], waiting: Sequence[str | None] = ()) -> list[str]:
    """All trails' text, a blank line between them; ``waiting``: why each
    trail's pending todo waits, in the trails' order."""
    out: list[str] = []
    for i, t in enumerate(found):
        if i:
            out.append("")
        out.extend(text_lines(t, waiting[i] if i < len(waiting) else None))
    return out


VERB = Verb(add_parser, in_loop(run))
