"""The CLI's tables for people: a header, aligned columns, one line per row."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

from backhalf.replay import InboxRow
from ingest.cli import _inbox_table


def row(id_: int, key: str, error: str | None, **kw: object) -> InboxRow:
    values: dict[str, object] = {
        "id": id_,
        "adapter": "orders",
        "idempotency_key": key,
        "source_message_id": None,
        "status": "rejected" if error else "stored",
        "ack_state": "acked",
        "deliveries": 1,
        "error": error,
        "stored_at": datetime(2026, 12, 1, 10, 11, 26, tzinfo=UTC),
        **kw,
    }
    return InboxRow(**values)  # type: ignore[arg-type]


def test_inbox_list_has_a_header_a_time_column_and_aligned_columns() -> None:
    lines = _inbox_table(
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
