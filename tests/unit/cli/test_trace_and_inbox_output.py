"""The pure parts of ``trace`` and ``inbox show / replay``: time bounds, a
body made readable, a trail's timeline."""

from __future__ import annotations

import argparse
import dataclasses
from datetime import UTC, datetime, timedelta, timezone

import pytest

from backhalf.reads.inbox_views import InboxRow, escape_like
from backhalf.reads.todo_views import TodoDetail, TodoEvent, TodoRow
from backhalf.reads.trace import EventTrail, Trail
from ingest.adapters.redis.settings import DEFINITION as REDIS
from ingest.cli import main as cli
from ingest.cli import todos as todos_command
from ingest.cli.inbox import body_view, time_bound
from ingest.cli.trace import text_lines
from ingest.observe import inbox_text
from ingest.observe.trail import timeline

T = datetime(2026, 12, 1, 10, 0, 0, tzinfo=UTC)
MS = timedelta(milliseconds=1)


@pytest.mark.parametrize(
    ("text", "bound"),
    [
        ("90s", timedelta(seconds=90)),
        ("1.5h", timedelta(minutes=90)),
        ("2d", timedelta(days=2)),
        ("1w", timedelta(weeks=1)),
        ("2026-12-01T10:00:00Z", T),
        ("2026-12-01 10:00", T),  # no zone: UTC
        ("2026-12-01T12:00:00+02:00", datetime(2026, 12, 1, 12, tzinfo=timezone(timedelta(hours=2)))),
    ],
)
def test_time_bounds_are_ages_or_moments(text: str, bound: datetime | timedelta) -> None:
    assert time_bound(text) == bound


@pytest.mark.parametrize("text", ["yesterday", "1y", "-1h", "10"])
def test_a_bad_time_bound_says_what_is_expected(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="ISO 8601 time"):
        time_bound(text)


def test_like_specials_are_escaped() -> None:
    assert escape_like(r"50%_off\x") == r"50\%\_off\\x"


def test_a_json_body_is_pretty_printed_and_a_binary_one_is_base64() -> None:
    view = body_view(b'{"b": [1, "\xc3\xa9"]}', body_size=None, body_sha256=None)
    assert view.encoding == "json"
    assert view.lines == ["{", '  "b": [', "    1,", '    "é"', "  ]", "}"]
    assert view.note.endswith("; JSON")
    binary = body_view(b"\xff\xfe\x00", body_size=None, body_sha256=None)
    assert (binary.encoding, binary.lines) == ("base64", ["//4A"])
    assert binary.note.endswith("not UTF-8, shown as base64")


def test_terminal_controls_in_a_body_are_shown_escaped() -> None:
    view = body_view(b"red \x1b[31m\tand \xe2\x80\xae reversed\x07", body_size=None, body_sha256=None)
    assert view.lines == ["red \\u001b[31m\tand \\u202e reversed\\u0007"]


def test_a_prefix_is_never_parsed_as_json_and_may_end_mid_character() -> None:
    view = body_view(b'{"a": 1}\xc3', body_size=9000, body_sha256=b"\x01" * 32)
    assert view.encoding == "text"
    assert view.lines == ['{"a": 1}']
    assert view.note.startswith("only its first 9 bytes are stored, of a message of 9000 bytes")
    assert ("01" * 32) in view.note


def test_xadd_time_is_the_entry_ids_milliseconds() -> None:
    """The Redis transport reads when XADD ran from a stream entry's id."""
    assert REDIS.sent is not None
    sent = REDIS.sent("stream", "xack", "1796119200000-3")
    assert sent is not None
    assert (sent.at, sent.kind) == (T, "xadd")
    assert REDIS.sent("stream", "xack", "abc") is None
    assert REDIS.sent("stream", "xack", None) is None
    assert REDIS.sent("stream", "xack", "99999999999999999999-0") is None  # beyond any clock
    assert REDIS.sent("list", "lrem", "1796119200000-3") is None  # a list's id is no time


def _trail(*, created: datetime) -> Trail:
    row = InboxRow(
        id=5, adapter="orders",
        idempotency_key="redis:orders:1796119200000-0", source_message_id="1796119200000-0",
        consumer="c1", status="stored", error=None, deliveries=2, ack_kind="xack", ack_key="orders",
        ack_group="g", ack_entry_id="1796119200000-0", ack_copies=1, ack_after="store",
        ack_state="acked", acked_at=T + 30 * MS, stored_at=T + 12 * MS, todo_id=9, event_id=4,
    )  # fmt: skip
    todo = TodoDetail(9, "orders", "done", 1, row.idempotency_key, created, T, created, None, None, {})
    history = [
        TodoEvent(created, None, "pending", "created"),
        TodoEvent(T + 40 * MS, "pending", "running", "claimed"),
        TodoEvent(T + 90 * MS, "running", "done", None),
    ]
    return Trail(
        row,
        "redis",
        "stream",
        "orders",
        EventTrail(4, "queue", "queue", False, "redis acl: default", T + 12 * MS),
        todo,
        history,
    )


