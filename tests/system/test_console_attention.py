"""The console's overview answers "is anything wrong?" (issue 44), against
the real ``switchboard web`` over loopback: failed todos, todos running past
their time limit, todos waiting with no live worker, rejected inbox rows and
failing processes each stand as one ``attention`` element (DESIGN.md section
13: ``data-kind``, ``data-count``, a link to the rows), and the
``overview-verdict`` is ``ok`` only while none does. And the frictions of
the same issue: signing in keeps the page asked for (a same-origin path
only), a todo offers only the action its status allows, and the processes
page hides the stopped and replaced rows until asked. The rows are written
with SQL, as the pipeline would leave them; assertions are on the pages the
console serves."""

from __future__ import annotations

import http.client
import json
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urlsplit

import pytest

from backhalf.reads.attention_views import COUNT_LIMIT
from ingest.embedded.processes import wait_for
from ingest.embedded.servers import free_port
from tests.support.config import write_config
from tests.support.db import query, scalar
from tests.support.processes import Processes, assert_clean_exit

pytestmark = pytest.mark.system

TOKEN = "console-token-0123456789abcdef"
# The console's own config: no adapter to check (no broker asked), one queue
# with a short time limit; any other queue has [queues]'s default, 10 minutes.
QUEUES = {"fast": {"handler": "tests.support.handlers:nothing", "time_limit_ms": 1_000}}


@dataclass
class Page:
    """What a test reads of a page: its status, headers, the elements that
    carry a ``data-testid`` (their attributes, and the text inside them)."""

    status: int
    headers: Mapping[str, str]
    body: str
    hooks: list[dict[str, str]] = field(default_factory=list)

    def all(self, testid: str) -> list[dict[str, str]]:
        return [h for h in self.hooks if h.get("data-testid") == testid]

    def one(self, testid: str) -> dict[str, str]:
        [found] = self.all(testid)
        return found

    def of(self, kind: str, testid: str) -> dict[str, str]:
        """The element ``testid`` inside the ``attention`` element of ``kind``."""
        [found] = [h for h in self.all(testid) if h.get("in-kind") == kind]
        return found

    def attention(self) -> dict[str, dict[str, str]]:
        """Each ``attention`` element by its ``data-kind`` (one per kind)."""
        found = self.all("attention")
        by_kind = {a["data-kind"]: a for a in found}
        assert len(by_kind) == len(found), found
        return by_kind


class _Hooks(HTMLParser):
    """Every element with a ``data-testid``: its attributes, its text as
    ``text``; for an ``attention`` element the href of its link as
    ``link``, and for an element inside one that one's kind as ``in-kind``."""

    VOID = frozenset({"input", "br", "img", "meta", "link", "hr"})

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.hooks: list[dict[str, str]] = []
        self._open: list[tuple[str, dict[str, str] | None]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = {k: v or "" for k, v in attrs}
        hook = None
        if "data-testid" in found:
            hook = {**found, "text": ""}
            self.hooks.append(hook)
            for _, outer in reversed(self._open):
                if outer is not None and outer["data-testid"] == "attention":
                    hook["in-kind"] = outer["data-kind"]
                    if found["data-testid"] == "attention-link":
                        outer["link"] = found.get("href", "")
                    break
        if tag not in self.VOID:
            self._open.append((tag, hook))

    def handle_endtag(self, tag: str) -> None:
        while self._open:
            opened, _ = self._open.pop()
            if opened == tag:
                break

    def handle_data(self, data: str) -> None:
        for _, hook in self._open:
            if hook is not None:
                hook["text"] += data


def fetch(
    base: str,
    path: str,
    *,
    method: str = "GET",
    form: Mapping[str, str] | None = None,
    headers: Mapping[str, str] | None = None,
) -> Page:
    """One request, redirects not followed."""
    parts = urlsplit(base)
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=30)
    try:
        sent = dict(headers or {})
        body = None
        if form is not None:
            body = urlencode(form)
            sent.update({"Content-Type": "application/x-www-form-urlencoded", "Origin": base})
        conn.request(method, path, body=body, headers=sent)
        answer = conn.getresponse()
        text = answer.read().decode()
        page = Page(answer.status, {k.lower(): v for k, v in answer.getheaders()}, text)
    finally:
        conn.close()
    parser = _Hooks()
    parser.feed(page.body)
    page.hooks = parser.hooks
    return page


