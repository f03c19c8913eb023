"""``switchboard web`` in a real browser (Debian's Chromium through
Playwright) against real ``ingest`` and ``ack`` processes, Valkey and
PostgreSQL: the pages update live, show hostile text as text, and every
action does exactly what it showed, or is refused (DESIGN.md section 13).
Assertions are on the page and on what reached PostgreSQL."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import redis
from playwright.sync_api import Page, expect

from backhalf.housekeeping.heartbeats import HEARTBEAT_TTL_S
from ingest.embedded.processes import SwitchboardProcess, wait_for, wait_ready
from ingest.embedded.servers import free_port
from tests.support.browser import PageProblems
from tests.support.config import write_config
from tests.support.db import query, scalar
from tests.support.processes import Processes, assert_clean_exit, switchboard
from tests.support.roles import migrate_and_grant, role_database
from tests.support.servers import ServerUrls

pytestmark = pytest.mark.system

TOKEN = "console-token-0123456789abcdef"
HOSTILE = "<script>alert('body')</script><img src=x onerror=\"alert('img')\">"
STREAM = "orders"
# The ingester's rule: "n" is an integer. The console's config has no
# schema: the rule was fixed, so the rows it rejected can be replayed.
# Every other field an integer too: a field's name is the producer's, and
# the schema's error names it (a hostile error text, from the pipeline).
SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer"}},
    "required": ["n"],
    "additionalProperties": {"type": "integer"},
}


def _adapter(**extra: Any) -> dict[str, Any]:
    return {"name": "orders", "mode": "stream", "source": STREAM, "group": "sb", "queue": "orders", **extra}


def _configs(tmp_path: Path, db_url: str, redis_url: str) -> tuple[Path, Path]:
    """The ingester's config (with the strict schema) and the console's."""
    (tmp_path / "n.json").write_text(json.dumps(SCHEMA))
    ingest = write_config(
        tmp_path / "ingest.toml",
        database_url=db_url,
        redis_url=redis_url,
        adapters=[_adapter(schema="n.json")],
    )
    web = write_config(tmp_path / "web.toml", database_url=db_url, redis_url=redis_url, adapters=[_adapter()])
    return ingest, web


def _start_web(procs: Processes, config: Path, *args: str, env: dict[str, str] | None = None) -> str:
    port = free_port()
    proc = procs.start("web", config, name="web", args=["--listen", f"127.0.0.1:{port}", *args], env=env)
    wait_for(lambda: proc.events("web_listening") or not proc.alive(), timeout_s=30, what="the console")
    assert proc.alive(), proc.raw_log()[-3000:]
    return f"http://127.0.0.1:{port}"


def _xadd(redis_url: str, *payloads: str) -> list[str]:
    with redis.Redis.from_url(redis_url) as r:
        return [r.xadd(STREAM, {"body": p}).decode() for p in payloads]


def _wait_rows(db_url: str, n: int, where: str = "true") -> None:
    wait_for(
        lambda: scalar(db_url, f"SELECT count(*) FROM inbox WHERE {where}") >= n,
        timeout_s=30,
        what=f"{n} inbox rows ({where})",
    )


def _stop_all(procs: Processes) -> None:
    """Every process still running stopped gracefully, each with a clean exit."""
    for proc in procs.all:
        if proc.alive():
            assert_clean_exit(proc, proc.stop())


def _expect_refusal_logged(problems: PageProblems, status: int, path: str) -> None:
    """A refusal's page is answered with its status (409, 401), which Chromium
    logs as a failed load: exactly that one, then nothing else is allowed."""
    expected = [e for e in problems.console_errors if f"status of {status}" in e and path in e]
    assert len(expected) == 1, problems.console_errors
    problems.console_errors.remove(expected[0])


def _stack(
    procs: Processes, tmp_path: Path, db_url: str, redis_url: str, *, acker: bool
) -> Iterator[tuple[str, SwitchboardProcess, Path]]:
    ingest_config, web_config = _configs(tmp_path, db_url, redis_url)
    ingester = procs.start("ingest", ingest_config, name="ingest-1")
    running = [ingester]
    if acker:
        running.append(procs.start("ack", ingest_config, name="ack-1"))
    url = _start_web(procs, web_config)
    # Its adapters registered: a test that reads their rows (the cross-origin
    # POST's) found none once, the console up before the ingester.
    for proc in running:
        wait_ready(proc)
    yield url, ingester, web_config
    _stop_all(procs)


@pytest.fixture
def stack(
    procs: Processes, tmp_path: Path, db_url: str, redis_url: str
) -> Iterator[tuple[str, SwitchboardProcess, Path]]:
    """ingest on the strict config, the console on the fixed one: its URL,
    the ingester, and the console's config (no acker: most pages need none)."""
    yield from _stack(procs, tmp_path, db_url, redis_url, acker=False)


