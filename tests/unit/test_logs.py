"""Credential redaction, and the logging the processes configure."""

from __future__ import annotations

import json
import logging

import pytest
import structlog

from ingest import logs
from ingest.logs import redact


@pytest.mark.parametrize(
    ("text", "secret"),
    [
        ("postgresql+psycopg://app:s3cr3t@db:5432/x", "s3cr3t"),
        ("redis://:hunter2@cache:6379/0", "hunter2"),
        ("connection failed: host=db password=pa55 user=x", "pa55"),
        ("rediss://user:p%40ss@h/0 and more", "p%40ss"),
    ],
)
def test_credentials_never_survive_redaction(text: str, secret: str) -> None:
    assert secret not in redact(text)


def test_configured_logging_redacts_fields_exceptions_and_stdlib_records(
    capsys: pytest.CaptureFixture[str],
) -> None:
    logs.configure(json_output=True)
    try:
        structlog.get_logger("t").info("connecting", url="redis://u:topsecret1@h/0")
        try:
            raise ConnectionError("cannot reach postgresql://app:topsecret2@db/x")
        except ConnectionError:
            structlog.get_logger("t").exception("failed")
        logging.getLogger("psycopg").warning("dsn password=topsecret3 host=db")
    finally:
        structlog.reset_defaults()
        logging.getLogger().handlers.clear()
    err = capsys.readouterr().err
    lines = [json.loads(line) for line in err.splitlines()]
    assert [line["event"] for line in lines] == ["connecting", "failed", "dsn password=*** host=db"]
    assert "topsecret" not in err
    assert lines[0]["url"] == "redis://u:***@h/0"
