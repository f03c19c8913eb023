"""The pruner's floors (issue 43) are the config's minimums: a retention the
config accepts is never raised by a floor, and one it refuses is never
honoured below it. backhalf cannot import the config (the layers), so the
two are held equal here."""

from __future__ import annotations

from datetime import timedelta

from backhalf.housekeeping import retention
from ingest.config.adapter import RETENTION_FLOOR_MS
from ingest.config.webhook import SENDER_RETRY_DAYS


def test_the_pull_floor_is_the_configs_minimum_retention() -> None:
    assert timedelta(milliseconds=RETENTION_FLOOR_MS) == retention.PULL_FLOOR
    assert retention.ATTEMPTS_FLOOR == retention.PULL_FLOOR


def test_the_push_floor_is_the_shortest_sender_retry_span() -> None:
    assert timedelta(days=min(SENDER_RETRY_DAYS.values())) == retention.PUSH_FLOOR
