"""The audit views of migration 0007 answer with the right figures on a
database filled with known rows (schema/views.py says what each counts)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from tests.support import db

T = datetime(2026, 12, 1, 10, 0, 0, tzinfo=UTC)
MINUTE_0 = T
MINUTE_1 = T + timedelta(minutes=1)


def _todo(url: str, key: str, queue: str) -> int:
    return int(
        db.scalar(
            url,
            "INSERT INTO todos (queue, idempotency_key, payload, created_at)"
            " VALUES (%(q)s, %(k)s, '{}'::jsonb, %(at)s) RETURNING id",
            {"q": queue, "k": key, "at": T},
        )
    )


def _event(url: str, adapter: str, key: str, todo_id: int) -> int:
    return int(
        db.scalar(
            url,
            "INSERT INTO events (family, adapter, trust_mode, verified, idempotency_key, payload, todo_id)"
            " VALUES ('queue', %(a)s, 'queue', false, %(k)s, '{}'::jsonb, %(t)s) RETURNING id",
            {"a": adapter, "k": key, "t": todo_id},
        )
    )


def _inbox(url: str, **row: Any) -> None:
    values = {
        "source_message_id": None,
        "status": "stored",
        "error": None,
        "todo_id": None,
        "event_id": None,
        "acked_at": None,
        **row,
    }
    values["ack_state"] = "acked" if values["acked_at"] is not None else "pending"
    values["ack_kind"] = "xack" if values["source_message_id"] else "lrem"
    db.query(
        url,
        "INSERT INTO inbox (adapter, idempotency_key, source_message_id, body, ack_kind, ack_state,"
        " acked_at, deliveries, status, error, todo_id, event_id, stored_at)"
        " VALUES (%(adapter)s, %(key)s, %(source_message_id)s, '\\x7b7d'::bytea, %(ack_kind)s,"
        " %(ack_state)s, %(acked_at)s, %(deliveries)s, %(status)s, %(error)s, %(todo_id)s,"
        " %(event_id)s, %(stored_at)s)",
        values,
    )


@pytest.fixture
def filled(db_url: str) -> str:
    """Two adapters over two minutes; the figures each view must give are in the tests."""
    return fill(db_url)


def fill(db_url: str) -> str:
    """``filled``'s rows (tests/integration/backhalf/test_console_views.py reads them too)."""
    for name, mode in (("orders", "stream"), ("jobs", "list")):
        db.query(
            db_url,
            "INSERT INTO adapters (name, transport, mode) VALUES (%(n)s, 'redis', %(m)s)",
            {"n": name, "m": mode},
        )
    t1 = _todo(db_url, "k1", "orders")
    t2 = _todo(db_url, "kj", "jobs")
    t3 = _todo(db_url, "k5", "orders")
    e1 = _event(db_url, "orders", "k1", t1)
    e2 = _event(db_url, "jobs", "kj", t2)
    e3 = _event(db_url, "jobs", "kj", t2)  # a second message of t2's key: the todo dedup
    e5 = _event(db_url, "orders", "k5", t3)
    s = timedelta(seconds=1)
    # orders, minute 0: r1 delivered 3 times, acked after 0.5 s; r2 rejected,
    # acked in minute 1 after 41 s.
    _inbox(db_url, adapter="orders", key="k1", source_message_id="1-0", deliveries=3,
           stored_at=T + 10 * s, acked_at=T + 10.5 * s, todo_id=t1, event_id=e1)  # fmt: skip
    _inbox(db_url, adapter="orders", key="k2", source_message_id="2-0", deliveries=1, status="rejected",
           error="invalid_json", stored_at=T + 20 * s, acked_at=T + 61 * s)  # fmt: skip
    # jobs, minute 0: r3, two copies merged, acked after 2 s.
    _inbox(db_url, adapter="jobs", key="kj", deliveries=2, stored_at=T + 30 * s, acked_at=T + 32 * s,
           todo_id=t2, event_id=e2)  # fmt: skip
    # jobs, minute 1: r4, the same body again after r3's ack: deduped to t2, not acked yet.
    _inbox(db_url, adapter="jobs", key="kj", deliveries=1, stored_at=T + 70 * s, todo_id=t2, event_id=e3)
    # orders, minute 1: r5, acked after 4 s.
    _inbox(db_url, adapter="orders", key="k5", source_message_id="5-0", deliveries=1,
           stored_at=T + 75 * s, acked_at=T + 79 * s, todo_id=t3, event_id=e5)  # fmt: skip
    return db_url


def test_redelivery_counts_per_adapter_and_their_distribution(filled: str) -> None:
    assert db.query(filled, "SELECT * FROM audit_redeliveries ORDER BY adapter") == [
        ("jobs", 2, 1, 1, 2),
        ("orders", 3, 1, 2, 3),
    ]
    assert db.query(filled, "SELECT * FROM audit_delivery_counts ORDER BY adapter, deliveries") == [
        ("jobs", 1, 1),
        ("jobs", 2, 1),
        ("orders", 1, 2),
        ("orders", 3, 1),
    ]


def test_per_adapter_per_minute_counts_and_ack_latency_percentiles(filled: str) -> None:
    rows = db.query(
        filled,
        "SELECT adapter, minute, consumed, deduplicated_inbox, deduplicated_todo, rejected, acked,"
        " ack_latency_p50_s, ack_latency_p95_s, ack_latency_p99_s"
        " FROM audit_adapter_minutes ORDER BY adapter, minute",
    )
    latencies = {(r[0], r[1]): r[7:] for r in rows}
    assert [r[:7] for r in rows] == [
        ("jobs", MINUTE_0, 1, 1, 0, 0, 1),
        ("jobs", MINUTE_1, 1, 0, 1, 0, 0),
        ("orders", MINUTE_0, 2, 2, 0, 1, 1),
        ("orders", MINUTE_1, 1, 0, 0, 0, 2),
    ]
    assert latencies["jobs", MINUTE_0] == (2.0, 2.0, 2.0)
    assert latencies["jobs", MINUTE_1] == (None, None, None)
    assert latencies["orders", MINUTE_0] == (0.5, 0.5, 0.5)
    # Acked in minute 1: r2 after 41 s and r5 after 4 s, interpolated.
    p50, p95, p99 = latencies["orders", MINUTE_1]
    assert (p50, p95, p99) == pytest.approx((22.5, 4 + 0.95 * 37, 4 + 0.99 * 37))


def test_a_minute_filter_reaches_both_scans_of_the_inbox(filled: str) -> None:
    query = "SELECT adapter, consumed, acked FROM audit_adapter_minutes WHERE minute >= %(m)s ORDER BY 1"
    assert db.query(filled, query, {"m": MINUTE_1}) == [("jobs", 1, 0), ("orders", 1, 2)]
    # Pushed below the GROUP BY into each branch of the UNION ALL, so the
    # aggregate never sees the rows outside the window.
    plan = "\n".join(line for (line,) in db.query(filled, "EXPLAIN " + query, {"m": MINUTE_1}))
    filters = [line for line in plan.splitlines() if "Filter:" in line]
    for column in ("stored_at", "acked_at"):
        assert any(f"date_trunc('minute'::text, {column}) >=" in line for line in filters), plan


def test_every_example_query_of_ops_audit_sql_runs(filled: str) -> None:
    text = (Path(__file__).parents[3] / "ops" / "audit.sql").read_text()
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("--"))
    statements = [s.strip() for s in code.split(";") if s.strip()]
    assert len(statements) >= 10
    for statement in statements:  # a typo or a renamed column fails here
        db.query(filled, statement)
