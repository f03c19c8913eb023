"""The CLI's tables for people: a header, aligned columns, one line per row."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

from backhalf.reads.inbox_views import InboxRow
from backhalf.reads.todo_views import TodoDetail, TodoEvent, TodoRow
from ingest.cli import todos as todos_command
from ingest.cli.inbox import inbox_table


def row(id_: int, key: str, error: str | None, **kw: object) -> InboxRow:
    values: dict[str, object] = {
        "id": id_,
        "adapter": "orders",
        "idempotency_key": key,
        "source_message_id": None,
        "consumer": None,
        "status": "rejected" if error else "stored",
        "ack_state": "acked",
        "deliveries": 1,
        "error": error,
        "ack_kind": "xack",
        "ack_key": None,
        "ack_group": None,
        "ack_entry_id": None,
        "ack_copies": 1,
        "ack_after": "store",
        "acked_at": None,
        "stored_at": datetime(2026, 12, 1, 10, 11, 26, tzinfo=UTC),
        "todo_id": None,
        "event_id": None,
        **kw,
    }
    return InboxRow(**values)  # type: ignore[arg-type]


def test_inbox_list_has_a_header_a_time_column_and_aligned_columns() -> None:
    lines = inbox_table(
        [
            row(12, "redis:orders:1764583886000-0", "invalid_json: line 1\ncolumn 1", deliveries=10),
            row(7, "k", None, stored_at=datetime(2026, 12, 1, 12, 0, tzinfo=timezone(timedelta(hours=2)))),
        ]
    )
    assert lines == [
        "ID  STORED_AT (UTC)      ADAPTER  STATUS    ACK    DELIVERIES  KEY                           ERROR",
        "12  2026-12-01 10:11:26  orders   rejected  acked          10  redis:orders:1764583886000-0  "
        "invalid_json: line 1 column 1",
        " 7  2026-12-01 10:00:00  orders   stored    acked           1  k",
    ]


def test_todos_list_has_a_header_utc_times_and_one_line_errors() -> None:
    at = datetime(2026, 12, 1, 12, 0, 5, 900_000, tzinfo=timezone(timedelta(hours=2)))
    lines = todos_command.list_table(
        [
            TodoRow(104, "orders", "failed", 12, "redis:orders:1-0", at, at, at, None, "boom:\n  at line 3"),
            TodoRow(9, "b", "pending", 0, "k", at, at, at, None, None),
        ]
    )
    assert lines == [
        " ID  QUEUE   STATUS   ATTEMPTS  UPDATED_AT (UTC)     KEY               LAST_ERROR",
        "104  orders  failed         12  2026-12-01 10:00:05  redis:orders:1-0  boom: at line 3",
        "  9  b       pending         0  2026-12-01 10:00:05  k",
    ]


def test_todos_show_lists_every_field_the_payload_and_the_history() -> None:
    at = datetime(2026, 12, 1, 10, 0, 0, 123_456, tzinfo=UTC)
    todo = TodoDetail(
        id=7,
        queue="orders",
        status="running",
        attempts=1,
        idempotency_key="k",
        created_at=at,
        updated_at=at,
        run_after=at + timedelta(seconds=30),
        lease_until=at + timedelta(minutes=5),
        last_error="first\nsecond",
        payload={"n": 1, "s": "é"},
        trace_id="4bf92f3577b34da6a3ce929d0e0e4736",
    )
    events = [
        TodoEvent(at, None, "pending", "created"),
        TodoEvent(at + timedelta(seconds=1), "pending", "running", "claimed"),
    ]
    assert todos_command.show_lines(todo, events) == [
        "id               7",
        "queue            orders",
        "status           running",
        "attempts         1",
        "idempotency_key  k",
        "created_at       2026-12-01 10:00:00.123 UTC",
        "updated_at       2026-12-01 10:00:00.123 UTC",
        "run_after        2026-12-01 10:00:30.123 UTC",
        "lease_until      2026-12-01 10:05:00.123 UTC",
        "last_error       first",
        "                 second",
        "trace_id         4bf92f3577b34da6a3ce929d0e0e4736",
        "payload:",
        "  {",
        '    "n": 1,',
        '    "s": "é"',
        "  }",
        "history:",
        "  CREATED_AT (UTC)         CHANGE              DETAIL",
        "  2026-12-01 10:00:00.123  (new) -> pending    created",
        "  2026-12-01 10:00:01.123  pending -> running  claimed",
    ]
    assert todos_command.show_lines(todo, [])[-1] == "history: no todo_events rows"
