"""Browser tests on the system's Chromium (Debian's ``chromium``; ``make
chromium`` installs it under root), driven by Playwright's sync API through
the driver its wheel carries: never ``playwright install``, never a browser
download. Where ``/usr/bin/chromium`` (or the ``playwright`` package) is
missing, the tests that need a browser are skipped, each with a reason
starting ``NO_BROWSER``, and the session's summary counts them
(tests/conftest.py), so a run without a browser never reads as a pass.

One Playwright driver and one headless Chromium per test session (per xdist
worker), started on first use (``chromium_session``); each test gets a
context of its own, so no cookie, storage or cache crosses tests
(``recording_page``). What a page does wrong is recorded, not raised
(``PageProblems``): console errors, uncaught page errors, dialogs (dismissed)
and Content Security Policy violations, both as Chromium's console reports
them and as the page's own ``securitypolicyviolation`` events, which an init
script collects into ``window.__cspViolations`` (init scripts come through
the DevTools protocol: the page's CSP does not block them). A test asserts
``problems.assert_clean()`` when it means it.

The sync API and asyncio in one thread: between two sync calls Playwright
leaves its event loop marked as running in the calling thread (its
dispatcher greenlet is suspended inside ``run_forever``), so ``asyncio.run``
or pytest-asyncio's runner would refuse to start there ("cannot be called
from a running event loop"). The session therefore marks the loop only while
a test holds a page (``ChromiumSession.active``) and unmarks it in between:
the async tests that the same worker runs after a browser test run as if no
browser existed. Inside a browser test, ``loop_released()`` unmarks it for a
block that needs ``asyncio.run`` (tests/support/amqp.py's blocking forms do
without: they see the loop and run on a thread of their own). A browser test
takes no async fixture after ``page`` (pytest-asyncio would meet the mark).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from playwright.sync_api import Browser, ConsoleMessage, Dialog, Page, Playwright, WebError

CHROMIUM = Path("/usr/bin/chromium")
# Every skip for want of a browser starts so; the session's summary counts them.
NO_BROWSER = "NO BROWSER"
# Headless, and quiet on the network: no QUIC, no first-run pages, no
# component updates, sync or other background requests, so the only requests
# are the test's own. Playwright adds its own automation flags to these.
CHROMIUM_ARGS = (
    "--headless",
    "--no-sandbox",  # the suite runs as root, where Chromium's sandbox refuses to start
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)
# The browser is local and the pages are small: an action or an expectation
# that waits longer than this has failed (Playwright's default is 30 s).
TIMEOUT_MS = 10_000
LAUNCH_TIMEOUT_MS = 60_000

CSP_MARK = "Content Security Policy"
# Runs in every document (and frame) before its own scripts.
CSP_RECORDER = """
window.__cspViolations = [];
document.addEventListener("securitypolicyviolation", (event) => {
  window.__cspViolations.push(event.violatedDirective + " " + event.blockedURI);
}, true);
"""


def no_browser_reason() -> str | None:
    """Why this session has no browser (a skip reason starting ``NO_BROWSER``),
    None when it has one."""
    if not CHROMIUM.exists():
        return f"{NO_BROWSER} ({CHROMIUM} is missing: `make chromium`, or apt-get install chromium)"
    if importlib.util.find_spec("playwright") is None:
        return f"{NO_BROWSER} (the playwright package is not installed: the test extra)"
    return None


def require_browser() -> None:
    """Skip the test (counted in the summary) when there is no browser."""
    if (reason := no_browser_reason()) is not None:
        pytest.skip(reason)


@contextlib.contextmanager
def loop_released() -> Iterator[None]:
    """Inside a browser test, a block in which asyncio sees no running loop
    (for ``asyncio.run``); Playwright's sync calls must wait until it ends."""
    loop = asyncio._get_running_loop()
    asyncio._set_running_loop(None)
    try:
        yield
    finally:
        asyncio._set_running_loop(loop)


