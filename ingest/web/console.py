"""What every console handler shares: :class:`Console` (the settings, the
engine, the guard, the templates), and the templates' filters."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import jinja2
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from starlette.requests import Request
from starlette.responses import HTMLResponse

from backhalf.db import database_deadline, within_deadline
from ingest.config import Settings
from ingest.web.figures import OverviewCache
from ingest.web.formats import age, utc
from ingest.web.security import Guard


@dataclass
class Console:
    """What every handler is given: the settings, the engine, the guard,
    whether actions are offered, the templates and the shared overview."""

    settings: Settings
    engine: AsyncEngine
    guard: Guard
    read_only: bool
    read_only_why: str | None
    templates: jinja2.Environment
    overview: OverviewCache
    healthy: Callable[[], tuple[bool, Mapping[str, Any]]]

    def read(self, what: str) -> contextlib.AbstractAsyncContextManager[AsyncConnection]:
        """A connection for one page's reads, under the transaction deadline
        (a database that accepts and never answers ends in DeadlineExceeded,
        the guard's 503, not a request hanging on)."""
        return within_deadline(self.engine.connect(), self.settings.database.transaction_deadline_ms, what)

    def act(self, what: str = "an action") -> contextlib.AbstractAsyncContextManager[None]:
        """The deadline of one action (a read, a change, one bulk confirm's
        row): ``ingest.actions`` open their own transactions, bounded
        together by this; past it, ``DeadlineExceeded`` (the guard's 503),
        as :meth:`read`'s."""
        return database_deadline(self.settings.database.transaction_deadline_ms, what)

    def page(self, request: Request, template: str, status_code: int = 200, **context: Any) -> HTMLResponse:
        html = self.templates.get_template(template).render(
            request=request,
            csrf=self.guard.csrf_token(request),
            can_act=not self.read_only,
            read_only_why=self.read_only_why,
            login=self.guard.token is not None,
            **context,
        )
        return HTMLResponse(html, status_code=status_code)


def templates() -> jinja2.Environment:
    """The templates, autoescaped: every value is text unless a template says otherwise (none does)."""
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("ingest.web", "templates"),
        autoescape=True,  # every value is text unless a template says otherwise (none does)
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["utc"] = utc
    env.filters["age"] = age
    return env


def console_of(request: Request) -> Console:
    """The console a request is served by (the app's state)."""
    console: Console = request.app.state.console
    return console
