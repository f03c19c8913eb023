"""A server a process needs (a broker its adapters read or ack), as its
health judges it: one rule for every process (issue 44).

A loop that reaches a server reports each failure and each answer through
the :class:`Dependency` its process hands it (``Process.dependency``). A
server refusing or failing every try for ``SERVER_FAILING_AFTER_S`` (10 s)
makes the process FAILING: ``/healthz`` answers 503 naming it and the
error, the heartbeat carries it (``detail.failing``), and ``status`` says
FAILING and exits non-zero. A refused login (a wrong password, a user
without the right) is FAILING at its first try: waiting does not fix it,
and the operator should hear of it before the backlog does.
"""

from __future__ import annotations

import re

from backhalf.db_errors import error_chain
from backhalf.errors import BackhalfError
from backhalf.redaction import redact
from ingest.config.transport import TransportDefinition
from ingest.config.transports import definitions
from ingest.errors import IngestError
from ingest.observe.metrics_http import Liveness

# What each broker's client says when it refuses the login or the user's
# rights: by exception name (no client is imported: each is an extra), or by
# the server's own code in the client's message, case and word exact: Redis
# starts its error with WRONGPASS, NOAUTH or NOPERM; RabbitMQ's close reason
# is ACCESS_REFUSED; NATS says 'Authorization Violation'; botocore writes
# the AWS code in parentheses, or (an error whose code it could not read)
# quotes the XML answer, the code in <Code>. Only the client's errors are
# read, never our wrappers' text, which names adapters, hosts and sources
# ("noauth-orders").
_REFUSAL_TYPES = frozenset(
    {
        "AuthenticationError",
        "AuthenticationWrongNumberOfArgsError",
        "NoPermissionError",
        "ProbableAuthenticationError",
        "AuthorizationError",
    }
)
_REFUSAL_WORDS = re.compile(
    r"^(?:WRONGPASS|NOAUTH|NOPERM)\b|\bACCESS_REFUSED\b|Authorization Violation"
    r"|[(>](?:InvalidClientTokenId|SignatureDoesNotMatch|UnrecognizedClientException|AccessDenied"
    r"|AccessDeniedException)[)<]"
)


def refused_login(exc: BaseException) -> bool:
    """Whether ``exc`` wraps a server refusing who we are."""
    for error in error_chain(exc):
        if isinstance(error, IngestError | BackhalfError):
            continue  # our own words: names a producer or an operator chose
        if type(error).__name__ in _REFUSAL_TYPES or _REFUSAL_WORDS.search(str(error)):
            return True
    return False


def client_of(error: BaseException) -> TransportDefinition | None:
    """The transport whose client library raised ``error``, if one did
    (by the package its class comes from: no client is imported)."""
    package = type(error).__module__.partition(".")[0]
    return next((d for d in definitions().values() if package in d.client_packages), None)


def from_a_client(error: BaseException) -> bool:
    """Whether ``error`` is a broker client's own."""
    return client_of(error) is not None


def _is_a(error: BaseException, names: tuple[str, ...]) -> bool:
    """Whether ``error``'s class, or one it derives from in the same client,
    has one of ``names`` (a client's ``ConnectionError`` and its subclasses:
    a server still loading, no connection left in the pool)."""
    d = client_of(error)
    return d is not None and any(
        c.__name__ in names and c.__module__.partition(".")[0] in d.client_packages
        for c in type(error).__mro__
    )


def unreachable(error: BaseException) -> bool:
    """Whether ``error`` is a broker client failing to connect or to hear back."""
    return _is_a(error, ("ConnectionError", "TimeoutError"))


def login_refused(error: BaseException) -> TransportDefinition | None:
    """The transport whose client says the broker refused the login, if one does."""
    return client_of(error) if _is_a(error, ("AuthenticationError",)) else None


class Dependency:
    """One server a loop reaches, reported to the process's liveness."""

    __slots__ = ("_liveness", "server")

    def __init__(self, liveness: Liveness, server: str) -> None:
        self._liveness = liveness
        self.server = server  # a label: a host and port, never a credential

    def failed(self, exc: BaseException) -> None:
        """A try failed: FAILING after 10 s of nothing else, at once for a refused login."""
        self._liveness.server_failed(self.server, redact(str(exc)), at_once=refused_login(exc))

    def answered(self) -> None:
        self._liveness.server_answered(self.server)
