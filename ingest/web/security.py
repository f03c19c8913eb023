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
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from starlette.requests import Request

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


@dataclass(frozen=True)
class Guard:
    """The console's checks; ``token`` None: loopback only, no login."""

    token: str | None
    key: bytes = field(default_factory=lambda: secrets.token_bytes(32), repr=False)

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

    def session_valid(self, cookie: str) -> bool:
        issued, _, signature = cookie.partition(".")
        if not issued.isdigit() or not hmac.compare_digest(signature.encode(), self._sign(issued).encode()):
            return False
        return 0 <= time.time() - int(issued) < SESSION_S

    def token_matches(self, offered: str) -> bool:
        return self.token is not None and hmac.compare_digest(offered.encode(), self.token.encode())

    def authenticated(self, request: Request) -> bool:
        """The request may read: no token is set, or it carries the token or a session cookie."""
        if self.token is None:
            return True
        scheme, _, credential = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and self.token_matches(credential.strip()):
            return True
        return self.session_valid(request.cookies.get(SESSION_COOKIE, ""))

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