@pytest.fixture
def start_console(
    procs: Processes, tmp_path: Path, db_url: str, redis_url: str
) -> Iterator[Callable[..., str]]:
    """Starts ``switchboard web`` (no adapter, ``QUEUES``) and gives its URL."""

    def start(env: dict[str, str] | None = None) -> str:
        config = write_config(
            tmp_path / "web.toml", database_url=db_url, redis_url=redis_url, adapters=[], queues=QUEUES
        )
        port = free_port()
        proc = procs.start("web", config, name="web", args=["--listen", f"127.0.0.1:{port}"], env=env)
        wait_for(lambda: proc.events("web_listening") or not proc.alive(), timeout_s=30, what="the console")
        assert proc.alive(), proc.raw_log()[-3000:]
        return f"http://127.0.0.1:{port}"

    yield start
    for proc in procs.all:
        if proc.alive():
            assert_clean_exit(proc, proc.stop())


def todos(db_url: str, queue: str, status: str, n: int = 1, **columns: str) -> list[int]:
    """``n`` todos of ``queue`` in ``status``; ``columns``: SQL expressions
    for other columns (``updated_at="now() - interval '11 minutes'"``)."""
    names = "".join(f", {name}" for name in columns)
    values = "".join(f", {expression}" for expression in columns.values())
    rows = query(
        db_url,
        f"INSERT INTO todos (queue, idempotency_key, payload, status, attempts{names})"
        f" SELECT %(q)s, %(k)s || ':' || g, '{{}}', %(s)s, 1{values}"
        " FROM generate_series(1, %(n)s::int) g RETURNING id",
        {"q": queue, "s": status, "n": n, "k": f"{status}:{uuid.uuid4()}"},
    )
    return sorted(int(r[0]) for r in rows)


def rejected(db_url: str, n: int) -> None:
    query(
        db_url,
        "INSERT INTO adapters (name, family, transport, mode, settings) VALUES ('orders', 'queue', 'redis',"
        " 'stream', %(s)s::jsonb) ON CONFLICT DO NOTHING",
        {"s": json.dumps({"source": "orders", "key_prefix": "redis", "queue": "orders"})},
    )
    query(
        db_url,
        "INSERT INTO inbox (adapter, idempotency_key, source_message_id, body, ack_kind, ack_state,"
        " acked_at, status, error) SELECT 'orders', 'redis:orders:' || g || '-0', g || '-0', 'not json',"
        " 'xack', 'acked', now(), 'rejected', 'invalid_json: expecting value'"
        " FROM generate_series(1, %(n)s::int) g",
        {"n": n},
    )


def process(
    db_url: str,
    role: str,
    *,
    seen: str = "now()",
    started: str = "now()",
    stopped: str = "NULL",
    detail: Mapping[str, Any] | None = None,
    host: str = "h1",
) -> None:
    """A heartbeat row; ``seen_at`` in the future keeps it alive for the test."""
    query(
        db_url,
        "INSERT INTO processes (instance, role, host, pid, detail, started_at, seen_at, stopped_at)"
        f" VALUES (%(i)s, %(r)s, %(h)s, %(p)s, %(d)s::jsonb, {started}, {seen}, {stopped})",
        {"i": uuid.uuid4(), "r": role, "h": host, "p": 40_000 + len(role), "d": json.dumps(detail or {})},
    )


def overview(url: str, settle: Callable[[Page], bool] | None = None) -> Page:
    """The overview, read again (its reading is shared for 1.5 s) until ``settle`` holds."""
    page = fetch(url, "/")
    deadline = time.monotonic() + 10
    while settle is not None and not settle(page) and time.monotonic() < deadline:
        time.sleep(0.5)
        page = fetch(url, "/")
    assert page.status == 200, page.body[-2000:]
    return page


def test_nothing_wrong_reads_ok_with_no_attention(start_console: Callable[..., str], db_url: str) -> None:
    url = start_console()
    # Finished todos, a recent pending one, a running one within its limit,
    # an alive worker, a stopped process: none of them is a problem.
    todos(db_url, "orders", "done", 3)
    todos(db_url, "orders", "cancelled")
    todos(db_url, "slow", "running", updated_at="now()")
    todos(db_url, "orders", "pending")
    process(db_url, "ingest", stopped="now()")
    page = overview(url)
    assert page.one("overview-verdict")["text"] == "ok"
    assert page.all("attention") == []


def test_failed_todos_stand_with_their_count_newest_and_link(
    start_console: Callable[..., str], db_url: str
) -> None:
    url = start_console()
    todos(db_url, "orders", "done", 2)
    failed = todos(db_url, "orders", "failed", 3, last_error="'handler raised: <b>boom</b>'")
    page = overview(url)
    assert page.one("overview-verdict")["text"] != "ok"
    item = page.attention()["failed-todos"]
    assert item["data-count"] == "3"
    assert item["link"] == "/todos?status=failed"
    example = page.of("failed-todos", "attention-example")
    assert example["href"] == f"/todos/{failed[-1]}"
    assert f"todo {failed[-1]}" in example["text"]
    # The last error, as text: not markup.
    assert page.of("failed-todos", "attention-detail")["text"] == "handler raised: <b>boom</b>"
    assert "<b>boom" not in page.body
    listed = fetch(url, item["link"])
    assert sorted(int(r["data-id"]) for r in listed.all("todo-row")) == failed

    # Retried (as an operator would): the verdict is ok again.
    query(db_url, "UPDATE todos SET status = 'done' WHERE status = 'failed'")
    page = overview(url, lambda p: not p.all("attention"))
    assert page.all("attention") == []
    assert page.one("overview-verdict")["text"] == "ok"


