"""Who may see the console and who may act in it (DESIGN.md section 13).

- **The token** (``SWITCHBOARD_WEB_TOKEN``): sent as ``Authorization: Bearer
  TOKEN``, or once through the login form, which sets a session cookie
  (HttpOnly, SameSite=Strict) good for 12 hours, holding its issue time and
  an HMAC of it under the token, never the token itself: the token is in no
  page, URL or log line, and rotating it ends every session.
- **No token**: the console serves loopback only (a non-loopback listen is
  refused at start), and it answers only requests whose Host is a loopback
  name, so a web page elsewhere cannot reach it through a DNS name it
  points at 127.0.0.1 (DNS rebinding).
- **Actions**: POST only, each from the console's own origin (``Origin``,
  else ``Referer``, naming the Host the request was sent to) and carrying
  the CSRF token of its session (an HMAC under a key drawn at start). A
  read-only console refuses every POST with 403 before any of this.
- **Headers** on every answer: a Content-Security-Policy with no inline
  script or style and nothing off-origin, ``nosniff``, ``no-store``, no
  framing, no referrer sent elsewhere.
- **Refusals** (:class:`Refusals`), by client address: logged in one
  ``web_refused`` line per client every ``REFUSAL_LOG_EVERY_S``, with the
  count since its last line, never one line per request. A wrong guess (a
  wrong token, a forged session cookie) is answered late: 0.5 s, doubling
  with each consecutive one from that client up to 4 s, on an asyncio sleep
  that holds no other request; the token itself, given right, ends the run.
  A client with ``GUESSES_WAITING_MAX`` guesses being held is answered 429
  at once (a right credential always passes), so guessing in parallel gains nothing.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import urlsplit

import structlog
from starlette.requests import Request

log = structlog.get_logger(__name__)

TOKEN_VARIABLE = "SWITCHBOARD_WEB_TOKEN"  # noqa: S105 - the variable's name, not a token
SESSION_COOKIE = "switchboard_session"
MIN_TOKEN_LENGTH = 16
SESSION_S = 12 * 3600  # a login lasts a working day

CSP = "; ".join(
    (
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self' data:",
        "connect-src 'self'",
        "form-action 'self'",
        "frame-ancestors 'none'",
        "base-uri 'none'",
    )
)
HEADERS: Mapping[str, str] = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-store",
    # Not no-referrer: under it the browser sends "Origin: null" with the
    # console's own form POSTs, which the origin check must refuse.
    "Referrer-Policy": "same-origin",
    "X-Frame-Options": "DENY",
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Resource-Policy": "same-origin",
}
# Wrong guesses and refusals (issue 43).
GUESS_DELAY_S = 0.5  # the first wrong guess's wait; each consecutive one doubles it
GUESS_DELAY_MAX_S = 4.0
GUESS_MEMORY_S = 900.0  # a run of wrong guesses this old is forgotten
GUESSES_WAITING_MAX = 4  # per client; further wrong guesses meanwhile are answered 429
REFUSAL_LOG_EVERY_S = 10.0  # one web_refused line per client per this, with a count
REFUSAL_LINES_MAX = 20  # web_refused lines per REFUSAL_LOG_EVERY_S, all clients together
CLIENTS_TRACKED_MAX = 4096  # the least recently refused are forgotten past this
LOOPBACK_NAMES = ("localhost",)
FORWARDED_HEADERS = ("forwarded", "x-forwarded-for", "x-forwarded-host", "x-real-ip")


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address, brackets allowed) is this machine's loopback."""
    host = host.strip("[]").lower()
    if host in LOOPBACK_NAMES or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _host_of(authority: str) -> str:
    """The host of ``host[:port]`` or ``[v6]:port``."""
    if authority.startswith("["):
        return authority[1 : authority.find("]")] if "]" in authority else authority
    return authority.rsplit(":", 1)[0] if authority.count(":") == 1 else authority


def client_of(request: Request) -> str:
    """The address a request came from (a proxy's, behind one: all its
    clients are then one client here)."""
    return request.client.host if request.client is not None else "unknown"


@dataclass(slots=True)
class _Client:
    failures: int = 0  # consecutive wrong guesses
    last_failure_at: float = 0.0
    waiting: int = 0  # wrong guesses being held now
    logged_at: float | None = None
    unlogged: dict[str, int] = field(default_factory=dict)  # refusals by reason since the last line