def test_the_timeline_runs_from_the_xadd_in_time_order() -> None:
    steps = timeline(_trail(created=T + 12 * MS))
    assert [(s.at - T, s.what) for s in steps] == [
        (0 * MS, "XADD 1796119200000-0 (the entry id's time, on Redis's clock)"),
        (12 * MS, "stored: inbox row 5, stored"),
        (12 * MS, "event 4 recorded"),
        (12 * MS, "todo 9: (new) -> pending (created)"),
        (30 * MS, "acked: XACK orders g 1796119200000-0"),
        (40 * MS, "todo 9: pending -> running (claimed)"),
        (90 * MS, "todo 9: running -> done"),
    ]
    lines = text_lines(_trail(created=T + 12 * MS))
    assert lines[0] == "inbox row 5: adapter orders (redis stream, source orders)"
    assert "    2026-12-01 10:00:00.030    +0.030 s  acked: XACK orders g 1796119200000-0" in lines


def test_a_todo_older_than_the_row_is_called_a_dedup() -> None:
    lines = text_lines(_trail(created=T - 5000 * MS))
    (todo_line,) = [line for line in lines if line.startswith("  todo ")]
    assert todo_line.endswith("created before this row: the message was deduplicated to it")
    assert timeline(_trail(created=T - 5000 * MS))[0].what == "todo 9: (new) -> pending (created)"


@pytest.mark.parametrize("text", ["99999999999d", "9" * 400 + "s", "365001d"])
def test_an_age_too_long_is_a_usage_error_not_a_traceback(
    text: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="an age must be at most 365000d"):
        time_bound(text)
    with pytest.raises(SystemExit) as exit_info:
        cli._parser().parse_args(["inbox", "replay", "--all-rejected", "--since", text])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --since: an age must be at most 365000d" in err
    assert "Traceback" not in err


def test_terminal_controls_in_todo_errors_and_details_are_printed_escaped() -> None:
    trail = _trail(created=T + 12 * MS)
    hostile = "boom \x1b[31mred\x1b[0m\x9b2J"
    todo = dataclasses.replace(trail.todo, last_error=hostile) if trail.todo is not None else None
    history = [*trail.todo_events[:-1], TodoEvent(T + 90 * MS, "running", "failed", hostile)]
    lines = text_lines(dataclasses.replace(trail, todo=todo, todo_events=history))
    text = "\n".join(lines)
    assert {"\x1b", "\x9b"}.isdisjoint(text)
    assert "  last error  boom \\u001b[31mred\\u001b[0m\\u009b2J" in lines
    assert any(line.endswith("running -> failed (boom \\u001b[31mred\\u001b[0m\\u009b2J)") for line in lines)
    # --json's timeline keeps the detail as stored.
    assert timeline(dataclasses.replace(trail, todo_events=history))[-1].what.endswith(f"({hostile})")

    assert todo is not None
    todo_text = "\n".join(
        [*todos_command.list_table([todo_row(todo)]), *todos_command.show_lines(todo, history)]
    )
    assert {"\x1b", "\x9b"}.isdisjoint(todo_text)
    assert todo_text.count("boom \\u001b[31mred\\u001b[0m\\u009b2J") == 3


def todo_row(todo: TodoDetail) -> TodoRow:
    """The todo's row as ``todos list`` reads it: all but payload and trace."""
    fields = (f.name for f in dataclasses.fields(TodoRow))
    return TodoRow(**{name: getattr(todo, name) for name in fields})


def test_a_body_no_page_could_show_is_shown_escaped_not_raised() -> None:
    # A lone surrogate JSON can carry (rejected as lone_surrogate) and a
    # nesting past the parser's depth (rejected as too_deep): both are
    # stored, and the inbox row's page and `inbox show` must show them.
    lone = inbox_text.body_view(b'{"a": "\\ud800"}', body_size=None, body_sha256=None)
    assert lone.encoding == "json"
    assert "\\ud800" in "\n".join(lone.lines)
    "\n".join(lone.lines).encode("utf-8")  # encodable: no lone surrogate left
    deep = b"[" * 100_000 + b"]" * 100_000
    view = inbox_text.body_view(deep, body_size=None, body_sha256=None)
    assert view.encoding == "text"
    assert inbox_text.pretty_json({"k": "\ud800"}).encode("utf-8")