def test_failed_todos_past_the_count_limit_read_as_more(
    start_console: Callable[..., str], db_url: str
) -> None:
    url = start_console()
    todos(db_url, "b", "failed", 2)
    many = todos(db_url, "a", "failed", COUNT_LIMIT + 5)
    page = overview(url)
    item = page.attention()["failed-todos"]
    assert item["data-count"] == str(COUNT_LIMIT + 2)  # each queue read up to the limit
    assert item["data-more"] == "yes"
    assert f"{COUNT_LIMIT + 2}+" in item["text"]
    # The newest all the same.
    assert page.of("failed-todos", "attention-example")["href"] == f"/todos/{many[-1]}"


def test_long_running_todos_stand_with_the_oldest_age(start_console: Callable[..., str], db_url: str) -> None:
    url = start_console()
    [oldest] = todos(db_url, "slow", "running", updated_at="now() - interval '11 minutes'")  # 10 min default
    [quick] = todos(db_url, "fast", "running", updated_at="now() - interval '5 seconds'")  # limit 1 s
    [fine] = todos(db_url, "slow", "running", updated_at="now() - interval '1 minute'")
    page = overview(url)
    assert page.one("overview-verdict")["text"] != "ok"
    item = page.attention()["long-running"]
    assert item["data-count"] == "2"
    assert item["link"] == "/todos?status=running"
    example = page.of("long-running", "attention-example")
    assert example["href"] == f"/todos/{oldest}"
    assert "running for 11." in example["text"]
    assert "min" in example["text"]

    listed = fetch(url, item["link"])
    assert {int(a["data-id"]) for a in listed.all("todo-row")} == {oldest, quick, fine}
    flagged = [a for a in listed.all("todo-age") if a.get("data-over-limit") == "yes"]
    assert len(flagged) == 2
    detail = fetch(url, f"/todos/{oldest}")
    assert detail.one("todo-age").get("data-over-limit") == "yes"
    assert "11." in detail.one("todo-age")["text"]


def test_rejected_inbox_rows_stand_with_a_link_to_them(
    start_console: Callable[..., str], db_url: str
) -> None:
    url = start_console()
    rejected(db_url, 2)
    page = overview(url)
    assert page.one("overview-verdict")["text"] != "ok"
    item = page.attention()["rejected-inbox"]
    assert item["data-count"] == "2"
    assert item["link"] == "/inbox?status=rejected"
    assert len(fetch(url, item["link"]).all("inbox-row")) == 2


def test_failing_processes_stand_and_stopped_ones_do_not(
    start_console: Callable[..., str], db_url: str
) -> None:
    url = start_console()
    process(db_url, "ingest", seen="now() - interval '1 minute'")  # silent: dead
    process(db_url, "ack", stopped="now()")
    page = overview(url)
    assert page.one("overview-verdict")["text"] != "ok"
    item = page.attention()["process-failing"]
    assert item["data-count"] == "1"
    assert item["link"] == "/processes"
    dead = fetch(url, item["link"]).all("process-row")
    assert [p["data-role"] for p in dead if p["data-state"] == "dead"] == ["ingest"]


def test_todos_waiting_for_a_queue_no_worker_serves_stand(
    start_console: Callable[..., str], db_url: str
) -> None:
    url = start_console()
    waiting = todos(db_url, "orders", "pending", 2, run_after="now() - interval '1 minute'")
    todos(db_url, "served", "pending", 3, run_after="now() - interval '1 minute'")
    process(
        db_url, "worker", seen="now() + interval '1 hour'", detail={"queues": ["served"], "slot": "served"}
    )
    # A worker that is dead does not serve its queue.
    process(db_url, "worker", seen="now() - interval '1 hour'", detail={"queues": ["orders"]}, host="h2")
    page = overview(url)
    assert page.one("overview-verdict")["text"] != "ok"
    item = page.attention()["waiting-no-worker"]
    assert item["data-count"] == "2"
    assert item["link"] == "/todos?status=pending&queue=orders"
    assert "orders" in page.of("waiting-no-worker", "attention-detail")["text"]
    listed = fetch(url, item["link"])
    assert sorted(int(r["data-id"]) for r in listed.all("todo-row")) == waiting

    # A live worker of the queue: nothing waits for want of one.
    process(db_url, "worker", seen="now() + interval '1 hour'", detail={"queues": ["orders"]}, host="h3")
    page = overview(url, lambda p: "waiting-no-worker" not in p.attention())
    assert "waiting-no-worker" not in page.attention()