@pytest.fixture
def acked_stack(
    procs: Processes, tmp_path: Path, db_url: str, redis_url: str
) -> Iterator[tuple[str, SwitchboardProcess, Path]]:
    """``stack`` with an acker on the strict config too."""
    yield from _stack(procs, tmp_path, db_url, redis_url, acker=True)


def test_the_overview_updates_live_and_a_killed_ingester_shows_dead(
    acked_stack: tuple[str, SwitchboardProcess, Path],
    page: Page,
    page_problems: PageProblems,
    redis_url: str,
    db_url: str,
) -> None:
    url, ingester, _ = acked_stack
    page.goto(url + "/")
    row = page.locator('[data-testid=adapter-row][data-adapter="orders"]')
    expect(row.get_by_test_id("adapter-verdict")).to_have_text("ok", timeout=15_000)
    page.evaluate("window.__notReloaded = true")
    _xadd(redis_url, *(json.dumps({"n": i}) for i in range(7)))
    _wait_rows(db_url, 7)
    expect(row.get_by_test_id("adapter-stored")).to_have_text("7", timeout=10_000)
    expect(row.get_by_test_id("adapter-pending-acks")).to_have_text("0", timeout=10_000)
    assert page.evaluate("window.__notReloaded") is True  # htmx swapped the table; no reload

    page.goto(url + "/processes")
    page.evaluate("window.__notReloaded = true")
    ingester.kill()  # kill -9: no stop is recorded, the heartbeat just ends
    ingester.wait(30)
    # The TTL's 15 s, passed at once: the dead row's clock moved back (as
    # test_metrics_and_health does); the page still has to see it live.
    query(
        db_url,
        "UPDATE processes SET seen_at = seen_at - make_interval(secs => %(s)s),"
        " started_at = started_at - make_interval(secs => %(s)s) WHERE pid = %(pid)s AND role = 'ingest'",
        {"s": HEARTBEAT_TTL_S + 1, "pid": ingester.pid},
    )
    dead = page.locator(f'[data-testid=process-row][data-role="ingest"][data-pid="{ingester.pid}"]')
    expect(dead).to_have_attribute("data-state", "dead", timeout=20_000)
    assert page.evaluate("window.__notReloaded") is True
    page.goto(url + "/")
    expect(row.get_by_test_id("adapter-verdict")).to_have_text("UNHEALTHY")
    page_problems.assert_clean()


def test_the_overview_says_live_what_needs_attention_and_links_to_the_rows(
    stack: tuple[str, SwitchboardProcess, Path], page: Page, page_problems: PageProblems, db_url: str
) -> None:
    """A todo fails: the overview says so without a reload, its link lists
    it, the todo offers Retry (not Cancel), and once it is dealt with the
    verdict is ok again (tests/system/test_console_attention.py has every kind)."""
    url, _, _ = stack
    page.goto(url + "/")
    verdict = page.get_by_test_id("overview-verdict")
    expect(verdict).to_have_text("ok", timeout=15_000)
    page.evaluate("window.__notReloaded = true")
    [(todo_id,)] = query(
        db_url,
        "INSERT INTO todos (queue, idempotency_key, payload, status, attempts, last_error)"
        " VALUES ('orders', 'k-failed', '{}', 'failed', 5, 'boom') RETURNING id",
    )
    failed = page.locator('[data-testid=attention][data-kind="failed-todos"]')
    expect(failed).to_have_attribute("data-count", "1", timeout=10_000)
    expect(verdict).not_to_have_text("ok")
    assert page.evaluate("window.__notReloaded") is True  # htmx swapped it in
    failed.get_by_test_id("attention-link").click()
    expect(page).to_have_url(url + "/todos?status=failed")
    page.locator(f'[data-testid=todo-row][data-id="{todo_id}"] a').click()
    expect(page.get_by_test_id("todo-cancel")).to_have_count(0)
    page.get_by_test_id("todo-retry").click()
    expect(page.get_by_test_id("todo-status")).to_have_text("pending")
    # No worker runs here: cancelled before it would wait for one too long.
    page.get_by_test_id("todo-cancel").click()
    expect(page.get_by_test_id("todo-status")).to_have_text("cancelled")
    page.goto(url + "/")
    expect(verdict).to_have_text("ok", timeout=10_000)
    expect(page.get_by_test_id("attention")).to_have_count(0)
    page_problems.assert_clean()


