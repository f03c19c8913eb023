"""The browser harness itself (tests/support/browser.py): the system's
Chromium loads a page served with a strict CSP, runs its same-origin script
and reports nothing; and the recorder does see what a page does wrong (an
inline script refused by the CSP, a console error, an uncaught error, an
alert), so a clean report means a clean page."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from playwright.sync_api import Page, expect

from tests.support.browser import PageProblems

pytestmark = pytest.mark.system

CSP = "default-src 'self'"


def _html(body: str, head: str = "") -> bytes:
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8"><title>smoke</title>'
        f"{head}</head><body>{body}</body></html>"
    ).encode()


FILES: dict[str, tuple[str, bytes]] = {
    "/": (
        "text/html; charset=utf-8",
        _html('<button id="go">Go</button><p id="out">before</p>', '<script src="/app.js" defer></script>'),
    ),
    "/app.js": (
        "text/javascript",
        b'document.getElementById("go").addEventListener("click", () => {\n'
        b'  document.getElementById("out").textContent = "clicked";\n'
        b"});\n",
    ),
    "/inline": (
        "text/html; charset=utf-8",
        _html('<p id="out">before</p><script>document.title = "ran";</script>'),
    ),
    "/noisy": ("text/html; charset=utf-8", _html("<p>noisy</p>", '<script src="/noisy.js"></script>')),
    "/noisy.js": (
        "text/javascript",
        b'console.error("noisy: a console error");\n'
        b'alert("noisy: an alert");\n'
        b'throw new Error("noisy: uncaught");\n',
    ),
    # Chromium asks for it on every first load: a 404 would be a console error.
    "/favicon.ico": ("image/x-icon", b""),
}


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        found = FILES.get(self.path)
        if found is None:
            self.send_error(404)
            return
        content_type, body = found
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Content-Security-Policy", CSP)
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def site() -> Iterator[str]:
    """The base URL of FILES, served on a thread from 127.0.0.1 on a free port."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, name="smoke-http")
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        thread.join(timeout=10)
        server.server_close()


def test_a_same_origin_script_runs_under_the_csp_and_nothing_is_reported(
    page: Page, page_problems: PageProblems, site: str
) -> None:
    page.goto(f"{site}/")
    page.click("#go")
    expect(page.locator("#out")).to_have_text("clicked")
    page_problems.assert_clean()


def test_the_recorder_sees_a_refused_inline_script(
    page: Page, page_problems: PageProblems, site: str
) -> None:
    with page.expect_console_message(lambda message: "Content Security Policy" in message.text):
        page.goto(f"{site}/inline")
    assert page.title() == "smoke"  # the inline script did not run
    assert len(page_problems.csp_violations) == 1, page_problems
    assert "script-src" in page_problems.csp_violations[0]
    assert page_problems.csp_events() == ["script-src-elem inline"]
    assert page_problems.console_errors == []
    assert page_problems.page_errors == []
    assert page_problems.dialogs == []
    with pytest.raises(AssertionError, match="CSP violations"):
        page_problems.assert_clean()


def test_the_recorder_sees_console_errors_page_errors_and_dialogs(
    page: Page, page_problems: PageProblems, site: str
) -> None:
    with page.expect_event("pageerror"):
        page.goto(f"{site}/noisy")
    assert [error.split(" (")[0] for error in page_problems.console_errors] == ["noisy: a console error"]
    assert page_problems.dialogs == ["alert: noisy: an alert"]
    assert page_problems.page_errors == ["Error: noisy: uncaught"]
    assert page_problems.csp_violations == []
    assert page_problems.csp_events() == []
    with pytest.raises(AssertionError, match="page errors"):
        page_problems.assert_clean()
