"""The console's Starlette app: its routes, the guard in front of them, and
what every handler shares (:class:`Console`).

Every page is rendered on the server by Jinja2 with autoescape on, so a
producer's or a handler's text (a body, a key, an error) is shown as text,
never markup. The browser runs two same-origin scripts, htmx and uPlot,
shipped in the wheel, plus ``console.js``; no inline script or style.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from urllib.parse import parse_qsl, unquote, urlencode

import psycopg
import structlog
from sqlalchemy.exc import DBAPIError, SQLAlchemyError
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware, RequestResponseEndpoint
from starlette.requests import Request
from starlette.responses import PlainTextResponse, RedirectResponse, Response
from starlette.routing import Route

from backhalf.errors import DeadlineExceeded
from backhalf.redaction import redact
from ingest.web import actions, pages
from ingest.web.console import Console
from ingest.web.security import (
    GUESS_DELAY_MAX_S,
    HEADERS,
    SESSION_COOKIE,
    SESSION_S,
    Guard,
    client_of,
    safe_next,
    same_origin,
)
from ingest.web.static_files import StaticFiles

log = structlog.get_logger(__name__)

MAX_FORM_BYTES = 256 * 1024
OPEN_PATHS = ("/healthz", "/login", "/static/")


async def form(request: Request) -> dict[str, list[str]]:
    """A POSTed urlencoded form, each name's values in order (stdlib's
    parser: no multipart, nothing else is sent by the console's forms)."""
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_FORM_BYTES:
            raise ValueError("form too large")
    fields: dict[str, list[str]] = {}
    for name, value in parse_qsl(body.decode("utf-8", errors="replace"), keep_blank_values=True):
        fields.setdefault(name, []).append(value)
    return fields


class _Guarded(BaseHTTPMiddleware):
    """Host and auth first, then a POST's read-only, origin and CSRF checks;
    the security headers on every answer; a database out of reach as a page
    that says so (503), not a traceback."""

    async def dispatch(self, request: Request, call_next: RequestResponseEndpoint) -> Response:
        console: Console = request.app.state.console
        response = await self._checked(console, request, call_next)
        for name, value in HEADERS.items():
            response.headers.setdefault(name, value)
        return response

    async def _checked(
        self, console: Console, request: Request, call_next: RequestResponseEndpoint
    ) -> Response:
        guard = console.guard
        if not guard.host_allowed(request):
            return PlainTextResponse(
                "without SWITCHBOARD_WEB_TOKEN this console answers loopback requests only,"
                " not through a proxy",
                status_code=421,
            )
        path = request.url.path
        if "\x00" in unquote(request.url.query) or "\x00" in path:
            # Text PostgreSQL cannot hold: a refusal, not a database error.
            return PlainTextResponse("a NUL character in the request", status_code=400)
        if not path.startswith(OPEN_PATHS):
            unsigned = await _sign_in_refusal(guard, request)
            if unsigned is not None:
                return unsigned
        if request.method == "POST":
            refused = await _post_refusal(console, request)
            if refused is not None:
                reason, response = refused
                guard.refusals.note(client_of(request), reason)
                return response
        try:
            return await call_next(request)
        except DBAPIError as exc:
            if isinstance(exc.orig, psycopg.errors.InsufficientPrivilege):
                log.warning("web_privilege_refused", path=path, error=redact(str(exc.orig)))
                return console.page(
                    request,
                    "error.html",
                    status_code=403,
                    message="The database refused this login the privilege (run the console as the"
                    " operator's login of ops/roles.sql to act, or with --read-only).",
                )
            log.warning("web_database_error", path=path, error=redact(str(exc)))
            return _unavailable(console, request)
        except (SQLAlchemyError, DeadlineExceeded, OSError) as exc:
            log.warning("web_database_error", path=path, error=redact(str(exc)))
            return _unavailable(console, request)


async def _sign_in_refusal(guard: Guard, request: Request) -> Response | None:
    """None for a request that is signed in. A wrong token or a forged
    session is a guess: logged with the client's others and answered late
    (``security.Refusals``); no credential at all, or a session that ran
    out, is sent to sign in at once."""
    client = client_of(request)
    verdict = guard.verdict(request)
    if verdict.signed_in:
        # A right credential is never held up by others' guesses (behind a
        # proxy every user shares one client address).
        if verdict.by_token:
            guard.refusals.succeeded(client)
        return None
    if verdict.guess is not None:
        if guard.refusals.busy(client):
            return _too_many_guesses(guard, client)
        await guard.refusals.wrong_guess(client, verdict.guess)
    # A browser's page goes to the sign-in form; a live fragment's poll
    # (htmx) and an API client are told, not redirected (htmx would swap
    # the form into the page).
    browsing = "authorization" not in request.headers and "hx-request" not in request.headers
    if request.method == "GET" and browsing:
        return RedirectResponse(_login_url(asked(request)), status_code=303)
    return PlainTextResponse("not signed in", status_code=401)


