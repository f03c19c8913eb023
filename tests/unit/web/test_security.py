"""The console's guard (ingest.web.security): who is signed in, which
requests are the console's own, which hosts answer without a token."""

from __future__ import annotations

import pytest
from starlette.requests import Request

from ingest.web import security
from ingest.web.security import SESSION_COOKIE, Guard, is_loopback, same_origin

TOKEN = "a-console-token-of-some-length"


def _request(headers: dict[str, str], method: str = "GET") -> Request:
    raw = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    return Request({"type": "http", "method": method, "path": "/", "headers": raw, "query_string": b""})


@pytest.mark.parametrize(
    ("host", "loopback"),
    [("127.0.0.1", True), ("127.8.9.10", True), ("::1", True), ("[::1]", True), ("localhost", True),
     ("app.localhost", True), ("0.0.0.0", False), ("10.0.0.1", False), ("example.com", False),
     ("localhost.example.com", False), ("", False)],
)  # fmt: skip
def test_loopback_names_and_addresses(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


@pytest.mark.parametrize(
    ("headers", "same"),
    [
        ({"Host": "127.0.0.1:8089", "Origin": "http://127.0.0.1:8089"}, True),
        ({"Host": "console.example:443", "Origin": "https://console.example:443"}, True),
        ({"Host": "127.0.0.1:8089", "Referer": "http://127.0.0.1:8089/todos/1"}, True),
        ({"Host": "127.0.0.1:8089", "Origin": "http://127.0.0.1:9999"}, False),
        ({"Host": "127.0.0.1:8089", "Origin": "http://evil.example"}, False),
        ({"Host": "127.0.0.1:8089", "Origin": "null", "Referer": "http://127.0.0.1:8089/"}, False),
        ({"Host": "127.0.0.1:8089"}, False),
        ({"Origin": "http://127.0.0.1:8089"}, False),
    ],
)
def test_a_post_is_the_consoles_own_only_from_its_own_host(headers: dict[str, str], same: bool) -> None:
    assert same_origin(_request(headers, "POST")) is same


def test_without_a_token_only_loopback_hosts_and_no_proxy_are_answered() -> None:
    guard = Guard(None)
    assert guard.host_allowed(_request({"Host": "127.0.0.1:8089"}))
    assert guard.host_allowed(_request({"Host": "localhost:8089"}))
    assert not guard.host_allowed(_request({"Host": "rebound.example:8089"}))  # DNS rebinding
    assert not guard.host_allowed(_request({"Host": "127.0.0.1:8089", "X-Forwarded-For": "203.0.113.9"}))
    assert guard.authenticated(_request({"Host": "127.0.0.1:8089"}))
    assert Guard(TOKEN).host_allowed(_request({"Host": "console.example"}))


def test_the_token_or_a_fresh_session_signs_in() -> None:
    guard = Guard(TOKEN)
    assert not guard.authenticated(_request({}))
    assert guard.authenticated(_request({"Authorization": f"Bearer {TOKEN}"}))
    assert not guard.authenticated(_request({"Authorization": f"Bearer {TOKEN}x"}))
    assert not guard.authenticated(_request({"Authorization": f"Basic {TOKEN}"}))
    cookie = guard.new_session()
    assert TOKEN not in cookie
    assert guard.authenticated(_request({"Cookie": f"{SESSION_COOKIE}={cookie}"}))
    issued, _, signature = cookie.partition(".")
    forged = f"{int(issued) + 1}.{signature}"
    assert not guard.authenticated(_request({"Cookie": f"{SESSION_COOKIE}={forged}"}))
    # Another token's session is no session.
    assert not Guard(TOKEN + "2").authenticated(_request({"Cookie": f"{SESSION_COOKIE}={cookie}"}))
    assert "a-console" not in repr(guard)


def test_a_session_expires(monkeypatch: pytest.MonkeyPatch) -> None:
    guard = Guard(TOKEN)
    cookie = guard.new_session()
    assert guard.authenticated(_request({"Cookie": f"{SESSION_COOKIE}={cookie}"}))
    monkeypatch.setattr(security, "SESSION_S", 0)  # every session is older than that
    assert not guard.authenticated(_request({"Cookie": f"{SESSION_COOKIE}={cookie}"}))


def test_the_csrf_token_is_the_sessions_and_the_processes() -> None:
    guard = Guard(TOKEN)
    one = _request({"Cookie": f"{SESSION_COOKIE}={guard.new_session()}"})
    token = guard.csrf_token(one)
    assert guard.csrf_matches(one, token)
    assert not guard.csrf_matches(one, "")
    assert not guard.csrf_matches(one, token[:-1] + ("0" if token[-1] != "0" else "1"))
    other = _request({"Cookie": f"{SESSION_COOKIE}=1.abc"})
    assert not guard.csrf_matches(other, token)
    assert not Guard(TOKEN).csrf_matches(one, token)  # a restarted console drew a new key


@pytest.mark.parametrize(
    ("target", "kept"),
    [("/todos?status=failed", True), ("/todos?status=failed&queue=a%20b", True), ("/inbox/7", True),
     ("/trace?key=redis%3Aorders%3A1-0", True), ("/", True), ("//evil.example/x", False),
     ("https://evil.example/", False), ("http:evil.example", False), ("/\\evil.example", False),
     ("\\/evil.example", False), ("/\t/evil.example", False), ("/\n/evil.example", False),
     ("/todos?x=\u00e9", False), ("evil.example", False), ("", False), ("/login", False),
     ("/login?next=/x", False), ("/logout", False), ("/" + "a" * security.NEXT_MAX_CHARS, False)],
)  # fmt: skip
def test_only_a_path_of_the_console_is_gone_back_to_after_signing_in(target: str, kept: bool) -> None:
    assert security.safe_next(target) == (target if kept else "/")