def test_a_trail_by_entry_id_shows_every_step_in_order(
    acked_stack: tuple[str, SwitchboardProcess, Path],
    page: Page,
    page_problems: PageProblems,
    redis_url: str,
    db_url: str,
) -> None:
    url, _, _ = acked_stack
    [entry_id] = _xadd(redis_url, json.dumps({"n": 1}))
    _wait_rows(db_url, 1, "ack_state = 'acked'")
    page.goto(url + "/trace")
    page.get_by_test_id("trail-search").fill(entry_id)
    page.get_by_test_id("trail-search").press("Enter")
    steps = page.get_by_test_id("trail-step")
    expect(steps).to_have_count(4)
    assert [steps.nth(i).get_attribute("data-step") for i in range(4)] == [
        "xadd",
        "stored",
        "pending",
        "acked",
    ]
    # The event is shown between them, as a note of its own.
    expect(page.locator("ol.timeline li").nth(2)).to_have_attribute("data-testid", "trail-event")
    assert page.url.endswith(f"/trace?key={entry_id}")
    page_problems.assert_clean()


def test_hostile_bodies_and_errors_stay_text(
    stack: tuple[str, SwitchboardProcess, Path],
    page: Page,
    page_problems: PageProblems,
    redis_url: str,
    db_url: str,
) -> None:
    url, _, _ = stack
    # A body the schema rejects, a field named with markup; and one accepted
    # whose todo's error (as a handler's would be) is hostile too.
    _xadd(redis_url, json.dumps({"n": 1, HOSTILE: HOSTILE}), json.dumps({"n": 5}))
    _wait_rows(db_url, 2)
    [(rejected_id,)] = query(db_url, "SELECT id FROM inbox WHERE status = 'rejected'")
    [(todo_id,)] = query(db_url, "SELECT id FROM todos")
    query(
        db_url,
        "UPDATE todos SET last_error = %(e)s WHERE id = %(id)s RETURNING id",
        {"e": HOSTILE, "id": todo_id},
    )

    page.goto(f"{url}/inbox/{rejected_id}")
    expect(page.get_by_test_id("inbox-body")).to_contain_text("<script>alert")
    expect(page.get_by_test_id("inbox-error")).to_contain_text("schema_mismatch")
    page.goto(f"{url}/inbox?status=rejected")
    expect(page.get_by_test_id("inbox-row")).to_have_count(1)
    page.goto(f"{url}/todos/{todo_id}")
    expect(page.get_by_test_id("todo-last-error")).to_have_text(HOSTILE)
    page.goto(f"{url}/trace?key=todo:{todo_id}")
    expect(page.get_by_test_id("trail")).to_have_count(1)
    page.goto(f"{url}/todos")
    expect(page.get_by_test_id("todo-row")).to_have_count(1)
    assert page.locator("img").count() == 0  # no element was made from the text
    page_problems.assert_clean()  # no dialog, no console error, no CSP violation


def test_bulk_replay_takes_exactly_the_rows_its_dry_run_listed(
    stack: tuple[str, SwitchboardProcess, Path],
    page: Page,
    page_problems: PageProblems,
    redis_url: str,
    db_url: str,
) -> None:
    url, _, _ = stack
    _xadd(redis_url, *(json.dumps({"n": f"bad {i}"}) for i in range(3)))
    _wait_rows(db_url, 3, "status = 'rejected'")
    page.goto(f"{url}/inbox?status=rejected&adapter=orders")
    page.get_by_test_id("replay-dry-run").click()
    listed = page.get_by_test_id("dry-row")
    expect(listed).to_have_count(3)
    listed_ids = sorted(int(listed.nth(i).get_attribute("data-id") or 0) for i in range(3))
    assert all(listed.nth(i).get_attribute("data-ok") == "yes" for i in range(3))
    # Rejected after the dry run: the confirm must not take them.
    _xadd(redis_url, *(json.dumps({"n": f"late {i}"}) for i in range(2)))
    _wait_rows(db_url, 5, "status = 'rejected'")
    page.get_by_test_id("bulk-confirm").click()
    outcomes = page.get_by_test_id("outcome")
    expect(outcomes).to_have_count(3)
    assert all(outcomes.nth(i).get_attribute("data-ok") == "yes" for i in range(3))
    stored = [r[0] for r in query(db_url, "SELECT id FROM inbox WHERE status = 'stored' ORDER BY id")]
    assert stored == listed_ids
    assert scalar(db_url, "SELECT count(*) FROM inbox WHERE status = 'rejected'") == 2
    assert scalar(db_url, "SELECT count(*) FROM todos") == 3
    page_problems.assert_clean()


