"""Backoff bounds, failpoint parsing and credential redaction."""

from __future__ import annotations

import json
import logging
import random

import pytest
import structlog

from backhalf import failpoints
from backhalf.errors import InjectedFault
from ingest import logs
from ingest.config import from_mapping
from ingest.ingester import connections_needed, warn_if_pool_small
from ingest.lifecycle import Backoff
from ingest.logs import redact


def test_backoff_is_exponential_jittered_and_capped() -> None:
    b = Backoff(100, 2000, random.Random(7))
    delays = [b.next_delay_s() for _ in range(12)]
    for attempt, d in enumerate(delays):
        ceiling = min(2.0, 0.1 * 2**attempt)
        assert ceiling / 2 <= d <= ceiling
    assert max(delays) <= 2.0
    assert len(set(delays)) > 1
    b.reset()
    assert b.next_delay_s() <= 0.1


def test_failpoint_spec_parsing_and_firing() -> None:
    assert failpoints.parse("after_read=kill@3, before_commit=raise, before_store=stop~CRASH") == {
        "after_read": ("kill", 3, None),
        "before_commit": ("raise", None, None),
        "before_store": ("stop", None, b"CRASH"),
    }
    for bad in ("nowhere=kill", "after_read=explode", "after_read=raise@x", "after_read"):
        with pytest.raises(ValueError, match="failpoint"):
            failpoints.parse(bad)
    failpoints.configure("before_commit=raise@2")
    try:
        failpoints.hit("before_commit")
        with pytest.raises(InjectedFault):
            failpoints.hit("before_commit")
        failpoints.hit("before_commit")  # only the 2nd hit fires
    finally:
        failpoints.configure("")


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


class _Mode:
    def __init__(self, overlapping: bool) -> None:
        self.overlapping_commits = overlapping


@pytest.mark.parametrize(
    ("streams", "lists", "pool_size", "warned"),
    [(1, 0, 4, False), (2, 0, 4, False), (3, 0, 4, True), (3, 0, 7, False), (1, 3, 2, True)],
)
def test_a_pool_smaller_than_the_loops_can_use_is_warned_of_at_start(
    streams: int, lists: int, pool_size: int, warned: bool
) -> None:
    settings = from_mapping(
        {
            "database": {"url": "postgresql://db/x", "pool_size": pool_size},
            "adapters": [{"name": "a", "source": "a"}],
        },
        {},
    )
    adapters = [_Mode(True)] * streams + [_Mode(False)] * lists
    # A stream adapter: two commits and the loop's own transaction; a list: one and one.
    assert connections_needed(adapters, 2) == 3 * streams + 2 * lists  # type: ignore[arg-type]
    with structlog.testing.capture_logs() as logged:
        warn_if_pool_small(adapters, settings)  # type: ignore[arg-type]
    warnings = [e for e in logged if e["event"] == "pool_smaller_than_needed"]
    assert bool(warnings) == warned
    if warned:
        needed = 3 * streams + 2 * lists
        assert warnings[0]["hint"] == f"set [database] pool_size to at least {needed - 2}"