class Refusals:
    """The console's refusals, by client: logged a line at a time per
    client (``web_refused``: ``refused``, the refusals by reason since its
    last line, this one included), at most ``REFUSAL_LINES_MAX`` lines for
    all clients per ``REFUSAL_LOG_EVERY_S`` (a client left out has its
    count carried to its next line); a wrong guess answered late. Anyone who
    can reach the console can be refused, so neither costs more than a
    dictionary entry per client, and at most ``CLIENTS_TRACKED_MAX`` of
    those."""

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self._clock = clock
        self._sleep = sleep
        self._clients: dict[str, _Client] = {}  # the least recently refused first
        self._window_at = -REFUSAL_LOG_EVERY_S
        self._lines = 0

    def busy(self, client: str) -> bool:
        """Whether ``client`` has as many wrong guesses held as it may."""
        state = self._clients.get(client)
        return state is not None and state.waiting >= GUESSES_WAITING_MAX

    def succeeded(self, client: str) -> None:
        """The token given right: the client's run of wrong guesses ends."""
        state = self._clients.get(client)
        if state is not None:
            state.failures = 0

    def note(self, client: str, reason: str) -> None:
        """A refusal that is no guess (a POST from another origin, a stale
        CSRF token, too many guesses at once): logged, answered at once."""
        self._log(client, self._state(client), reason, 0.0)

    async def wrong_guess(self, client: str, reason: str) -> None:
        """A wrong token or a forged session: logged, then held for the
        client's delay before its refusal is answered."""
        state = self._state(client)
        now = self._clock()
        if now - state.last_failure_at > GUESS_MEMORY_S:
            state.failures = 0
        state.failures += 1
        state.last_failure_at = now
        delay_s = min(GUESS_DELAY_S * 2 ** min(state.failures - 1, 16), GUESS_DELAY_MAX_S)
        self._log(client, state, reason, delay_s)
        state.waiting += 1
        try:
            await self._sleep(delay_s)
        finally:
            state.waiting -= 1

    def _state(self, client: str) -> _Client:
        state = self._clients.pop(client, None) or _Client()
        self._clients[client] = state  # now the most recent
        while len(self._clients) > CLIENTS_TRACKED_MAX:
            del self._clients[next(iter(self._clients))]
        return state

    def _log(self, client: str, state: _Client, reason: str, delay_s: float) -> None:
        state.unlogged[reason] = state.unlogged.get(reason, 0) + 1
        now = self._clock()
        if state.logged_at is not None and now - state.logged_at < REFUSAL_LOG_EVERY_S:
            return
        if now - self._window_at >= REFUSAL_LOG_EVERY_S:
            self._window_at, self._lines = now, 0
        if self._lines >= REFUSAL_LINES_MAX:
            return  # counted on this client's next line
        self._lines += 1
        state.logged_at = now
        log.warning(
            "web_refused",
            client=client,
            refused=dict(state.unlogged),
            consecutive_wrong_guesses=state.failures,
            delay_s=delay_s,
        )
        state.unlogged.clear()


Guess = Literal["wrong_token", "forged_session"]


@dataclass(frozen=True, slots=True)
class Verdict:
    """Whether a request is signed in; ``by_token``: by the token itself
    (a right guess, which ends a client's run of wrong ones); ``guess``: the
    wrong credential it carried, which is slowed and logged. Neither: no
    credential, or a session that merely ran out."""

    signed_in: bool
    by_token: bool = False
    guess: Guess | None = None


_SIGNED_IN = Verdict(signed_in=True)
_SIGNED_IN_BY_TOKEN = Verdict(signed_in=True, by_token=True)
_NOT_SIGNED_IN = Verdict(signed_in=False)