def test_a_filtered_url_reloaded_shows_the_same_rows(
    stack: tuple[str, SwitchboardProcess, Path],
    page: Page,
    page_problems: PageProblems,
    redis_url: str,
    db_url: str,
) -> None:
    url, _, _ = stack
    _xadd(redis_url, *(json.dumps({"n": f"x{i}"}) for i in range(3)), json.dumps({"z": 1}))
    _wait_rows(db_url, 4, "status = 'rejected'")
    page.goto(f"{url}/inbox?status=rejected")
    page.get_by_test_id("filter-error").fill("required")
    page.get_by_test_id("filter-apply").click()
    rows = page.get_by_test_id("inbox-row")
    expect(rows).to_have_count(1)
    first = [rows.nth(i).get_attribute("data-id") for i in range(rows.count())]
    filtered = page.url
    assert "error=required" in filtered
    page.reload()
    expect(rows).to_have_count(1)
    assert [rows.nth(i).get_attribute("data-id") for i in range(rows.count())] == first
    expect(page.get_by_test_id("filter-error")).to_have_value("required")
    [(expected,)] = query(db_url, "SELECT id FROM inbox WHERE error LIKE '%required%'")
    assert first == [str(expected)]
    page_problems.assert_clean()


def test_cancel_retry_and_the_refusal_of_a_retry(
    stack: tuple[str, SwitchboardProcess, Path],
    page: Page,
    page_problems: PageProblems,
    redis_url: str,
    db_url: str,
) -> None:
    url, _, _ = stack
    _xadd(redis_url, json.dumps({"n": 1}))
    _wait_rows(db_url, 1)
    [(todo_id,)] = query(db_url, "SELECT id FROM todos")
    page.goto(f"{url}/todos?status=pending")
    expect(page.get_by_test_id("todo-row")).to_have_count(1)
    # No worker runs here: the todo page and its trail say why it waits,
    # in `todos show`'s and `trace`'s own words (one action reads them all).
    waits = "no live worker serves queue orders"
    page.goto(f"{url}/trace?key=todo:{todo_id}")
    expect(page.get_by_test_id("trail-waiting")).to_contain_text(waits)
    page.goto(f"{url}/todos/{todo_id}")
    expect(page.get_by_test_id("todo-waiting")).to_contain_text(waits)
    # Each status shows the action it allows, and that one only.
    assert page.get_by_test_id("todo-retry").count() == 0
    page.get_by_test_id("todo-cancel").click()
    expect(page.get_by_test_id("action-notice")).to_contain_text("cancelled")
    assert scalar(db_url, "SELECT status FROM todos WHERE id = %(id)s", {"id": todo_id}) == "cancelled"
    expect(page.get_by_test_id("todo-cancel")).to_have_count(0)
    expect(page.get_by_test_id("todo-waiting")).to_have_count(0)  # a cancelled todo waits for nothing
    page.get_by_test_id("todo-retry").click()
    expect(page.get_by_test_id("todo-status")).to_have_text("pending")
    assert scalar(db_url, "SELECT status FROM todos WHERE id = %(id)s", {"id": todo_id}) == "pending"
    expect(page.get_by_test_id("todo-retry")).to_have_count(0)
    # A race: the CLI cancels it and the page shows Retry; the CLI retries it
    # first, so the page's Retry is refused, in the CLI's own words.
    assert switchboard("--config", str(stack[2]), "todos", "cancel", str(todo_id)).returncode == 0
    page.goto(f"{url}/todos/{todo_id}")
    assert switchboard("--config", str(stack[2]), "todos", "retry", str(todo_id)).returncode == 0
    page.get_by_test_id("todo-retry").click()
    expect(page.get_by_test_id("action-refused")).to_have_text(
        f"todo {todo_id} is pending, not failed or cancelled: only those can be retried"
    )
    expect(page.get_by_test_id("todo-retry")).to_have_count(0)  # the page as the todo is now
    refused = switchboard("--config", str(stack[2]), "todos", "retry", str(todo_id))
    assert f"todo {todo_id} is pending, not failed or cancelled" in refused.stderr + refused.stdout
    assert scalar(db_url, "SELECT status FROM todos WHERE id = %(id)s", {"id": todo_id}) == "pending"
    details = [r[0] for r in query(db_url, "SELECT detail FROM todo_events ORDER BY id")]
    assert details.count("retried by an operator") == 2  # the page's, then the CLI's
    _expect_refusal_logged(page_problems, 409, "/retry")
    page_problems.assert_clean()


