"""Wrong guesses at the console's token (issue 43), against the real
``switchboard web`` over loopback: each is answered no sooner than its
client's delay, which doubles with each consecutive one and ends with the
right token; a request signed in is not held behind a guess; a flood of
guesses costs a few log lines, whose counts add up to every refusal.
tests/unit/web/test_refusals.py has the same rules on a test clock."""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from ingest.embedded.processes import SwitchboardProcess, wait_for
from ingest.embedded.servers import free_port
from ingest.web.security import GUESS_DELAY_S, GUESSES_WAITING_MAX, REFUSAL_LOG_EVERY_S
from tests.support.config import stream_adapter, write_config
from tests.support.processes import Processes, assert_clean_exit

pytestmark = pytest.mark.system

TOKEN = "console-token-0123456789abcdef"
WRONG = "console-token-0123456789abcdeX"  # all but its last character right


@pytest.fixture
def console(
    procs: Processes, tmp_path: Path, db_url: str, redis_url: str
) -> Iterator[tuple[str, SwitchboardProcess]]:
    config = write_config(
        tmp_path / "web.toml", database_url=db_url, redis_url=redis_url, adapters=[stream_adapter("orders")]
    )
    port = free_port()
    web = procs.start(
        "web",
        config,
        name="web",
        args=["--listen", f"127.0.0.1:{port}"],
        env={"SWITCHBOARD_WEB_TOKEN": TOKEN},
    )
    wait_for(lambda: web.events("web_listening") or not web.alive(), timeout_s=30, what="the console")
    assert web.alive(), web.raw_log()[-3000:]
    yield f"http://127.0.0.1:{port}", web
    assert_clean_exit(web, web.stop())
    assert TOKEN not in web.raw_log()


def _get(url: str, token: str) -> tuple[int, float]:
    """The answer's status, and how long it took."""
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    started = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            status = answer.status
    except urllib.error.HTTPError as refused:
        refused.close()
        status = refused.code
    return status, time.monotonic() - started


def _refused_counts(web: SwitchboardProcess) -> list[dict[str, Any]]:
    return [line["refused"] for line in web.events("web_refused")]


def test_wrong_guesses_are_answered_late_and_logged_in_few_lines(
    console: tuple[str, SwitchboardProcess],
) -> None:
    url, web = console
    page = url + "/processes"
    refusals = 0

    # Each wrong guess in a run waits twice as long as the one before.
    for expected_s in (GUESS_DELAY_S, 2 * GUESS_DELAY_S):
        status, took_s = _get(page, WRONG)
        refusals += 1
        assert (status, took_s >= expected_s) == (401, True), took_s

    # A guess held does not hold a request signed in, which ends the run.
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(_get, page, WRONG)  # the third: 4 x GUESS_DELAY_S
        time.sleep(0.2)
        assert _get(page, TOKEN)[0] == 200
        assert not held.done()
        assert held.result()[0] == 401
        refusals += 1
    status, took_s = _get(page, WRONG)  # the run starts again: not 8 x GUESS_DELAY_S
    refusals += 1
    assert status == 401
    assert GUESS_DELAY_S <= took_s < 6 * GUESS_DELAY_S

    # Guessing in parallel: a few are held, the rest refused at once, unread.
    # The right token, sent while the guesses are held, is never held up
    # by them (behind a proxy, the guesser and the operator share an address).
    flood = 8 * GUESSES_WAITING_MAX
    with ThreadPoolExecutor(flood) as pool:
        guesses = [pool.submit(_get, page, WRONG) for _ in range(flood)]
        # A 429 means GUESSES_WAITING_MAX guesses are being held now.
        wait_for(
            lambda: any(g.done() and g.result()[0] == 429 for g in guesses), timeout_s=10, what="held guesses"
        )
        right, right_took_s = _get(page, TOKEN)
        statuses = [g.result()[0] for g in guesses]
    refusals += flood
    assert set(statuses) <= {401, 429}
    assert statuses.count(429) >= flood - 2 * GUESSES_WAITING_MAX, statuses
    assert right == 200
    assert right_took_s < GUESS_DELAY_S

    # Dozens of refusals, one line so far; after the interval, the next
    # refusal's line carries the count of every refusal since.
    lines = _refused_counts(web)
    assert len(lines) <= 2 < refusals, lines
    first = web.events("web_refused")[0]
    assert (first["client"], first["refused"]) == ("127.0.0.1", {"wrong_token": 1})
    time.sleep(REFUSAL_LOG_EVERY_S)
    _get(page, WRONG)
    refusals += 1
    wait_for(
        lambda: sum(sum(counts.values()) for counts in _refused_counts(web)) == refusals,
        timeout_s=10,
        what=f"web_refused lines counting {refusals} refusals",
    )
    assert len(_refused_counts(web)) <= 3
    assert any("too_many_guesses" in counts for counts in _refused_counts(web))
