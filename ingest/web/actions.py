"""The console's actions (POST): enable and disable an adapter, retry and
cancel a todo (one, or in bulk by filter), replay rejected inbox rows (one,
or in bulk by filter). Each runs :mod:`ingest.actions`, the CLI's own, and
shows its outcome in the CLI's words, refusals included.

A bulk action is two steps. The dry run selects the rows the filter matches
now (at most ``BULK_LIMIT``) and says what would become of each; its confirm
form carries exactly those ids, so the confirm acts on the rows the
operator saw, never on rows that arrived since. Each row is still checked
again, in its own transaction, when it is acted on.

By the time a handler runs, the guard (``ingest.web.app``) has checked the
origin, the CSRF token and that the console may write; the form is parsed.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import structlog
from sqlalchemy.ext.asyncio import AsyncEngine
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Route

from backhalf.reads import inbox_views, todo_views
from ingest.actions import adapters as adapter_actions
from ingest.actions import inbox as inbox_actions
from ingest.actions import todos as todo_actions
from ingest.actions.outcomes import Refused
from ingest.actions.trail import as_id
from ingest.web import pages
from ingest.web.console import Console, console_of
from schema import ACTIVE_TODO_STATUSES, TODO_STATUSES

log = structlog.get_logger(__name__)

BULK_LIMIT = 100
MAX_PINNED = 1000


@dataclass(frozen=True, slots=True)
class Outcome:
    """One row of a bulk action's answer: its id and what became of it."""

    id: int
    ok: bool
    text: str


def _field(request: Request, name: str) -> str:
    fields: dict[str, list[str]] = request.state.form
    return (fields.get(name) or [""])[0].strip()


def _pinned(request: Request) -> list[int]:
    """The ids a confirm form carries (what the dry run listed)."""
    fields: dict[str, list[str]] = request.state.form
    ids = [as_id(v) for v in fields.get("id", [])]
    return list(dict.fromkeys(i for i in ids if i is not None))[:MAX_PINNED]


# -- adapters ----------------------------------------------------------------------------


async def set_enabled(request: Request) -> Response:
    console = console_of(request)
    name = request.path_params["name"]
    if request.path_params["action"] not in ("enable", "disable"):
        return console.page(request, "error.html", status_code=404, message="no such action")
    enabled = request.path_params["action"] == "enable"
    async with console.act():
        outcome = await adapter_actions.set_enabled(console.engine, name, enabled)
    console.overview.forget()
    if isinstance(outcome, Refused):
        return console.page(request, "error.html", status_code=409, message=outcome.reason)
    log.info("web_adapter_enabled" if enabled else "web_adapter_disabled", adapter=name)
    return RedirectResponse("/", status_code=303)


# -- todos -------------------------------------------------------------------------------


async def todo_action(request: Request) -> Response:
    todo_id = pages.path_id(request, "todo_id")
    action = request.path_params["action"]
    if action not in ("retry", "cancel") or todo_id is None:
        return console_of(request).page(request, "error.html", status_code=404, message="no such action")
    outcome = await _act_on_todo(console_of(request), action, todo_id)
    if not outcome.ok:
        return await pages.todo_page(request, todo_id, refused=outcome.text)
    return await pages.todo_page(request, todo_id, notice=outcome.text)


async def _act_on_todo(console: Console, action: str, todo_id: int) -> Outcome:
    act: Callable[[AsyncEngine, int], Awaitable[todo_actions.Retried | todo_actions.Cancelled | Refused]]
    act = todo_actions.retry if action == "retry" else todo_actions.cancel
    async with console.act():
        done = await act(console.engine, todo_id)
    if isinstance(done, Refused):
        return Outcome(todo_id, False, done.reason)
    if isinstance(done, todo_actions.Retried):
        log.info("web_todo_retried", todo_id=todo_id, was=done.was)
        return Outcome(todo_id, True, f"todo {todo_id} retried (was {done.was}): pending, attempts reset")
    log.info("web_todo_cancelled", todo_id=todo_id, was=done.was)
    return Outcome(todo_id, True, f"todo {todo_id} cancelled (was {done.was})")


def _eligible(action: str, todo_status: str) -> bool:
    return todo_status in (todo_actions.RETRYABLE_STATUSES if action == "retry" else ACTIVE_TODO_STATUSES)


