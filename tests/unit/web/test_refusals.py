"""The console's refusals (issue 43): a wrong guess waits longer with each
consecutive one from its client, up to a bound, and a right token ends the
run; refusals are logged a line per client per interval, with their count.
The clock and the sleep are the test's; tests/system/test_console_guesses.py
runs the same against the real console over loopback."""

from __future__ import annotations

import asyncio

import pytest
from starlette.requests import Request
from structlog.testing import capture_logs

from ingest.web import security
from ingest.web.security import (
    GUESS_DELAY_MAX_S,
    GUESSES_WAITING_MAX,
    REFUSAL_LOG_EVERY_S,
    SESSION_COOKIE,
    Guard,
    Refusals,
    Verdict,
)

TOKEN = "a-console-token-of-some-length"


def _request(headers: dict[str, str]) -> Request:
    raw = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    return Request({"type": "http", "method": "GET", "path": "/", "headers": raw, "query_string": b""})


def test_a_wrong_credential_is_a_guess_and_none_or_a_lapsed_session_is_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    guard = Guard(TOKEN)
    cookie = guard.new_session()
    assert guard.verdict(_request({"Authorization": f"Bearer {TOKEN}"})) == Verdict(True, by_token=True)
    assert guard.verdict(_request({"Cookie": f"{SESSION_COOKIE}={cookie}"})) == Verdict(True)
    assert guard.verdict(_request({})) == Verdict(False)
    for wrong in (f"Bearer {TOKEN}x", f"Basic {TOKEN}", "Bearer"):
        assert guard.verdict(_request({"Authorization": wrong})) == Verdict(False, guess="wrong_token")
    forged = f"{cookie.partition('.')[0]}.{'0' * 64}"
    assert guard.verdict(_request({"Cookie": f"{SESSION_COOKIE}={forged}"})) == Verdict(
        False, guess="forged_session"
    )
    assert Guard(None).verdict(_request({"Authorization": "Bearer x"})) == Verdict(True)
    monkeypatch.setattr(security, "SESSION_S", 0)  # every session has lapsed
    assert guard.verdict(_request({"Cookie": f"{SESSION_COOKIE}={cookie}"})) == Verdict(False)
    assert not guard.token_matches(TOKEN[:-1])
    assert guard.token_matches(TOKEN)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)


@pytest.fixture
def clock() -> Clock:
    return Clock()


async def test_a_wrong_guess_waits_longer_each_time_up_to_a_bound_and_a_right_token_ends_the_run(
    clock: Clock,
) -> None:
    refusals = Refusals(clock, clock.sleep)
    for _ in range(6):
        await refusals.wrong_guess("10.0.0.1", "wrong_token")
    assert clock.slept == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert max(clock.slept) == GUESS_DELAY_MAX_S
    await refusals.wrong_guess("10.0.0.2", "wrong_token")  # another client: its own run
    assert clock.slept[-1] == 0.5
    refusals.succeeded("10.0.0.1")
    await refusals.wrong_guess("10.0.0.1", "wrong_token")
    assert clock.slept[-1] == 0.5
    clock.now += security.GUESS_MEMORY_S + 1  # a run long past is forgotten
    await refusals.wrong_guess("10.0.0.2", "forged_session")
    assert clock.slept[-1] == 0.5


async def test_refusals_are_logged_a_line_per_client_per_interval_with_their_count(clock: Clock) -> None:
    refusals = Refusals(clock, clock.sleep)
    with capture_logs() as logs:
        for _ in range(50):
            await refusals.wrong_guess("10.0.0.1", "wrong_token")
            clock.now += 0.1  # 50 guesses in 5 s
        refusals.note("10.0.0.1", "csrf")
        await refusals.wrong_guess("10.0.0.2", "wrong_token")  # another client: a line of its own
        clock.now += REFUSAL_LOG_EVERY_S
        await refusals.wrong_guess("10.0.0.1", "forged_session")
    lines = [line for line in logs if line["event"] == "web_refused"]
    assert [(line["client"], line["refused"]) for line in lines] == [
        ("10.0.0.1", {"wrong_token": 1}),
        ("10.0.0.2", {"wrong_token": 1}),
        # The refusals since the client's last line, this one included.
        ("10.0.0.1", {"wrong_token": 49, "csrf": 1, "forged_session": 1}),
    ]
    assert lines[0]["log_level"] == "warning"
    assert lines[2]["consecutive_wrong_guesses"] == 51
    assert lines[2]["delay_s"] == GUESS_DELAY_MAX_S


async def test_lines_for_all_clients_together_are_bounded_and_the_rest_carried(
    clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(security, "REFUSAL_LINES_MAX", 3)
    refusals = Refusals(clock, clock.sleep)
    with capture_logs() as logs:
        for n in range(10):  # ten clients at once: three lines
            refusals.note(f"10.0.0.{n}", "cross_origin")
        clock.now += REFUSAL_LOG_EVERY_S
        refusals.note("10.0.0.9", "cross_origin")  # its first refusal is counted here
    lines = [(line["client"], line["refused"]) for line in logs if line["event"] == "web_refused"]
    assert lines == [
        ("10.0.0.0", {"cross_origin": 1}),
        ("10.0.0.1", {"cross_origin": 1}),
        ("10.0.0.2", {"cross_origin": 1}),
        ("10.0.0.9", {"cross_origin": 2}),
    ]


async def test_guesses_held_at_once_are_bounded_per_client_and_forgotten_clients_are_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    release = asyncio.Event()

    async def held(_seconds: float) -> None:
        await release.wait()

    refusals = Refusals(sleep=held)
    async with asyncio.TaskGroup() as tasks:
        for _ in range(GUESSES_WAITING_MAX):
            tasks.create_task(refusals.wrong_guess("10.0.0.1", "wrong_token"))
        await asyncio.sleep(0)  # each is held now
        assert refusals.busy("10.0.0.1")
        assert not refusals.busy("10.0.0.2")
        release.set()
    assert not refusals.busy("10.0.0.1")

    monkeypatch.setattr(security, "CLIENTS_TRACKED_MAX", 5)
    refusals = Refusals()
    for n in range(20):
        refusals.note(f"10.0.1.{n}", "csrf")
    assert len(refusals._clients) == 5
    assert list(refusals._clients) == [f"10.0.1.{n}" for n in range(15, 20)]  # the most recent kept