def test_a_todo_offers_only_the_action_its_status_allows(
    start_console: Callable[..., str], db_url: str
) -> None:
    url = start_console()
    offered = {
        "pending": "cancel",
        "running": "cancel",
        "failed": "retry",
        "cancelled": "retry",
        "done": None,
    }
    ids = {s: todos(db_url, "orders", s)[0] for s in offered}
    [dispatched] = todos(db_url, "other", "dispatched")
    for todo_status, action in {**offered, "dispatched": "cancel"}.items():
        todo_id = dispatched if todo_status == "dispatched" else ids[todo_status]
        page = fetch(url, f"/todos/{todo_id}")
        assert page.one("todo-status")["text"] == todo_status
        shown = {a for a in ("retry", "cancel") if page.all(f"todo-{a}")}
        assert shown == ({action} if action else set()), todo_status
    # The bulk actions of a list filtered by status: the one that can act.
    assert fetch(url, "/todos?status=failed").all("todos-bulk-cancel") == []
    assert fetch(url, "/todos?status=pending").all("todos-bulk-retry") == []
    assert len(fetch(url, "/todos").all("todos-bulk-retry")) == 1
    # A stale page's action (the todo moved on meanwhile) is still refused.
    csrf = fetch(url, f"/todos/{ids['failed']}").body.split('name="csrf" value="')[1].split('"')[0]
    refused = fetch(url, f"/todos/{ids['pending']}/retry", method="POST", form={"csrf": csrf})
    assert refused.status == 409
    assert "is pending, not failed or cancelled" in refused.one("action-refused")["text"]
    assert scalar(db_url, "SELECT status FROM todos WHERE id = %(i)s", {"i": ids["pending"]}) == "pending"


def test_stopped_and_replaced_processes_are_listed_on_asking_only(
    start_console: Callable[..., str], db_url: str
) -> None:
    url = start_console()
    process(db_url, "ack", stopped="now() - interval '1 minute'")
    process(db_url, "ingest", seen="now() - interval '1 hour'", started="now() - interval '2 hours'")
    process(db_url, "ingest", seen="now() + interval '1 hour'", started="now() - interval '30 minutes'")
    states = sorted(p["data-state"] for p in fetch(url, "/processes").all("process-row"))
    assert states == ["alive", "alive"]  # the new ingester and the console itself
    page = fetch(url, "/processes")
    assert page.one("processes-hidden")["data-count"] == "2"
    assert page.one("processes-toggle")["href"] == "/processes?show=all"
    every = fetch(url, "/processes?show=all")
    assert sorted(p["data-state"] for p in every.all("process-row")) == [
        "alive",
        "alive",
        "replaced",
        "stopped",
    ]
    assert 'hx-get="/fragments/processes?show=all"' in every.body  # the live table keeps asking for them
    fragment = fetch(url, "/fragments/processes?show=all", headers={"HX-Request": "true"})
    assert len(fragment.all("process-row")) == 4
    assert len(fetch(url, "/fragments/processes", headers={"HX-Request": "true"}).all("process-row")) == 2
    assert len(overview(url).all("process-row")) == 2


def test_signing_in_goes_back_to_the_page_asked_for_and_nowhere_else(
    start_console: Callable[..., str],
) -> None:
    url = start_console(env={"SWITCHBOARD_WEB_TOKEN": TOKEN})
    asked = "/todos?status=failed&queue=orders"
    sent = fetch(url, asked)
    assert sent.status == 303
    assert sent.headers["location"] == "/login?" + urlencode({"next": asked})
    form = fetch(url, sent.headers["location"])
    assert form.one("login-next")["value"] == asked
    signed_in = fetch(url, "/login", method="POST", form={"token": TOKEN, "next": asked})
    assert signed_in.status == 303
    assert signed_in.headers["location"] == asked
    cookie = signed_in.headers["set-cookie"].split(";")[0]
    assert fetch(url, asked, headers={"Cookie": cookie}).status == 200

    # Only a path of the console: anything else goes to the overview.
    for elsewhere in (
        "//evil.example/x",
        "https://evil.example/",
        "/\\evil.example",
        "\\/evil.example",
        "/\t/evil.example",
        "http:evil.example",
        "evil.example",
        "/login",
        "",
    ):
        answer = fetch(url, "/login", method="POST", form={"token": TOKEN, "next": elsewhere})
        assert answer.status == 303
        assert answer.headers["location"] == "/", elsewhere
    assert fetch(url, "/login?" + urlencode({"next": "//evil.example"})).all("login-next") == []
    assert fetch(url, "/").headers["location"] == "/login"  # the overview needs no next