async def todos_bulk(request: Request) -> Response:
    """Dry run (``step=dry``: the filter's todos now, what would happen to
    each) or confirm (``step=confirm``: the pinned ids, each acted on)."""
    console = console_of(request)
    action = _field(request, "action")
    if action not in ("retry", "cancel"):
        return console.page(request, "error.html", status_code=400, message="action: retry or cancel")
    queue = _field(request, "queue") or None
    wanted = _field(request, "status") or None
    if wanted is not None and wanted not in TODO_STATUSES:
        return console.page(
            request, "error.html", status_code=400, message=f"status {wanted!r} is no todo status"
        )
    if _field(request, "step") == "confirm":
        done = [await _act_on_todo(console, action, todo_id) for todo_id in _pinned(request)]
        log.info("web_todos_bulk", action=action, asked=len(done), done=sum(o.ok for o in done))
        return console.page(request, "bulk_done.html", what=f"{action} todos", outcomes=done)
    async with console.act("selecting the todos"):
        batch = todo_views.TodoQuery(
            queue=queue, status=wanted, limit=BULK_LIMIT + 1, before_id=as_id(_field(request, "before"))
        )
        rows = await todo_actions.listed(console.engine, batch)
    listed = [{"row": r, "eligible": _eligible(action, r.status)} for r in rows[:BULK_LIMIT]]
    more = len(rows) > BULK_LIMIT
    return console.page(
        request,
        "todos_bulk.html",
        action=action,
        queue=queue or "",
        status=wanted or "",
        listed=listed,
        more=more,
        limit=BULK_LIMIT,
        # The next batch: the todos after (older than) the last one listed.
        next_before=rows[BULK_LIMIT - 1].id if more else None,
    )


# -- inbox -------------------------------------------------------------------------------


async def replay_one(request: Request) -> Response:
    console = console_of(request)
    inbox_id = pages.path_id(request, "inbox_id")
    if inbox_id is None:
        return console.page(request, "error.html", status_code=404, message="no such inbox row")
    async with console.act():
        replayed = await inbox_actions.replay_one(console.engine, console.settings, inbox_id)
    outcome = _replay_text(inbox_id, replayed)
    return console.page(
        request, "bulk_done.html", status_code=200 if outcome.ok else 409, what="replay", outcomes=[outcome]
    )


def _replay_text(inbox_id: int, outcome: inbox_actions.ReplayOutcome) -> Outcome:
    if isinstance(outcome, Refused):
        return Outcome(inbox_id, False, outcome.reason)
    log.info("web_inbox_replayed", inbox_id=inbox_id, todo_id=outcome.todo_id)
    return Outcome(inbox_id, True, f"inbox row {inbox_id} replayed: stored, todo {outcome.todo_id}")


def _dry_text(outcome: inbox_actions.DryRunOutcome) -> tuple[bool, str]:
    if isinstance(outcome, inbox_actions.WouldReplay):
        return True, "would be replayed"
    if isinstance(outcome, inbox_actions.WouldRefuse):
        return False, f"would be refused: {outcome.reason}"
    return False, "gone since it was selected"


async def replay_bulk(request: Request) -> Response:
    """Dry run (the filter's rejected rows now, each checked as a replay
    would check it) or confirm (the pinned ids, each replayed)."""
    console = console_of(request)
    if _field(request, "step") == "confirm":
        return await _replay_pinned(console, request)
    where, typed, problem = _replay_filter(request)
    if problem is not None:
        return console.page(request, "error.html", status_code=400, message=problem)
    async with console.act():
        selection = await inbox_actions.select_rejected(console.engine, where, limit=BULK_LIMIT)
    listed: list[dict[str, Any]] = []
    for row in selection.rows:
        async with console.act():
            ok, text = _dry_text(await inbox_actions.check_one(console.engine, console.settings, row.id))
        listed.append({"row": row, "ok": ok, "text": text})
    return console.page(
        request,
        "replay_dry.html",
        listed=listed,
        typed=typed,
        all=_field(request, "all"),
        more=selection.more,
        limit=BULK_LIMIT,
        # The next batch starts after the last row listed: rows that keep
        # being refused never hide the ones behind them.
        next_after=selection.rows[-1].id if selection.more else None,
    )


async def _replay_pinned(console: Console, request: Request) -> Response:
    done = []
    for inbox_id in _pinned(request):
        async with console.act():
            outcome = await inbox_actions.replay_one(console.engine, console.settings, inbox_id)
        done.append(_replay_text(inbox_id, outcome))
    log.info("web_inbox_replay_bulk", asked=len(done), done=sum(o.ok for o in done))
    return console.page(request, "bulk_done.html", what="replay", outcomes=done)


def _replay_filter(request: Request) -> tuple[inbox_views.ReplayFilter, dict[str, str], str | None]:
    """The inbox page's filters, from the form; no filter at all only when ticked."""
    where, typed, problem = pages.inbox_filter(lambda name: _field(request, name))
    if problem is None and where.is_empty() and _field(request, "all") != "yes":
        problem = "no filter: give an adapter, since or error text, or tick 'every rejected row'"
    return where, typed, problem


def routes() -> list[Route]:
    forms = {
        "/adapters/{name}/{action}": set_enabled,
        "/todos/{todo_id}/{action}": todo_action,
        "/todos/bulk": todos_bulk,
        "/inbox/replay": replay_bulk,
        "/inbox/{inbox_id}/replay": replay_one,
    }
    return [Route(path, endpoint, methods=["POST"]) for path, endpoint in forms.items()]
