"""How failures are logged: the same fields everywhere, a traceback only for a bug."""

from __future__ import annotations

import pytest
import structlog

from backhalf.errors import StoreError
from ingest.errors import BrokerError, failure_fields, log_failure


@pytest.mark.parametrize("cause", [None, ValueError("inner")])
def test_every_failure_carries_error_error_type_and_cause(cause: BaseException | None) -> None:
    exc = StoreError("failed")
    exc.__cause__ = cause
    assert failure_fields(exc) == {
        "error": exc,
        "error_type": "StoreError",
        "cause": None if cause is None else "ValueError",
    }


def test_an_expected_failure_is_a_warning_without_traceback() -> None:
    exc = BrokerError("redis went away")
    with structlog.testing.capture_logs() as logged:
        log_failure(structlog.get_logger("t"), "broker_error", exc, attempt=2)
    assert logged == [
        {
            "event": "broker_error",
            "log_level": "warning",
            "error": exc,
            "error_type": "BrokerError",
            "cause": None,
            "attempt": 2,
        }
    ]


def test_anything_else_is_a_bug_logged_with_its_traceback() -> None:
    try:
        raise ZeroDivisionError("a bug")
    except ZeroDivisionError as exc:
        bug = exc
    # Outside the except block: the traceback logged is the failure's, not "no exception".
    with structlog.testing.capture_logs() as logged:
        log_failure(structlog.get_logger("t"), "store_failed", bug, overlapping=True)
    [e] = logged
    assert (e["event"], e["log_level"], e["exc_info"]) == ("store_failed", "error", bug)
    assert (e["error_type"], e["overlapping"]) == ("ZeroDivisionError", True)


def test_the_caller_decides_what_is_expected() -> None:
    with structlog.testing.capture_logs() as logged:
        log_failure(structlog.get_logger("t"), "listen_failed", TimeoutError(), expected=(OSError,))
        log_failure(structlog.get_logger("t"), "listen_failed", StoreError("x"), expected=(OSError,))
    assert [e["log_level"] for e in logged] == ["warning", "error"]
