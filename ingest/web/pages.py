"""The console's pages (GET): overview, trail, rejected inbox, todos,
processes, charts. Each reads through the same modules as the CLI
(``backhalf.*_views``, ``backhalf.reads.trace``, ``ingest.observe``) and renders a
template; the live parts are fragments the page polls (htmx).

Lists are keyset-paginated (``after`` / ``before`` an id) and never count a
whole table: a million-row inbox costs a page what ten rows cost.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import UTC, datetime
from functools import partial
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from backhalf.housekeeping import heartbeats
from backhalf.housekeeping.heartbeats import ProcessRow
from backhalf.reads import console_views, inbox_views, todo_views, trace
from backhalf.reads.console_views import MinuteFigures
from ingest.actions import inbox as inbox_actions
from ingest.actions import todos as todo_actions
from ingest.actions import trail as trail_actions
from ingest.actions.todos import RETRYABLE_STATUSES
from ingest.actions.trail import as_id
from ingest.config import Settings
from ingest.observe import inbox_text, status
from ingest.observe.trail import ack_command, offset, timeline
from ingest.web import attention
from ingest.web.console import console_of
from schema import ACTIVE_TODO_STATUSES, TODO_STATUSES

PAGE_SIZE = 50
CHART_COLUMNS = ("consumed", "deduplicated_inbox", "deduplicated_todo", "rejected", "acked")
LATENCY_COLUMNS = ("ack_latency_p50_s", "ack_latency_p95_s", "ack_latency_p99_s")


def _int_param(request: Request, name: str) -> int | None:
    return as_id(request.query_params.get(name, ""))


def path_id(request: Request, name: str) -> int | None:
    return as_id(request.path_params[name])


def series(minutes: Sequence[MinuteFigures], columns: Sequence[str]) -> dict[str, Any]:
    """A chart's data for console.js: every minute of the window (x in epoch
    seconds, oldest first), one list per column; a minute with no row is 0
    (a count) or null (a latency: no ack, no figure)."""
    by_minute = {int(m.minute.timestamp()): m for m in minutes}
    now = int(datetime.now(UTC).timestamp()) // 60 * 60
    span = int(console_views.WINDOW.total_seconds()) // 60
    xs = [now - 60 * (span - 1 - i) for i in range(span)]
    xs = sorted({*xs, *by_minute})  # a minute the database's clock put past ours stays

    def value(x: int, column: str) -> Any:
        m = by_minute.get(x)
        if m is None:
            return None if column.startswith("ack_latency") else 0
        return getattr(m, column)

    return {"x": xs, "series": [{"label": c, "values": [value(x, c) for x in xs]} for c in columns]}


# -- overview and processes --------------------------------------------------------------

# The report's keys that are not the broker's figures (ingest.observe.status.collect).
REPORT_KEYS = frozenset(
    {"adapter", "mode", "source", "defined_in", "healthy", "registered", "enabled", "acked_by",
     "pending_acks", "oldest_unacked_age_s", "acks_held_by", "stored", "rejected", "acked", "todos",
     "handler", "processes", "family"}
)  # fmt: skip


def broker_figures(report: Mapping[str, Any]) -> list[tuple[str, str]]:
    """What the adapter's broker said of it (or why it could not be asked),
    whatever its transport: every key of the report that is not the database's."""
    return [(k, status.shown(v)) for k, v in report.items() if k not in REPORT_KEYS]


async def overview(request: Request, template: str) -> Response:
    console = console_of(request)
    view = await console.overview.get()
    rows = [
        {
            "r": r,
            "verdict": status.verdict(r),
            "broker": broker_figures(r),
            "chart": series(view.minutes.get(r["adapter"], ()), ("consumed", "rejected", "acked")),
        }
        for r in view.report
    ]
    shown, hidden = shown_processes(view.processes, show_all=False)
    return console.page(
        request,
        template,
        rows=rows,
        procs=shown,
        hidden=hidden,
        show_all=False,
        attention=view.attention,
        verdict=view.verdict,
    )


# Processes that ended on purpose: listed on asking (``show=all``) only.
ENDED_STATES = ("stopped", "replaced")


def shown_processes(procs: Sequence[ProcessRow], *, show_all: bool) -> tuple[list[ProcessRow], int]:
    """The processes to list, and how many stopped or replaced ones are not."""
    if show_all:
        return list(procs), 0
    shown = [p for p in procs if p.state not in ENDED_STATES]
    return shown, len(procs) - len(shown)