def asked(request: Request) -> str:
    """The path and query a request asked for, as the browser sent them
    (still percent-encoded)."""
    raw = request.scope.get("raw_path")
    path = raw.decode("latin-1") if isinstance(raw, bytes) else request.url.path
    query = request.scope.get("query_string", b"").decode("latin-1")
    return f"{path}?{query}" if query else path


def _login_url(next_path: str) -> str:
    """The sign-in form, told where to go back to (a safe path only)."""
    target = safe_next(next_path)
    return "/login" if target == "/" else "/login?" + urlencode({"next": target})


def _too_many_guesses(guard: Guard, client: str) -> Response:
    """Answered before the credential is read: the answer tells nothing."""
    guard.refusals.note(client, "too_many_guesses")
    return PlainTextResponse(
        "refused: too many wrong sign-ins from this address are waiting; try again in a few seconds",
        status_code=429,
        headers={"Retry-After": str(int(GUESS_DELAY_MAX_S))},
    )


def _unavailable(console: Console, request: Request) -> Response:
    return console.page(
        request,
        "error.html",
        status_code=503,
        message="The database (or a broker) did not answer in time; this page will work again once it does.",
    )


async def _post_refusal(console: Console, request: Request) -> tuple[str, Response] | None:
    """Why a POST is refused (the reason logged, the answer), or None. The
    login form is POSTed before any session exists: it needs the same
    origin only."""
    if not same_origin(request):
        return "cross_origin", PlainTextResponse("refused: a POST from another origin", status_code=403)
    if request.url.path in ("/login", "/logout"):  # no session yet, or ending it
        return None
    if console.read_only:
        return "read_only", PlainTextResponse(
            f"refused: this console is read-only ({console.read_only_why})", status_code=403
        )
    try:
        fields = await form(request)
    except ValueError:
        return "form_too_large", PlainTextResponse("refused: form too large", status_code=413)
    if any("\x00" in value for values in fields.values() for value in values):
        return "nul_in_form", PlainTextResponse("refused: a NUL character in the form", status_code=400)
    request.state.form = fields
    if not console.guard.csrf_matches(request, (fields.get("csrf") or [""])[0]):
        return "csrf", PlainTextResponse(
            "refused: the form's CSRF token is missing or stale; reload the page", status_code=403
        )
    return None


async def login_page(request: Request) -> Response:
    console: Console = request.app.state.console
    target = safe_next(request.query_params.get("next", ""))
    if console.guard.token is None:
        return RedirectResponse(target, status_code=303)
    return console.page(request, "login.html", failed=False, next=target)


async def login(request: Request) -> Response:
    console: Console = request.app.state.console
    guard = console.guard
    try:
        fields = await form(request)
    except ValueError:
        return PlainTextResponse("refused: form too large", status_code=413)
    offered = (fields.get("token") or [""])[0]
    # The page asked for before signing in (the form carries it on); only a
    # path of this console, never another origin.
    target = safe_next((fields.get("next") or [""])[0])
    if guard.token is None:
        return RedirectResponse(target, status_code=303)
    client = client_of(request)
    if not guard.token_matches(offered):
        if guard.refusals.busy(client):
            return _too_many_guesses(guard, client)
        await guard.refusals.wrong_guess(client, "wrong_token")
        return console.page(request, "login.html", status_code=401, failed=True, next=target)
    guard.refusals.succeeded(client)
    response = RedirectResponse(target, status_code=303)
    response.set_cookie(
        SESSION_COOKIE,
        guard.new_session(),
        max_age=SESSION_S,
        httponly=True,
        samesite="strict",
        # Behind a TLS proxy uvicorn sees http; a client's word can only make
        # the cookie stricter here, never weaker.
        secure=request.url.scheme == "https"
        or request.headers.get("x-forwarded-proto", "").lower() == "https"
        or request.headers.get("origin", "").startswith("https://"),
        path="/",
    )
    return response


async def logout(request: Request) -> Response:
    response = RedirectResponse("/login", status_code=303)
    response.delete_cookie(SESSION_COOKIE, path="/")
    return response


async def healthz(request: Request) -> Response:
    console: Console = request.app.state.console
    ok, _report = console.healthy()
    return PlainTextResponse("ok" if ok else "unhealthy", status_code=200 if ok else 503)


Handler = Callable[[Request], Awaitable[Response]]


def build(console: Console) -> Starlette:
    routes = [
        Route("/healthz", healthz, methods=["GET"]),
        Route("/login", login_page, methods=["GET"]),
        Route("/login", login, methods=["POST"]),
        Route("/logout", logout, methods=["POST"]),
        *pages.routes(),
        *actions.routes(),
        Route("/static/{path:path}", StaticFiles().serve, methods=["GET"]),
    ]
    app = Starlette(routes=routes, middleware=[Middleware(_Guarded)])
    app.router.redirect_slashes = False  # no redirect built from the Host header
    app.state.console = console
    return app
