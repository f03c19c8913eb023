"""Fixtures: real PostgreSQL and Redis for every test (see tests/support/servers.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import redis

from backhalf.housekeeping import migrate
from ingest.embedded.servers import PostgresServer, RedisServer, temp_base
from tests.support import db
from tests.support.browser import ChromiumSession, PageProblems, chromium_session
from tests.support.config import stream_adapter, write_config
from tests.support.processes import SECRET
from tests.support.servers import ServerUrls, private_postgres, shared_servers

if TYPE_CHECKING:
    from playwright.sync_api import Page


@pytest.fixture(scope="session")
def servers() -> Iterator[ServerUrls]:
    with shared_servers() as urls:
        db.create_template(urls.database)
        yield urls


@pytest.fixture
def db_url(servers: ServerUrls) -> Iterator[str]:
    """A fresh, migrated database of this test's own."""
    url = db.create_test_database(servers.database)
    yield url
    db.drop_test_database(servers.database, url)


@pytest.fixture
def redis_url(servers: ServerUrls) -> str:
    with redis.Redis.from_url(servers.redis, socket_timeout=10) as r:
        r.flushall()
    return servers.redis


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    """A Redis process this test owns, so it may kill and restart it."""
    server = RedisServer.create(temp_base("switchboard-redis-"), appendfsync="always", password=SECRET)
    try:
        server.start()
        yield server
    finally:
        server.cleanup()


@pytest.fixture
def own_postgres() -> Iterator[tuple[PostgresServer, str]]:
    """A PostgreSQL this test owns (to terminate backends and restart it), with
    a migrated database; yields the server and the database URL."""
    with private_postgres() as server:
        url = server.create_database("switchboard")
        migrate.upgrade(url)
        yield server, url


@pytest.fixture
def config_urls() -> tuple[Callable[[str], str], Callable[[str], str]]:
    """How the database and Redis URLs are written into configs (system tests
    plant a password in them, to prove it reaches no log)."""
    return (lambda url: url), (lambda url: url)


@pytest.fixture
def make_config(
    tmp_path: Path,
    db_url: str,
    redis_url: str,
    config_urls: tuple[Callable[[str], str], Callable[[str], str]],
) -> Callable[..., Path]:
    db_form, redis_form = config_urls

    def make(
        *adapters: dict[str, Any], redis: str | None = None, name: str = "switchboard.toml", **kw: Any
    ) -> Path:
        return write_config(
            tmp_path / name,
            database_url=db_form(db_url),
            redis_url=redis_form(redis or redis_url),
            adapters=list(adapters) or [stream_adapter()],
            **kw,
        )

    return make


@pytest.fixture(scope="session")
def chromium() -> Iterator[ChromiumSession]:
    """The session's Playwright and headless Chromium (the system's
    /usr/bin/chromium, one per xdist worker, started on first use); the
    tests are skipped, and counted in the summary, without it
    (tests.support.browser)."""
    with chromium_session() as session:
        yield session


@pytest.fixture
def browser_page(chromium: ChromiumSession) -> Iterator[tuple[Page, PageProblems]]:
    with chromium.recording_page() as recorded:
        yield recorded


@pytest.fixture
def page(browser_page: tuple[Page, PageProblems]) -> Page:
    """A page in a browser context of this test's own (closed after), its
    console errors, page errors, dialogs (dismissed) and CSP violations
    recorded in ``page_problems``."""
    return browser_page[0]


@pytest.fixture
def page_problems(browser_page: tuple[Page, PageProblems]) -> PageProblems:
    """What ``page`` did wrong so far; ``assert_clean()`` when it should be nothing."""
    return browser_page[1]


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> Iterator[None]:
    """A run without RabbitMQ is no pass of the AMQP tests, nor one without a
    browser of the browser tests: one line each, after the short summary,
    says why they could not run and how many were skipped
    (tests.support.amqp, tests.support.browser)."""
    from tests.support.amqp import NO_BROKER
    from tests.support.browser import NO_BROWSER

    yield
    for missing in (NO_BROKER, NO_BROWSER):
        reasons = []
        for report in terminalreporter.stats.get("skipped", []):
            longrepr = getattr(report, "longrepr", None)
            reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
            if missing in reason:
                reasons.append(reason[reason.index(missing) :])
        if reasons:
            terminalreporter.write_line(
                f"{reasons[0]}; {len(reasons)} tests skipped \N{EM DASH} not a pass", yellow=True, bold=True
            )