async def processes(request: Request, template: str) -> Response:
    console = console_of(request)
    async with console.read("listing the processes") as conn:
        procs = await heartbeats.list_processes(conn)
    show_all = request.query_params.get("show") == "all"
    shown, hidden = shown_processes(procs, show_all=show_all)
    return console.page(
        request, template, procs=shown, hidden=hidden, show_all=show_all, failing=status.FAILING
    )


# -- trail -------------------------------------------------------------------------------


async def trail(request: Request) -> Response:
    """One search box, ``switchboard trace``'s search (:mod:`ingest.actions.trail`):
    a key, a bare entry id, ``inbox:ID``, ``todo:ID`` or a bare number."""
    console = console_of(request)
    query = request.query_params.get("key", "").strip()
    trails: list[dict[str, Any]] = []
    missing = None
    if query:
        async with console.act("finding the trail"):
            found = await trail_actions.find(console.engine, query)
        trails = [_trail_view(t, w) for t, w in zip(found.trails, found.waiting, strict=True)]
        missing = None if found.trails else found.missing
    return console.page(request, "trace.html", query=query, trails=trails, missing=missing)


def _trail_view(t: trace.Trail, waiting: str | None) -> dict[str, Any]:
    steps = timeline(t)
    start = steps[0].at
    return {
        "t": t,
        "waiting": waiting,
        "ack": ack_command(t),
        "steps": [{"s": s, "offset": offset(s.at, start)} for s in steps],
    }


# -- inbox -------------------------------------------------------------------------------


def inbox_filter(
    field: Callable[[str], str],
) -> tuple[inbox_views.ReplayFilter, dict[str, str], str | None]:
    """The filters of the rejected inbox (``adapter``, ``since``, ``error``,
    ``after``), read by ``field`` from a URL or a POSTed form; the same as
    typed (to fill the form again), and what is wrong with them."""
    typed = {name: field(name).strip() for name in ("adapter", "since", "error")}
    since = None
    problem = None
    if typed["since"]:
        try:
            since = inbox_text.time_bound(typed["since"])
        except ValueError as exc:
            problem = f"since: {exc}"
    where = inbox_views.ReplayFilter(
        adapter=typed["adapter"] or None,
        since=since,
        error_contains=typed["error"] or None,
        after_id=as_id(field("after")),
    )
    return where, typed, problem


async def inbox(request: Request) -> Response:
    console = console_of(request)
    wanted = request.query_params.get("status", "rejected")
    where, typed, problem = inbox_filter(lambda name: request.query_params.get(name, ""))
    if wanted != "rejected":
        problem = f"status {wanted!r}: the console lists rejected rows (status=rejected); trace finds any row"
    rows: list[Any] = []
    more = False
    if problem is None:
        async with console.act("listing the rejected inbox"):
            selection = await inbox_actions.select_rejected(console.engine, where, limit=PAGE_SIZE)
        rows, more = list(selection.rows), selection.more
    next_query = None
    if more:
        next_query = {
            **{k: v for k, v in typed.items() if v},
            "status": "rejected",
            "after": str(rows[-1].id),
        }
    return console.page(
        request,
        "inbox.html",
        rows=rows,
        typed=typed,
        problem=problem,
        next_query=next_query,
        first=where.after_id is None,
    )


async def inbox_row(request: Request) -> Response:
    console = console_of(request)
    inbox_id = path_id(request, "inbox_id")
    row = None
    if inbox_id is not None:
        async with console.act("reading an inbox row"):
            row = await inbox_actions.show(console.engine, inbox_id)
    if row is None:
        return console.page(
            request, "error.html", status_code=404, message=f"inbox row {inbox_id} does not exist"
        )
    view = inbox_text.body_view(row.body, body_size=row.body_size, body_sha256=row.body_sha256)
    return console.page(
        request,
        "inbox_row.html",
        row=row,
        view=view,
        text=inbox_text.decode(row.body, whole=row.body_size is None),
        base64=inbox_text.base64_lines(row.body),
    )


# -- todos -------------------------------------------------------------------------------


