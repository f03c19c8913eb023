"""``switchboard trace KEY_OR_ENTRY_ID [--json]`` (or ``--inbox-id ID``): the
whole trail of one message as PostgreSQL recorded it, with timings.

For each inbox row that holds the message (an entry id can match one row
per stream adapter): its broker coordinates, the row itself, its event, its
todo with every ``todo_events`` row, and its ack; then a timeline, oldest
first, each step's offset from the first. A stream entry id is
``<ms>-<seq>``, the milliseconds being Redis's clock when the producer's
XADD ran, so a stream message's timeline starts at its XADD; the other steps
are PostgreSQL's ``now()`` of the transaction that wrote them (two clocks:
an offset below zero, or a large first one, says they disagree). The
queries are :mod:`backhalf.trace`'s.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from backhalf import trace
from backhalf.db import create_engine
from backhalf.redaction import redact
from ingest.adapters.base import AckIntentView
from ingest.adapters.factory import describe_ack
from ingest.cli.text_table import printable
from ingest.cli.verb import Verb, in_loop, positive_int
from ingest.config import Settings
from ingest.exit_codes import EXIT_CONFIG, EXIT_FAILURE, EXIT_OK

_PROG = "switchboard trace"
# A Redis stream entry id as stored: milliseconds, a dash, a sequence number.
ENTRY_ID = re.compile(r"^([0-9]+)-([0-9]+)$")


@dataclass(frozen=True, slots=True)
class Step:
    """One moment of a message's timeline."""

    at: datetime
    what: str


def add_parser(verbs: Any, common: argparse.ArgumentParser) -> None:
    p = verbs.add_parser(
        "trace", parents=[common], help="the whole trail of one message (inbox, event, todo, ack), timed"
    )
    p.add_argument(
        "target",
        nargs="?",
        metavar="KEY_OR_ENTRY_ID",
        help="an idempotency key (redis:orders:1700000000000-0) or a bare stream entry id (1700000000000-0)",
    )
    p.add_argument("--inbox-id", type=positive_int, metavar="ID", help="trace this inbox row instead")
    p.add_argument("--json", action="store_true", help="machine-readable output")


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
    engine = create_engine(settings.database)
    try:
        async with engine.connect() as conn:
            if args.inbox_id is not None:
                ids = [args.inbox_id]
                missing = f"inbox row {args.inbox_id} does not exist"
            elif ENTRY_ID.match(args.target):
                ids = await trace.inbox_ids_by_entry_id(conn, args.target)
                missing = f"no stream adapter's inbox holds entry id {args.target!r}"
            else:
                ids = await trace.inbox_ids_by_key(conn, args.target)
                missing = f"no inbox row has the idempotency key {args.target!r}"
            found = await trace.trails(conn, ids)
    finally:
        await engine.dispose()
    if not found:
        print(f"{_PROG}: {missing}", file=sys.stderr)
        return EXIT_FAILURE
    if args.json:
        print(json.dumps([document(t) for t in found], indent=2, default=_json_value, ensure_ascii=False))
    else:
        print("\n".join(lines_of(found)))
    return EXIT_OK


def xadd_time(entry_id: str | None) -> datetime | None:
    """When Redis took the entry (its id's milliseconds), or None: not an entry id."""
    match = ENTRY_ID.match(entry_id or "")
    if match is None:
        return None
    try:
        return datetime.fromtimestamp(int(match.group(1)) / 1000, UTC)
    except (OverflowError, ValueError, OSError):  # an explicit id far beyond any clock
        return None


def _xadd(row: trace.InboxTrail) -> datetime | None:
    # Only a stream entry's id is a time; a list or pub/sub row has none.
    return xadd_time(row.source_message_id) if row.ack_kind == "xack" or row.mode == "stream" else None


def timeline(t: trace.Trail) -> list[Step]:
    """Every recorded moment of the message, oldest first (ties in the order
    the pipeline takes them)."""
    row = t.inbox
    steps: list[Step] = []
    xadd = _xadd(row)
    if xadd is not None:
        steps.append(Step(xadd, f"XADD {row.source_message_id} (the entry id's time, on Redis's clock)"))
    steps.append(Step(row.stored_at, f"stored: inbox row {row.inbox_id}, {row.status}"))
    if t.event is not None:
        steps.append(Step(t.event.received_at, f"event {t.event.id} recorded"))
    if t.todo is not None:
        if not any(e.from_status is None for e in t.todo_events):  # creation not logged
            steps.append(Step(t.todo.created_at, f"todo {t.todo.id} created"))
        for e in t.todo_events:
            change = f"todo {t.todo.id}: {e.from_status or '(new)'} -> {e.to_status}"
            # Whitespace collapsed only: --json keeps the text as stored, and
            # text_lines makes it printable.
            detail = " ".join((e.detail or "").split())
            steps.append(Step(e.created_at, f"{change} ({detail})" if detail else change))
    if row.acked_at is not None:
        steps.append(Step(row.acked_at, f"acked: {_ack_command(row)}"))
    # sorted() is stable: equal times (one transaction's now()) keep this order.
    return sorted(steps, key=lambda s: s.at)


def offset(at: datetime, first: datetime) -> str:
    return f"{(at - first).total_seconds():+.3f} s"


def _ack_command(row: trace.InboxTrail) -> str:
    intent = AckIntentView(row.ack_kind, row.ack_key, row.ack_group, row.ack_entry_id, row.ack_copies)
    return describe_ack(row.transport, intent)


def text_lines(t: trace.Trail) -> list[str]:
    row = t.inbox
    kind = f"{row.transport or '?'} {row.mode or '?'}"
    lines = [f"inbox row {row.inbox_id}: adapter {row.adapter} ({kind}, source {row.source or '?'})"]
    fields: list[tuple[str, str]] = [
        ("key", row.idempotency_key),
        ("entry id", row.source_message_id or "- (no native id)"),
        ("consumer", row.consumer or "-"),
        ("deliveries", str(row.deliveries)),
        ("status", row.status),
        ("error", row.error or "-"),
        ("ack", f"{_ack_command(row)}, after {row.ack_after}: {row.ack_state}"),
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
        if todo.last_error:
            fields.append(("last error", redact(todo.last_error)))  # older rows: stored unredacted
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


def document(t: trace.Trail) -> dict[str, Any]:
    """The ``--json`` form of one trail."""
    steps = timeline(t)
    start = steps[0].at
    return {
        "inbox": dataclasses.asdict(t.inbox),
        "xadd_at": _xadd(t.inbox),
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


def lines_of(found: Sequence[trace.Trail]) -> list[str]:
    """All trails' text, a blank line between them."""
    out: list[str] = []
    for i, t in enumerate(found):
        if i:
            out.append("")
        out.extend(text_lines(t))
    return out


VERB = Verb(add_parser, in_loop(run))
