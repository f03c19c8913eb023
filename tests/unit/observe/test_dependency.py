"""Which failures are a refused login, FAILING at once (issue 44): the
client's own errors only, never the names an operator or producer chose."""

from __future__ import annotations

import redis.exceptions

from ingest.errors import AckError, BrokerError
from ingest.observe.dependency import Dependency, refused_login
from ingest.observe.metrics_http import SERVER_FAILING_AFTER_S, Liveness


def _wrapped(outer: Exception, cause: Exception) -> Exception:
    outer.__cause__ = cause
    return outer


def test_the_servers_own_refusals_are_refused_logins() -> None:
    for cause in (
        redis.exceptions.AuthenticationError("invalid username-password pair"),
        redis.exceptions.ResponseError("WRONGPASS invalid username-password pair or user is disabled."),
        redis.exceptions.ResponseError("NOPERM this user has no permissions to run the 'xack' command"),
        RuntimeError("An error occurred (InvalidClientTokenId) when calling the ReceiveMessage operation"),
        RuntimeError("ACCESS_REFUSED - Login was refused using authentication mechanism PLAIN"),
        RuntimeError("nats: 'Authorization Violation'"),
    ):
        assert refused_login(_wrapped(BrokerError("adapter orders: reading failed"), cause)), cause


def test_names_chosen_by_operators_are_not_refusals() -> None:
    """A review's finding: the words were once searched in our own wrappers'
    text, which names adapters, hosts and sources."""
    for outer, cause in (
        (BrokerError("adapter noauth-orders: reading failed"), ConnectionRefusedError("Connection refused")),
        (BrokerError("adapter x: channel wrongpass.events"), TimeoutError("timed out")),
        (AckError("adapter y: s3-accessdenied-cache:6379"), OSError("Connection reset by peer")),
    ):
        assert not refused_login(_wrapped(outer, cause))


def test_a_refused_login_fails_at_once_and_an_answer_clears_it() -> None:
    live = Liveness(database_stale_s=15)
    broker = Dependency(live, "redis broker at 127.0.0.1:6379 (orders)")
    broker.failed(_wrapped(BrokerError("adapter orders: reading"), ConnectionRefusedError("refused")))
    assert live.failing() == {}  # a blip: 10 s before it counts
    broker.failed(
        _wrapped(BrokerError("adapter orders: reading"), redis.exceptions.AuthenticationError("no"))
    )
    assert list(live.failing()) == [broker.server]
    broker.answered()
    assert live.failing() == {}
    assert SERVER_FAILING_AFTER_S == 10.0  # DESIGN's bound, as issue 44 names it