@dataclass
class PageProblems:
    """What the pages of one test did wrong, as they did it."""

    console_errors: list[str] = field(default_factory=list)
    page_errors: list[str] = field(default_factory=list)
    dialogs: list[str] = field(default_factory=list)  # "type: message", each dismissed
    csp_violations: list[str] = field(default_factory=list)  # Chromium's console reports
    page: Page | None = field(default=None, repr=False, compare=False)

    def on_console(self, message: ConsoleMessage) -> None:
        text = message.text
        if CSP_MARK in text:
            self.csp_violations.append(text)
        elif message.type == "error":
            location = message.location
            self.console_errors.append(f"{text} ({location['url']}:{location['lineNumber']})")

    def on_web_error(self, error: WebError) -> None:
        self.page_errors.append(f"{error.error.name}: {error.error.message}")

    def on_dialog(self, dialog: Dialog) -> None:
        self.dialogs.append(f"{dialog.type}: {dialog.message}")
        dialog.dismiss()

    def csp_events(self) -> list[str]:
        """The current document's ``securitypolicyviolation`` events, each
        ``"<violated directive> <blocked URI>"`` (``"script-src-elem inline"``);
        a navigation starts a new list. Empty without a page."""
        if self.page is None or self.page.is_closed():
            return []
        events: list[str] = self.page.evaluate("window.__cspViolations || []")
        return events

    def assert_clean(self) -> None:
        found = {
            "console errors": self.console_errors,
            "page errors": self.page_errors,
            "dialogs": self.dialogs,
            "CSP violations (console)": self.csp_violations,
            "CSP violations (securitypolicyviolation events)": self.csp_events(),
        }
        dirty = {kind: items for kind, items in found.items() if items}
        assert not dirty, "the page misbehaved:\n" + "\n".join(
            f"  {kind}:\n" + "\n".join(f"    {item}" for item in items) for kind, items in dirty.items()
        )


class ChromiumSession:
    """The session's Playwright and headless Chromium; see the module's note
    on the event loop for ``active``."""

    def __init__(self, playwright: Playwright, browser: Browser, loop: asyncio.AbstractEventLoop) -> None:
        self.playwright = playwright
        self.browser = browser
        self._loop = loop

    @contextlib.contextmanager
    def active(self) -> Iterator[Browser]:
        """The browser, with Playwright's loop marked as running in this thread
        (where the sync API left it after its last call) until the block ends."""
        if asyncio._get_running_loop() is not None:
            raise RuntimeError("the sync browser API inside a running event loop (an async test?)")
        asyncio._set_running_loop(self._loop)
        try:
            yield self.browser
        finally:
            asyncio._set_running_loop(None)

    @contextlib.contextmanager
    def recording_page(self) -> Iterator[tuple[Page, PageProblems]]:
        """A page in a context of its own, its problems recorded; the context
        is closed after."""
        with self.active() as browser:
            context = browser.new_context()
            try:
                context.set_default_timeout(TIMEOUT_MS)
                context.add_init_script(script=CSP_RECORDER)
                problems = PageProblems()
                context.on("console", problems.on_console)
                context.on("weberror", problems.on_web_error)
                context.on("dialog", problems.on_dialog)
                problems.page = context.new_page()
                yield problems.page, problems
            finally:
                context.close()


@contextlib.contextmanager
def chromium_session() -> Iterator[ChromiumSession]:
    """Playwright's driver and a headless Chromium, stopped after; skips,
    counted in the summary, without a browser."""
    require_browser()
    from playwright.sync_api import sync_playwright

    manager = sync_playwright()
    playwright = manager.start()
    loop = asyncio._get_running_loop()
    assert loop is not None, "Playwright's sync API left no event loop marked"
    try:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM, headless=True, args=list(CHROMIUM_ARGS), timeout=LAUNCH_TIMEOUT_MS
        )
    except BaseException:
        playwright.stop()
        asyncio._set_running_loop(None)
        raise
    asyncio._set_running_loop(None)
    session = ChromiumSession(playwright, browser, loop)
    try:
        yield session
    finally:
        with session.active():
            try:
                browser.close()
            finally:
                playwright.stop()
