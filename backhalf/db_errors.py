"""Permanent database errors, told apart from transient ones in one place.

A permanent error (the schema is missing, the login is refused, the database
does not exist) does not go away by waiting: a long-running process meeting
one at start-up stops with :attr:`DatabaseProblem.message`, one line that
says what is wrong and what to do, and a short command prints it. Anything
else (connection refused, timeouts, a server starting up or shutting down,
too many connections, an error this module does not know) is transient:
:func:`classify` returns None and the caller backs off and retries.

Errors raised by a statement carry a SQLSTATE; errors raised while
connecting do not (libpq reports them as text), so those are recognised by
the server's message. A server whose ``lc_messages`` is not English sends
translated texts: its connection errors are then taken as transient and
retried, the behaviour before this module existed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import psycopg

from backhalf.errors import BackhalfError

MIGRATE_HINT = "run `switchboard migrate`"

# SQLSTATE -> (kind, message). Messages name no URL and no password.
_BY_SQLSTATE: dict[str, tuple[str, str]] = {
    "42P01": (
        "not_migrated",
        f"the database has no Switchboard tables (undefined table): {MIGRATE_HINT} first",
    ),
    "42703": (
        "not_migrated",
        f"the database's Switchboard tables are older than this version (undefined column): {MIGRATE_HINT}",
    ),
    "3F000": (
        "not_migrated",
        f"a schema the database URL or search_path names does not exist: {MIGRATE_HINT}",
    ),
    "28P01": (
        "authentication_failed",
        "the database refused the password: check the user and password in the database URL",
    ),
    "28000": (
        "authentication_failed",
        "the database refused the login (no such role, or no pg_hba.conf entry for this host and user):"
        " check the database URL's user and the server's pg_hba.conf",
    ),
    "3D000": (
        "no_such_database",
        f"the database named in the database URL does not exist: create it, then {MIGRATE_HINT}",
    ),
    "42501": (
        "permission_denied",
        "the database user lacks a privilege on Switchboard's database or tables: grant it"
        " (or run `switchboard migrate` as the tables' owner)",
    ),
}

# Connection-time failures carry no SQLSTATE: the server's (English) FATAL
# texts and libpq's own, mapped to the SQLSTATE the server would have sent.
_BY_MESSAGE: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"password authentication failed for user"), "28P01"),
    (re.compile(r"fe_sendauth: no password supplied"), "28P01"),
    (re.compile(r"database \"[^\"]*\" does not exist"), "3D000"),
    (re.compile(r"role \"[^\"]*\" does not exist"), "28000"),
    (re.compile(r"no pg_hba\.conf entry for"), "28000"),
    (re.compile(r"pg_hba\.conf rejects connection"), "28000"),
    (re.compile(r"permission denied for database"), "42501"),
)

# libpq's own refusals of the server's TLS certificate (sslmode=verify-full
# or verify-ca): a certificate does not change by waiting, so these are
# permanent too. They carry no SQLSTATE; 08001 is the standard's "client
# unable to establish a connection". Each says what to check, never the
# driver's text (which names file paths but may be long and odd).
TLS_SQLSTATE = "08001"
_TLS_REFUSALS: tuple[tuple[re.Pattern[str], str], ...] = (
    (
        re.compile(r"root certificate file .* does not exist"),
        "the database's TLS certificate cannot be checked: the URL's sslmode verifies it but names"
        " no CA file: add sslrootcert=/path/to/ca.pem to the database URL",
    ),
    (
        re.compile(r"server certificate for .* does not match host name"),
        "the database's TLS certificate is for another host name: use a host the certificate names"
        " in the database URL, or give the server a certificate for this one",
    ),
    (
        re.compile(r"certificate verify failed"),
        "the database's TLS certificate was not signed by the CA in the database URL's sslrootcert:"
        " check that file (the CA that signed the server's certificate)",
    ),
)


@dataclass(frozen=True, slots=True)
class DatabaseProblem:
    """A permanent database error: ``kind`` for programs and log fields,
    ``message`` for people (one line, no URL, no password)."""

    kind: str  # not_migrated | authentication_failed | no_such_database | permission_denied | tls_refused
    sqlstate: str
    message: str


class DatabaseUnusable(BackhalfError):
    """A permanent database error at start-up: the process stops (exit code
    ``ingest.exit_codes.EXIT_DATABASE``) instead of retrying forever."""

    def __init__(self, problem: DatabaseProblem) -> None:
        super().__init__(problem.message)
        self.problem = problem


def error_chain(exc: BaseException) -> list[BaseException]:
    """``exc``, SQLAlchemy's ``orig``, causes and contexts, nearest first (a
    bounded walk, cycles skipped)."""
    found: list[BaseException] = []
    todo: list[BaseException | None] = [exc]
    while todo and len(found) < 16:
        e = todo.pop(0)
        if e is None or any(e is f for f in found):
            continue
        found.append(e)
        orig = getattr(e, "orig", None)
        todo += [orig if isinstance(orig, BaseException) else None, e.__cause__, e.__context__]
    return found


def _sqlstate(error: psycopg.Error) -> str | None:
    if error.sqlstate:
        return error.sqlstate
    if isinstance(error, psycopg.OperationalError):
        text = str(error)
        for pattern, sqlstate in _BY_MESSAGE:
            if pattern.search(text):
                return sqlstate
    return None


def classify(exc: BaseException) -> DatabaseProblem | None:
    """The permanent problem behind ``exc`` (a psycopg error, a SQLAlchemy
    error wrapping one, or any error with one in its chain), or None: a
    transient or unknown error, to be retried."""
    for error in error_chain(exc):
        if not isinstance(error, psycopg.Error):
            continue
        sqlstate = _sqlstate(error)
        if sqlstate in _BY_SQLSTATE:
            kind, message = _BY_SQLSTATE[sqlstate]
            return DatabaseProblem(kind=kind, sqlstate=sqlstate, message=message)
        if sqlstate is None and isinstance(error, psycopg.OperationalError):
            text = str(error)
            for pattern, message in _TLS_REFUSALS:
                if pattern.search(text):
                    return DatabaseProblem(kind="tls_refused", sqlstate=TLS_SQLSTATE, message=message)
    return None


def raise_if_permanent(exc: BaseException) -> None:
    """Raise :class:`DatabaseUnusable` from ``exc`` if it is permanent; return
    if it is transient (the caller retries)."""
    problem = classify(exc)
    if problem is not None:
        raise DatabaseUnusable(problem) from exc


# What a message's own data can make the server refuse, every time the same
# way: a data exception (class 22: a value out of range, an untranslatable
# character) or a program limit (class 54: a jsonb too large). Only these
# count against a message; anything else (a lock or statement timeout, a
# serialization failure, a lost connection, a read-only server after a
# failover, a missing grant or table) says nothing about the message and
# would otherwise turn good messages into poison while it lasts.
_DATA_CLASSES = ("22", "54")


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` failed for a reason outside the data written, so that
    it must never count against a message (``max_deliveries``): True unless
    the chain holds a driver error that the data can cause, a SQLSTATE of
    class 22 or 54, or psycopg's own refusal to send a value (a DataError
    raised client-side, with no SQLSTATE)."""
    for error in error_chain(exc):
        if isinstance(error, psycopg.Error):
            sqlstate = error.sqlstate
            if sqlstate is None:
                return not isinstance(error, psycopg.DataError)
            return sqlstate[:2] not in _DATA_CLASSES
    return True