def test_disable_and_enable_from_the_overview(
    stack: tuple[str, SwitchboardProcess, Path], page: Page, page_problems: PageProblems, db_url: str
) -> None:
    url, _, _ = stack
    page.goto(url + "/")
    row = page.locator('[data-testid=adapter-row][data-adapter="orders"]')
    row.get_by_test_id("adapter-toggle").click()
    expect(row.get_by_test_id("adapter-verdict")).to_have_text("disabled")
    assert scalar(db_url, "SELECT enabled FROM adapters WHERE name = 'orders'") is False
    row.get_by_test_id("adapter-toggle").click()
    expect(row.get_by_test_id("adapter-verdict")).to_have_text("ok", timeout=10_000)
    assert scalar(db_url, "SELECT enabled FROM adapters WHERE name = 'orders'") is True
    page_problems.assert_clean()


class _Attacker(BaseHTTPRequestHandler):
    """Another origin's page: a form that POSTs to the console on load."""

    target = ""

    def do_GET(self) -> None:
        html = (
            f'<!doctype html><form id="f" method="post" action="{self.target}">'
            '<input name="csrf" value="guessed"></form>'
            '<script>document.getElementById("f").submit();</script>'
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(html)))
        self.end_headers()
        self.wfile.write(html)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def test_a_cross_origin_post_changes_nothing(
    stack: tuple[str, SwitchboardProcess, Path], page: Page, db_url: str
) -> None:
    url, _, _ = stack
    handler = type("Attacker", (_Attacker,), {"target": f"{url}/adapters/orders/disable"})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        with page.expect_response(lambda r: r.url.endswith("/adapters/orders/disable")) as answer:
            page.goto(f"http://127.0.0.1:{server.server_address[1]}/")
        assert answer.value.status == 403
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
    assert scalar(db_url, "SELECT enabled FROM adapters WHERE name = 'orders'") is True
    # The console's own CSRF token does not make a foreign Origin acceptable.
    page.goto(url + "/")
    csrf = page.locator("input[name=csrf]").first.get_attribute("value")
    for origin in ("http://evil.example", "null"):
        request = urllib.request.Request(
            f"{url}/adapters/orders/disable",
            data=f"csrf={csrf}".encode(),
            headers={"Origin": origin, "Content-Type": "application/x-www-form-urlencoded"},
            method="POST",
        )
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=10)
        refused.value.close()
        assert refused.value.code == 403
    # The same POST from the console's origin without the token is refused too.
    missing = urllib.request.Request(
        f"{url}/adapters/orders/disable",
        data=b"csrf=",
        headers={"Origin": url, "Content-Type": "application/x-www-form-urlencoded"},
        method="POST",
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(missing, timeout=10)
    refused.value.close()
    assert refused.value.code == 403
    assert scalar(db_url, "SELECT enabled FROM adapters WHERE name = 'orders'") is True


def test_read_only_shows_no_action_and_refuses_every_post(
    procs: Processes, tmp_path: Path, db_url: str, redis_url: str, page: Page, page_problems: PageProblems
) -> None:
    ingest_config, web_config = _configs(tmp_path, db_url, redis_url)
    procs.start("ingest", ingest_config, name="ingest-1")
    _xadd(redis_url, json.dumps({"n": 1}), json.dumps({"n": "bad"}))
    _wait_rows(db_url, 2)
    url = _start_web(procs, web_config, "--read-only")
    [(todo_id,)] = query(db_url, "SELECT id FROM todos")
    [(inbox_id,)] = query(db_url, "SELECT id FROM inbox WHERE status = 'rejected'")
    page.goto(url + "/")
    expect(page.get_by_test_id("read-only")).to_be_visible()
    expect(page.get_by_test_id("adapter-row")).to_have_count(1)
    assert page.get_by_test_id("adapter-toggle").count() == 0
    page.goto(f"{url}/todos/{todo_id}")
    assert page.get_by_test_id("todo-retry").count() == 0
    assert page.get_by_test_id("todo-cancel").count() == 0
    page.goto(f"{url}/inbox/{inbox_id}")
    assert page.get_by_test_id("inbox-replay").count() == 0
    page.goto(f"{url}/inbox?status=rejected")
    assert page.get_by_test_id("replay-dry-run").count() == 0
    for path in (f"/todos/{todo_id}/cancel", "/adapters/orders/disable", f"/inbox/{inbox_id}/replay"):
        answer = page.request.post(url + path, headers={"Origin": url}, form={"csrf": "x"})
        assert answer.status == 403, path
    assert scalar(db_url, "SELECT status FROM todos") == "pending"
    assert scalar(db_url, "SELECT enabled FROM adapters") is True
    assert scalar(db_url, "SELECT status FROM inbox WHERE id = %(id)s", {"id": inbox_id}) == "rejected"
    _stop_all(procs)
    page_problems.assert_clean()


def test_the_token_guards_every_page_and_is_shown_nowhere(
    procs: Processes, tmp_path: Path, db_url: str, redis_url: str, page: Page, page_problems: PageProblems
) -> None:
    _, web_config = _configs(tmp_path, db_url, redis_url)
    url = _start_web(procs, web_config, env={"SWITCHBOARD_WEB_TOKEN": TOKEN})
    page.goto(url + "/todos?status=failed")
    assert page.url == url + "/login?next=%2Ftodos%3Fstatus%3Dfailed"
    page.get_by_test_id("login-token").fill("not-the-token-at-all")
    page.get_by_test_id("login-submit").click()
    expect(page.get_by_test_id("login-failed")).to_be_visible()
    _expect_refusal_logged(page_problems, 401, "/login")
    page.get_by_test_id("login-token").fill(TOKEN)
    page.get_by_test_id("login-submit").click()
    # Signed in, on the page asked for (a wrong token first did not lose it).
    expect(page).to_have_url(url + "/todos?status=failed")
    expect(page.get_by_test_id("filter-status")).to_have_value("failed")
    [cookie] = page.context.cookies()
    assert cookie["httpOnly"] is True
    assert cookie["sameSite"] == "Strict"
    assert TOKEN not in cookie["value"]
    for path in ("/", "/todos", "/processes", "/charts", "/inbox?status=rejected"):
        page.goto(url + path)
        assert TOKEN not in page.content()
        assert TOKEN not in page.url
    # Without the cookie: no page; with the bearer token: the page.
    assert urllib.request.urlopen(url + "/healthz", timeout=10).read() == b"ok"
    with urllib.request.urlopen(url + "/todos", timeout=10) as unauthenticated:
        assert unauthenticated.url == url + "/login?next=%2Ftodos"  # sent to sign in, shown nothing
        assert b"login-token" in unauthenticated.read()
    bearer = urllib.request.Request(url + "/todos", headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(bearer, timeout=10) as answer:
        assert answer.status == 200
    [web] = procs.all
    assert_clean_exit(web, web.stop())
    assert TOKEN not in web.raw_log()
    page_problems.assert_clean()


def test_off_loopback_without_a_token_is_refused(tmp_path: Path, db_url: str, redis_url: str) -> None:
    _, web_config = _configs(tmp_path, db_url, redis_url)
    refused = switchboard("--config", str(web_config), "web", "--listen", f"0.0.0.0:{free_port()}")
    assert refused.returncode == 2, refused.stderr
    assert "SWITCHBOARD_WEB_TOKEN is not set" in refused.stderr
    short = switchboard(
        "--config",
        str(web_config),
        "web",
        "--listen",
        f"127.0.0.1:{free_port()}",
        env={"SWITCHBOARD_WEB_TOKEN": "short"},
    )
    assert short.returncode == 2, short.stderr
    assert "16 characters" in short.stderr


def test_a_login_that_may_not_write_makes_the_console_read_only(
    procs: Processes,
    tmp_path: Path,
    servers: ServerUrls,
    redis_url: str,
    page: Page,
    page_problems: PageProblems,
) -> None:
    """ops/roles.sql's viewer: the same pages, no action, every POST 403;
    the operator's login on the same database acts."""
    with role_database(servers.database) as rdb:
        migrate_and_grant(rdb)
        ingest_config, _ = _configs(tmp_path, rdb.admin_url, redis_url)
        ingester = procs.start("ingest", ingest_config, name="ingest-1")
        _xadd(redis_url, json.dumps({"n": 1}))
        _wait_rows(rdb.admin_url, 1)
        assert_clean_exit(ingester, ingester.stop())
        viewer_config = write_config(
            tmp_path / "viewer.toml",
            database_url=rdb.url("viewer"),
            redis_url=redis_url,
            adapters=[_adapter()],
        )
        url = _start_web(procs, viewer_config)
        [(todo_id,)] = query(rdb.admin_url, "SELECT id FROM todos")
        page.goto(url + "/")
        expect(page.get_by_test_id("read-only")).to_be_visible()
        expect(page.get_by_test_id("adapter-row")).to_have_count(1)
        assert page.get_by_test_id("adapter-toggle").count() == 0
        page.goto(f"{url}/todos/{todo_id}")
        expect(page.get_by_test_id("todo-status")).to_have_text("pending")
        assert page.get_by_test_id("todo-cancel").count() == 0
        answer = page.request.post(
            f"{url}/todos/{todo_id}/cancel", headers={"Origin": url}, form={"csrf": "x"}
        )
        assert answer.status == 403
        assert "read-only" in answer.text()
        assert scalar(rdb.admin_url, "SELECT status FROM todos") == "pending"
        _stop_all(procs)

        operator_config = write_config(
            tmp_path / "operator.toml",
            database_url=rdb.url("operator"),
            redis_url=redis_url,
            adapters=[_adapter()],
        )
        url = _start_web(procs, operator_config)
        page.goto(f"{url}/todos/{todo_id}")
        assert page.get_by_test_id("read-only").count() == 0
        page.get_by_test_id("todo-cancel").click()
        expect(page.get_by_test_id("todo-status")).to_have_text("cancelled")
        assert scalar(rdb.admin_url, "SELECT status FROM todos") == "cancelled"
        _stop_all(procs)
    page_problems.assert_clean()


def test_bulk_cancel_and_retry_take_exactly_the_listed_todos(
    stack: tuple[str, SwitchboardProcess, Path],
    page: Page,
    page_problems: PageProblems,
    redis_url: str,
    db_url: str,
) -> None:
    url, _, _ = stack
    _xadd(redis_url, *(json.dumps({"n": i}) for i in range(3)))
    _wait_rows(db_url, 3)
    page.goto(f"{url}/todos?queue=orders&status=pending")
    page.get_by_test_id("todos-bulk-cancel").click()
    listed = page.get_by_test_id("dry-row")
    expect(listed).to_have_count(3)
    listed_ids = sorted(int(listed.nth(i).get_attribute("data-id") or 0) for i in range(3))
    _xadd(redis_url, json.dumps({"n": 99}))  # pending after the dry run: not taken
    _wait_rows(db_url, 4)
    page.get_by_test_id("bulk-confirm").click()
    expect(page.get_by_test_id("outcome")).to_have_count(3)
    cancelled = [r[0] for r in query(db_url, "SELECT id FROM todos WHERE status = 'cancelled' ORDER BY id")]
    assert cancelled == listed_ids
    assert scalar(db_url, "SELECT count(*) FROM todos WHERE status = 'pending'") == 1

    page.goto(f"{url}/todos?status=cancelled")
    page.get_by_test_id("todos-bulk-retry").click()
    expect(page.get_by_test_id("dry-row")).to_have_count(3)
    page.get_by_test_id("bulk-confirm").click()
    expect(page.locator('[data-testid=outcome][data-ok="yes"]')).to_have_count(3)
    assert scalar(db_url, "SELECT count(*) FROM todos WHERE status = 'pending'") == 4
    page_problems.assert_clean()


def test_the_pause_control_stops_the_live_updates(
    stack: tuple[str, SwitchboardProcess, Path],
    page: Page,
    page_problems: PageProblems,
    redis_url: str,
    db_url: str,
) -> None:
    url, _, _ = stack
    page.goto(url + "/")
    stored = page.locator('[data-testid=adapter-row][data-adapter="orders"]').get_by_test_id("adapter-stored")
    expect(stored).to_have_text("0", timeout=15_000)
    toggle = page.get_by_test_id("live-toggle")
    toggle.click()
    expect(toggle).to_have_attribute("aria-pressed", "true")
    polls: list[str] = []
    page.on("request", lambda r: polls.append(r.url) if "/fragments/" in r.url else None)
    _xadd(redis_url, json.dumps({"n": 1}), json.dumps({"n": 2}))
    _wait_rows(db_url, 2)
    # Two poll intervals pass with nothing asked and nothing changed.
    page.wait_for_timeout(4_500)
    assert polls == []
    expect(stored).to_have_text("0")
    toggle.click()
    expect(toggle).to_have_attribute("aria-pressed", "false")
    expect(stored).to_have_text("2", timeout=10_000)
    assert polls
    page_problems.assert_clean()


def test_odd_requests_are_refused_never_a_server_error(
    stack: tuple[str, SwitchboardProcess, Path], procs: Processes
) -> None:
    """What anyone can type into a URL or a form is answered 4xx (or the
    page saying nothing matched), never 500 nor a database error's 503."""
    url, _, _ = stack
    for path, status in (
        ("/todos/%C2%B2", 404),  # "²": a digit to str.isdigit, not to int()
        ("/todos/99999999999999999999999", 404),
        ("/inbox/9223372036854775808", 404),
        ("/inbox/x", 404),
        ("/trace?key=%00", 400),
        ("/inbox?status=rejected&error=%00", 400),
        ("/inbox?status=rejected&since=tomorrow", 200),  # the page says what is wrong
        ("/inbox?status=rejected&after=-1", 200),
        ("/todos?status=nonsense", 200),
        ("/trace?key=" + "9" * 5000, 200),
        ("/trace?key=todo:%C2%B2", 200),
        ("/nowhere", 404),
    ):
        try:
            with urllib.request.urlopen(url + path, timeout=10) as answer:
                got = answer.status
        except urllib.error.HTTPError as refused:
            refused.close()
            got = refused.code
        assert got == status, path
    [web] = [p for p in procs.all if p.verb == "web"]
    assert "Traceback" not in web.raw_log()


def test_a_bulk_replay_past_its_first_batch_takes_the_next_and_pins_only_replayable_rows(
    stack: tuple[str, SwitchboardProcess, Path],
    page: Page,
    page_problems: PageProblems,
    redis_url: str,
    db_url: str,
) -> None:
    url, _, _ = stack
    # 101 rows the fixed rule takes, then one no rule takes (not JSON),
    # stored after them: within one batch rows take ids in key order, and
    # "...-100" sorts before "...-99", so it could land among the first 100.
    _xadd(redis_url, *(json.dumps({"n": f"bad {i}"}) for i in range(101)))
    _wait_rows(db_url, 101, "status = 'rejected'")
    _xadd(redis_url, "{not json")
    _wait_rows(db_url, 102, "status = 'rejected'")
    page.goto(f"{url}/inbox?status=rejected&adapter=orders")
    page.get_by_test_id("replay-dry-run").click()
    expect(page.get_by_test_id("dry-row")).to_have_count(100)
    page.get_by_test_id("bulk-next").click()
    rows = page.get_by_test_id("dry-row")
    expect(rows).to_have_count(2)
    assert [rows.nth(i).get_attribute("data-ok") for i in range(2)] == ["yes", "no"]
    [(last_good,)] = query(db_url, "SELECT max(id) FROM inbox WHERE error LIKE 'schema%%'")
    assert rows.nth(0).get_attribute("data-id") == str(last_good)
    page.get_by_test_id("bulk-confirm").click()
    expect(page.get_by_test_id("outcome")).to_have_count(1)  # the refused row was not pinned
    assert query(db_url, "SELECT id FROM inbox WHERE status = 'stored'") == [(last_good,)]
    assert scalar(db_url, "SELECT count(*) FROM inbox WHERE status = 'rejected'") == 101
    page_problems.assert_clean()