async def todos(request: Request) -> Response:
    console = console_of(request)
    q = request.query_params
    queue = q.get("queue", "").strip() or None
    wanted = q.get("status", "").strip() or None
    problem = None
    if wanted is not None and wanted not in TODO_STATUSES:
        problem = f"status {wanted!r}: one of {', '.join(TODO_STATUSES)}"
    rows: list[todo_views.TodoRow] = []
    more = False
    if problem is None:
        async with console.act("listing the todos"):
            page = todo_views.TodoQuery(
                queue=queue, status=wanted, limit=PAGE_SIZE + 1, before_id=_int_param(request, "before")
            )
            got = await todo_actions.listed(console.engine, page)
        rows, more = got[:PAGE_SIZE], len(got) > PAGE_SIZE
    typed = {"queue": queue or "", "status": wanted or ""}
    next_query = {**{k: v for k, v in typed.items() if v}, "before": str(rows[-1].id)} if more else None
    return console.page(
        request,
        "todos.html",
        rows=rows,
        ages={t.id: _since(t.updated_at) for t in rows},
        over={t.id for t in rows if _over_limit(console.settings, t.status, t.queue, t.updated_at)},
        actions=bulk_actions(wanted),
        typed=typed,
        problem=problem,
        statuses=TODO_STATUSES,
        next_query=next_query,
        queues=sorted(console.settings.queues),
    )


def _since(moment: datetime) -> float:
    """Seconds since ``moment`` (a todo's last change), by the console's clock."""
    return max(0.0, (datetime.now(UTC) - moment).total_seconds())


def _over_limit(settings: Settings, todo_status: str, queue: str, updated_at: datetime) -> bool:
    """A running todo past its queue's time limit (``ingest.web.attention``'s long-running)."""
    return todo_status == "running" and _since(updated_at) > attention.time_limit_s(settings, queue)


def bulk_actions(wanted: str | None) -> list[str]:
    """The bulk actions a list filtered by status ``wanted`` offers: those
    that can act on its todos (both on an unfiltered list: its dry run says
    which todos each would take)."""
    if wanted is None:
        return ["retry", "cancel"]
    return [
        action
        for action, statuses in (("retry", RETRYABLE_STATUSES), ("cancel", ACTIVE_TODO_STATUSES))
        if wanted in statuses
    ]


async def todo(request: Request) -> Response:
    todo_id = path_id(request, "todo_id")
    if todo_id is None:
        return console_of(request).page(request, "error.html", status_code=404, message="no such todo")
    return await todo_page(request, todo_id)


async def todo_page(
    request: Request, todo_id: int, notice: str | None = None, refused: str | None = None
) -> Response:
    console = console_of(request)
    async with console.act("reading a todo"):
        shown = await todo_actions.show(console.engine, todo_id)
    if shown is None:
        return console.page(request, "error.html", status_code=404, message=f"todo {todo_id} does not exist")
    detail = shown.todo
    return console.page(
        request,
        "todo.html",
        status_code=409 if refused else 200,
        todo=detail,
        age_s=_since(detail.updated_at),
        time_limit_s=attention.time_limit_s(console.settings, detail.queue),
        over=_over_limit(console.settings, detail.status, detail.queue, detail.updated_at),
        can_retry=detail.status in RETRYABLE_STATUSES,
        can_cancel=detail.status in ACTIVE_TODO_STATUSES,
        history=shown.history,
        waiting=shown.waiting,
        notice=notice,
        refused=refused,
        payload=inbox_text.pretty_json(detail.payload),
    )


# -- charts ------------------------------------------------------------------------------


async def charts(request: Request) -> Response:
    console = console_of(request)
    async with console.read("reading the charts") as conn:
        minutes = await console_views.recent_minutes(conn)
    by_adapter = console_views.by_adapter(minutes)
    adapters = [
        {
            "name": name,
            "minutes": rows,
            "counts": series(rows, CHART_COLUMNS),
            "latency": series(rows, LATENCY_COLUMNS),
        }
        for name, rows in sorted(by_adapter.items())
    ]
    return console.page(
        request,
        "charts.html",
        adapters=adapters,
        columns=CHART_COLUMNS,
        latency_columns=LATENCY_COLUMNS,
        window=console_views.WINDOW,
    )


def routes() -> list[Route]:
    # A live page's fragment is the same view in its own template, which the
    # page's script fetches to refresh itself; each route is named, as a
    # partial has no name of its own for the route to take.
    pages: dict[str, tuple[str, Callable[[Request], Awaitable[Response]]]] = {
        "/": ("overview", partial(overview, template="overview.html")),
        "/fragments/overview": ("overview_fragment", partial(overview, template="_overview_live.html")),
        "/processes": ("processes", partial(processes, template="processes.html")),
        "/fragments/processes": ("processes_fragment", partial(processes, template="_processes_live.html")),
        "/trace": ("trail", trail),
        "/inbox": ("inbox", inbox),
        "/inbox/{inbox_id}": ("inbox_row", inbox_row),
        "/todos": ("todos", todos),
        "/todos/{todo_id}": ("todo", todo),
        "/charts": ("charts", charts),
    }
    return [Route(path, endpoint, methods=["GET"], name=name) for path, (name, endpoint) in pages.items()]
