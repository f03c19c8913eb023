"""What the auditor reads carries no message content (issue 32.6): a body
failing its adapter's schema with a card number in it, through the real
ingester and acker against PostgreSQL and Redis. Its inbox error, its row in
``audit_rejected`` and every log line name the path and the failed keyword,
never the value."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import cast

import pytest
import redis
from structlog.testing import capture_logs

from tests.support.db import query, scalar
from tests.support.in_process import pipeline, settings, wait_until
from tests.support.streams import xpending

STREAM = "payments"
CARD = "4111 1111 1111 1111"
FRAGMENTS = (CARD, "4111111111111111", "4111")
SCHEMA = {
    "type": "object",
    "required": ["card"],
    "properties": {"card": {"type": "integer"}, "extra": {"type": "object", "additionalProperties": False}},
}


async def test_a_rejected_card_number_reaches_no_error_audit_row_or_log_line(
    db_url: str,
    redis_url: str,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
) -> None:
    schema = tmp_path / "payment.schema.json"
    schema.write_text(json.dumps(SCHEMA))
    adapter = {"name": STREAM, "source": STREAM, "consumer": "c1", "block_ms": 100, "schema": str(schema)}
    bodies = {
        "as a value": {"card": CARD},
        "as a number": {"card": 4111111111111111.5},
        "as a key": {"card": 1, "extra": {CARD: "x"}},
        "as a text": CARD,
    }
    with redis.Redis.from_url(redis_url, socket_timeout=10) as r:
        ids = {
            name: cast(bytes, r.xadd(STREAM, {"body": json.dumps(b)})).decode() for name, b in bodies.items()
        }
        good = cast(bytes, r.xadd(STREAM, {"body": json.dumps({"card": 7})})).decode()
    caplog.set_level(logging.DEBUG)
    with capture_logs() as events:
        async with pipeline(settings(db_url, redis_url, adapter)):
            await wait_until(
                lambda: (
                    scalar(db_url, "SELECT count(*) FROM inbox WHERE ack_state = 'acked'") == 5
                    and xpending(redis_url, STREAM) == 0
                )
            )
    errors = dict(query(db_url, "SELECT source_message_id, error FROM inbox WHERE status = 'rejected'"))
    assert errors == {
        ids["as a value"]: 'schema_mismatch: at /card: keyword type failed (schema: "integer")',
        ids["as a number"]: 'schema_mismatch: at /card: keyword type failed (schema: "integer")',
        ids["as a key"]: "schema_mismatch: at /extra: keyword additionalProperties failed (schema: false)",
        ids["as a text"]: 'schema_mismatch: at /: keyword type failed (schema: "object")',
    }
    audited = dict(query(db_url, "SELECT source_message_id, error FROM audit_rejected"))
    assert audited == errors
    assert (
        scalar(
            db_url,
            "SELECT count(*) FROM todos WHERE idempotency_key = %(k)s",
            {"k": f"redis:{STREAM}:{good}"},
        )
        == 1
    )
    # Nothing the auditor can read holds it: every audit view, every column.
    views = [v for (v,) in query(db_url, "SELECT viewname FROM pg_views WHERE viewname LIKE 'audit\\_%'")]
    assert "audit_rejected" in views
    for view in views:
        text = str(query(db_url, f"SELECT * FROM {view}"))  # the names come from pg_views
        for fragment in FRAGMENTS:
            assert fragment not in text, (view, text)
    # Nor any log line: structlog's events as logged, the standard library's, stderr.
    logged = [str(events), caplog.text, *capfd.readouterr()]
    assert any(e.get("event") == "batch_stored" and e.get("rejected") for e in events)
    for text in logged:
        for fragment in FRAGMENTS:
            assert fragment not in text
