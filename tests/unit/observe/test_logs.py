"""Credential redaction, and the logging the processes configure."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest
import structlog

from ingest.observe import logs
from ingest.observe.logs import redact


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


@pytest.mark.parametrize(
    ("text", "secrets"),
    [
        # An unencoded "@" leaves no tail behind (issue 13.11: "***@tPart2@...").
        ("postgresql://u:S3cr@tPart2@host/db", ["S3cr", "tPart2"]),
        ("redis://default:pa/ss@cache:6379/0", ["pa/ss", "ss@"]),
        ("postgresql://u:se cret@host/db", ["se cret", "cret"]),
        ('host=db password="sx crzt" user=x', ["sx", "crzt"]),
        ("host=db password='sx crzt' user=x", ["sx", "crzt"]),
        ('cut off: password="sx crzt', ["sx", "crzt"]),
        (r'password="aq \" bq" host=db', ["aq", "bq"]),
        ("PGPASSWORD=hunter2 psql", ["hunter2"]),
        ("{'password': 'se cret', 'host': 'db'}", ["se cret", "cret"]),
        ('{"password": "se cret"}', ["se cret", "cret"]),
        ("two: postgresql://a:one1@h/x and redis://b:two2@c/0", ["one1", "two2"]),
    ],
)
def test_passwords_with_spaces_quotes_and_reserved_characters(text: str, secrets: list[str]) -> None:
    cleaned = redact(text)
    for secret in secrets:
        assert secret not in cleaned, cleaned


@pytest.mark.parametrize(
    "text",
    [
        "the database refused the password: check the user and password in the database URL",
        'password authentication failed for user "u"',
        "(Background on this error at: https://sqlalche.me/e/20/e3q8)",
        "redis://cache:6379/0",
        "postgresql+psycopg://u:***@db/x",
    ],
)
def test_text_without_a_credential_is_left_alone(text: str) -> None:
    assert redact(text) == text


def test_containers_and_reprs_are_redacted_too(capsys: pytest.CaptureFixture[str]) -> None:
    class Holder:
        def __repr__(self) -> str:
            return "Holder(url='redis://u:topsecret4@h/0')"

    logs.configure(json_output=True)
    try:
        structlog.get_logger("t").info(
            "nested",
            urls=["redis://u:topsecret5@h/0"],
            settings={"dsn": "password=topsecret6"},
            held=Holder(),
        )
    finally:
        structlog.reset_defaults()
        logging.getLogger().handlers.clear()
    err = capsys.readouterr().err
    assert "topsecret" not in err
    (line,) = [json.loads(x) for x in err.splitlines()]
    assert line["urls"] == ["redis://u:***@h/0"]
    assert line["held"] == "Holder(url='redis://u:***@h/0')"


def test_rendered_tracebacks_are_redacted(capsys: pytest.CaptureFixture[str]) -> None:
    """The traceback text (its source lines and the exception's message, of
    this exception and of its cause) goes through the redactor, in JSON and on
    a terminal."""
    for json_output in (True, False):
        logs.configure(json_output=json_output)
        try:
            try:
                try:
                    raise ValueError('dsn password="se cret7" host=db')
                except ValueError as exc:
                    raise ConnectionError("cannot reach postgresql://app:S3cr@tPart7@db/x") from exc
            except ConnectionError:
                structlog.get_logger("t").exception("failed")
            try:
                raise OSError("redis://default:pa/ss7@cache:6379/0 down")
            except OSError:
                logging.getLogger("redis").exception("stdlib failed")
        finally:
            structlog.reset_defaults()
            logging.getLogger().handlers.clear()
        err = capsys.readouterr().err
        assert "Traceback" in err
        for secret in ("se cret7", "cret7", "S3cr", "tPart7", "pa/ss7", "ss7"):
            assert secret not in err, err


def test_uncaught_tracebacks_are_printed_redacted() -> None:
    """In a process of its own: the hooks are process-wide."""
    program = (
        "import threading\n"
        "from ingest.observe import logs\n"
        "logs.redact_uncaught_tracebacks()\n"
        "def boom():\n"
        "    raise ValueError('thread: redis://u:topsecret8@h/0')\n"
        "t = threading.Thread(target=boom, name='worker-1'); t.start(); t.join()\n"
        "raise ConnectionError('main: postgresql://app:S3cr@tPart9@db/x')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 1
    assert "in thread worker-1: Traceback" in result.stderr
    assert "ConnectionError: main: postgresql://app:***@db/x" in result.stderr
    for secret in ("topsecret8", "S3cr", "tPart9"):
        assert secret not in result.stderr


@pytest.mark.parametrize("key", ["token", "password", "api_key", "client_secret", "Authorization", "db_pwd"])
def test_a_field_named_as_a_secret_is_masked(key: str) -> None:
    event = logs.redact_credentials(None, "info", {"event": "x", key: "abc123"})
    assert event[key] == "***"


@pytest.mark.parametrize("key", ["tokens", "password_env", "secretary", "keys"])
def test_a_field_only_near_a_secret_name_is_kept(key: str) -> None:
    event = logs.redact_credentials(None, "info", {"event": "x", key: "abc123"})
    assert event[key] == "abc123"
