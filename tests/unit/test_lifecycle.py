"""Backoff bounds, and the retry helper every long-running loop uses."""

from __future__ import annotations

import asyncio
import random

import structlog

from backhalf.errors import StoreError
from ingest.config import from_mapping
from ingest.lifecycle import Backoff, NotifiedLooks, Retry


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


def _store_error() -> StoreError:
    try:
        try:
            raise ConnectionError("server closed the connection")
        except ConnectionError as exc:
            raise StoreError("transaction failed") from exc
    except StoreError as exc:
        return exc


def test_retry_logs_each_failure_with_its_attempt_and_the_backoffs_delay() -> None:
    retry = Retry(Backoff(100, 400, random.Random(7)), structlog.get_logger("t"))
    same_backoff = Backoff(100, 400, random.Random(7))
    exc = _store_error()
    with structlog.testing.capture_logs() as logged:
        delays = [retry.failed("store_failed", exc, broker="redis") for _ in range(4)]
    assert delays == [same_backoff.next_delay_s() for _ in range(4)]
    assert [e["attempt"] for e in logged] == [1, 2, 3, 4]
    assert [e["retry_in_s"] for e in logged] == [round(d, 3) for d in delays]
    assert all(d <= 0.4 for d in delays), "capped"
    for e in logged:
        assert e["event"] == "store_failed"
        assert e["log_level"] == "warning"
        assert e["error"] is exc
        assert e["error_type"] == "StoreError"
        assert e["cause"] == "ConnectionError"
        assert e["broker"] == "redis"
        assert "exc_info" not in e


def test_a_success_starts_the_backoff_over() -> None:
    retry = Retry(Backoff(100, 10_000, random.Random(1)), structlog.get_logger("t"))
    exc = _store_error()
    with structlog.testing.capture_logs() as logged:
        retry.failed("ack_failed", exc)
        retry.failed("ack_failed", exc)
        retry.succeeded()
        delay_s = retry.failed("ack_failed", exc)
    assert [e["attempt"] for e in logged] == [1, 2, 1]
    assert delay_s <= 0.1


def test_an_unexpected_failure_is_retried_too_but_logged_with_its_traceback() -> None:
    retry = Retry(Backoff(100, 400), structlog.get_logger("t"))
    try:
        raise KeyError("a bug")
    except KeyError as exc:
        bug = exc
    with structlog.testing.capture_logs() as logged:
        retry.failed("ack_failed", bug, adapter="orders")
    [e] = logged
    assert e["log_level"] == "error"
    assert e["exc_info"] is bug
    assert (e["error_type"], e["cause"], e["attempt"], e["adapter"]) == ("KeyError", None, 1, "orders")


def test_what_counts_as_expected_is_the_loops_choice() -> None:
    retry = Retry(Backoff(100, 400), structlog.get_logger("t"), expected=(OSError,))
    with structlog.testing.capture_logs() as logged:
        retry.failed("listen_failed", ConnectionRefusedError("refused"))
        retry.failed("listen_failed", _store_error())
    assert [e["log_level"] for e in logged] == ["warning", "error"]


async def test_back_off_waits_the_delay_out_or_until_stop() -> None:
    stop = asyncio.Event()
    retry = Retry(Backoff(50, 50, random.Random(3)), structlog.get_logger("t"))
    loop = asyncio.get_running_loop()
    with structlog.testing.capture_logs() as logged:
        started = loop.time()
        await retry.back_off(stop, "register_failed", _store_error())
        waited_s = loop.time() - started
        assert logged[0]["retry_in_s"] <= waited_s + 0.001
        slow = Retry(Backoff(60_000, 60_000), structlog.get_logger("t"))
        loop.call_later(0.05, stop.set)
        started = loop.time()
        await slow.back_off(stop, "register_failed", _store_error())
        assert loop.time() - started < 5, "stop ends the wait"
    assert [e["event"] for e in logged] == ["register_failed", "register_failed"]
    assert logged[1]["retry_in_s"] >= 30


def test_a_loops_retry_is_made_from_its_sections_backoff_keys() -> None:
    settings = from_mapping(
        {"database": {"url": "postgresql://db/x"}, "acker": {"backoff_initial_ms": 40, "backoff_max_ms": 80}},
        {},
    )
    retry = Retry.from_settings(settings.acker, structlog.get_logger("t"), expected=(OSError,))
    with structlog.testing.capture_logs() as logged:
        delays = [retry.failed("ack_failed", ConnectionRefusedError("refused")) for _ in range(4)]
        retry.failed("ack_failed", _store_error())
    assert 0.02 <= delays[0] <= 0.04
    assert all(d <= 0.08 for d in delays), "capped at backoff_max_ms"
    assert [e["log_level"] for e in logged] == ["warning"] * 4 + ["error"]


def test_a_notified_look_waits_its_gap_which_grows_while_looks_find_nothing() -> None:
    gate = NotifiedLooks(min_s=0.005, max_s=0.04)
    assert gate.due_at() == float("-inf")  # no look yet: at once
    gate.looked(10.0, notified=True, found=False)
    assert gate.due_at() == 10.01
    for _ in range(5):  # forged: empty looks, the gap doubles up to its bound
        gate.looked(20.0, notified=True, found=False)
    assert gate.due_at() == 20.04
    gate.looked(30.0, notified=False, found=False)  # a poll's empty look changes no gap
    assert gate.due_at() == 30.04
    gate.looked(40.0, notified=False, found=True)  # work found, however: back to the least
    assert gate.due_at() == 40.005