@dataclass(frozen=True)
class Guard:
    """The console's checks; ``token`` None: loopback only, no login."""

    token: str | None
    key: bytes = field(default_factory=lambda: secrets.token_bytes(32), repr=False)
    refusals: Refusals = field(default_factory=Refusals, repr=False, compare=False)

    def __repr__(self) -> str:  # the token never reaches a log line or a traceback
        return f"Guard(token={'set' if self.token else 'unset'})"

    def new_session(self) -> str:
        """A login's cookie: when it was issued and an HMAC of that under the
        token (never the token). It is good for ``SESSION_S``; rotating the
        token ends every session at once."""
        issued = str(int(time.time()))
        return f"{issued}.{self._sign(issued)}"

    def _sign(self, issued: str) -> str:
        token = (self.token or "").encode()
        return hmac.new(token, f"switchboard web session {issued}".encode(), hashlib.sha256).hexdigest()

    def session(self, cookie: str) -> Literal["none", "valid", "expired", "forged"]:
        """A session cookie's standing: ``forged`` when its HMAC does not
        check (a guess, or a session of a token since rotated)."""
        if not cookie:
            return "none"
        issued, _, signature = cookie.partition(".")
        if not issued.isdigit() or not hmac.compare_digest(signature.encode(), self._sign(issued).encode()):
            return "forged"
        return "valid" if 0 <= time.time() - int(issued) < SESSION_S else "expired"

    def session_valid(self, cookie: str) -> bool:
        return self.session(cookie) == "valid"

    def token_matches(self, offered: str) -> bool:
        """In constant time: digests are compared, so neither how much of
        the token a guess got right nor the token's length shows."""
        if self.token is None:
            return False
        offered_digest = hashlib.sha256(offered.encode("utf-8", "surrogatepass")).digest()
        return hmac.compare_digest(offered_digest, hashlib.sha256(self.token.encode()).digest())

    def verdict(self, request: Request) -> Verdict:
        """Whether the request may read: no token is set, or it carries the
        token (``Authorization: Bearer``) or a session cookie; if not, the
        wrong credential it carried, if any."""
        if self.token is None:
            return _SIGNED_IN
        authorization = request.headers.get("authorization")
        if authorization is not None:
            scheme, _, credential = authorization.partition(" ")
            if scheme.lower() == "bearer" and self.token_matches(credential.strip()):
                return _SIGNED_IN_BY_TOKEN
        session = self.session(request.cookies.get(SESSION_COOKIE, ""))
        if session == "valid":
            return _SIGNED_IN
        if authorization is not None:
            return Verdict(signed_in=False, guess="wrong_token")
        if session == "forged":
            return Verdict(signed_in=False, guess="forged_session")
        return _NOT_SIGNED_IN

    def authenticated(self, request: Request) -> bool:
        """The request may read: no token is set, or it carries the token or a session cookie."""
        return self.verdict(request).signed_in

    def host_allowed(self, request: Request) -> bool:
        """Without a token, only requests addressed to a loopback name (DNS
        rebinding), and none a proxy forwarded: a reverse proxy on this
        machine would otherwise open the tokenless console to whoever
        reaches the proxy."""
        if self.token is not None:
            return True
        if any(name in request.headers for name in FORWARDED_HEADERS):
            return False
        return is_loopback(_host_of(request.headers.get("host", "")))

    def csrf_token(self, request: Request) -> str:
        """The CSRF token of the request's session (the cookie's, or the
        loopback console's one session)."""
        session = request.cookies.get(SESSION_COOKIE, "") if self.token else "loopback"
        return hmac.new(self.key, f"csrf:{session}".encode(), hashlib.sha256).hexdigest()

    def csrf_matches(self, request: Request, offered: str) -> bool:
        return bool(offered) and hmac.compare_digest(offered.encode(), self.csrf_token(request).encode())


NEXT_MAX_CHARS = 2048
SIGN_IN_PATHS = ("/login", "/logout")


def safe_next(target: str) -> str:
    """Where to go after signing in: ``target`` when it is a path of this
    console (``/todos?status=failed``), else ``/``. Refused: anything not
    starting with one ``/`` (``//host`` and ``/\\host`` are another origin to a
    browser), a scheme or host, any character outside printable ASCII
    (browsers drop tabs and newlines, which would join ``/`` and ``/host``),
    a backslash anywhere, the sign-in pages themselves, and long ones."""
    if (
        len(target) > NEXT_MAX_CHARS
        or not target.startswith("/")
        or target.startswith("//")
        or "\\" in target
        or not all("!" <= c <= "~" for c in target)
    ):
        return "/"
    parts = urlsplit(target)
    if parts.scheme or parts.netloc or parts.path in SIGN_IN_PATHS:
        return "/"
    return target


def same_origin(request: Request) -> bool:
    """Whether a POST comes from a page of this console: its ``Origin`` (else
    its ``Referer``) names the host and port the request was sent to. The
    scheme is not compared: behind a TLS-terminating proxy the browser's is
    https and ours http."""
    host = request.headers.get("host", "")
    origin = request.headers.get("origin")
    if origin == "null":  # a sandboxed or privacy-stripped context: not ours
        return False
    if origin is None:
        origin = request.headers.get("referer")
    if not origin or not host:
        return False
    return urlsplit(origin).netloc.lower() == host.lower()
