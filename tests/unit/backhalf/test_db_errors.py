"""The one classifier of database errors: permanent (stop, say what to do)
versus transient (back off, retry)."""

from __future__ import annotations

from typing import cast

import psycopg
import psycopg.errors
import pytest
from sqlalchemy import exc as sa_exc

from backhalf.db_errors import MIGRATE_HINT, DatabaseProblem, DatabaseUnusable, classify, is_transient
from backhalf.errors import DeadlineExceeded, StoreError
from tests.support.driver_errors import at_connect, wrapped


def refused_at_connect(fatal: str) -> psycopg.OperationalError:
    return at_connect(f"FATAL:  {fatal}")


@pytest.mark.parametrize(
    ("error", "kind", "sqlstate"),
    [
        (psycopg.errors.UndefinedTable('relation "adapters" does not exist'), "not_migrated", "42P01"),
        (psycopg.errors.UndefinedColumn('column "x" does not exist'), "not_migrated", "42703"),
        (psycopg.errors.InvalidPassword("password authentication failed"), "authentication_failed", "28P01"),
        (psycopg.errors.InvalidCatalogName('database "x" does not exist'), "no_such_database", "3D000"),
        (
            psycopg.errors.InsufficientPrivilege("permission denied for table inbox"),
            "permission_denied",
            "42501",
        ),
        (refused_at_connect('password authentication failed for user "u"'), "authentication_failed", "28P01"),
        (refused_at_connect('database "nosuch" does not exist'), "no_such_database", "3D000"),
        (refused_at_connect('role "ghost" does not exist'), "authentication_failed", "28000"),
        (
            refused_at_connect('no pg_hba.conf entry for host "10.0.0.1", user "u"'),
            "authentication_failed",
            "28000",
        ),
        (
            psycopg.OperationalError("connection failed: fe_sendauth: no password supplied"),
            "authentication_failed",
            "28P01",
        ),
        # libpq's refusals of the server's certificate (sslmode=verify-full):
        # texts as libpq 18 words them (tests/system/test_tls.py meets them for real).
        (
            at_connect('root certificate file "/root/.postgresql/root.crt" does not exist\nEither provide'),
            "tls_refused",
            "08001",
        ),
        (
            at_connect('server certificate for "db.example" does not match host name "127.0.0.1"'),
            "tls_refused",
            "08001",
        ),
        (at_connect("SSL error: certificate verify failed"), "tls_refused", "08001"),
    ],
)
def test_permanent_errors_are_named_with_what_to_do(error: Exception, kind: str, sqlstate: str) -> None:
    for form in (error, wrapped(error)):
        problem = classify(form)
        assert problem is not None
        assert (problem.kind, problem.sqlstate) == (kind, sqlstate)
        assert "\n" not in problem.message
    if kind in ("not_migrated", "no_such_database"):
        assert MIGRATE_HINT in cast(DatabaseProblem, problem).message  # not None: asserted in the loop


@pytest.mark.parametrize(
    "error",
    [
        psycopg.OperationalError(
            'connection failed: connection to server at "127.0.0.1", port 1 failed: Connection refused'
        ),
        refused_at_connect("the database system is starting up"),
        refused_at_connect("sorry, too many clients already"),
        psycopg.errors.AdminShutdown("terminating connection due to administrator command"),
        psycopg.errors.QueryCanceled("canceling statement due to statement timeout"),
        psycopg.errors.SerializationFailure("could not serialize access"),
        TimeoutError(),
        DeadlineExceeded("no reply within 30000 ms"),
    ],
)
def test_transient_and_unknown_errors_are_retried(error: Exception) -> None:
    assert classify(error) is None
    if isinstance(error, psycopg.Error):
        assert classify(wrapped(error)) is None


def test_an_error_anywhere_in_the_chain_is_found() -> None:
    try:
        try:
            raise wrapped(psycopg.errors.UndefinedTable('relation "inbox" does not exist'))
        except sa_exc.DBAPIError as exc:
            raise StoreError("storing a batch failed") from exc
    except StoreError as outer:
        problem = classify(outer)
    assert problem is not None
    assert problem.kind == "not_migrated"
    assert str(DatabaseUnusable(problem)) == problem.message


def test_the_message_never_carries_the_url() -> None:
    error = refused_at_connect('password authentication failed for user "u"')
    problem = classify(wrapped(error))
    assert problem is not None
    assert "127.0.0.1" not in problem.message


def store_error(orig: BaseException) -> StoreError:
    """As the poll loop sees a failed store: StoreError from SQLAlchemy's wrapper."""
    try:
        raise StoreError("adapter orders: transaction for 1 messages failed") from orig
    except StoreError as exc:
        return exc


@pytest.mark.parametrize(
    "error",
    [
        wrapped(psycopg.errors.LockNotAvailable("canceling statement due to lock timeout")),
        wrapped(psycopg.errors.QueryCanceled("canceling statement due to statement timeout")),
        wrapped(psycopg.errors.SerializationFailure("could not serialize access")),
        wrapped(psycopg.errors.DeadlockDetected("deadlock detected")),
        wrapped(psycopg.errors.AdminShutdown("terminating connection due to administrator command")),
        wrapped(psycopg.errors.TooManyConnections("sorry, too many clients already")),
        wrapped(psycopg.OperationalError("server closed the connection unexpectedly")),
        at_connect("Connection refused"),
        DeadlineExceeded("storing 1 messages: no reply from the database within 30000 ms"),
        sa_exc.TimeoutError("QueuePool limit of size 4 overflow 2 reached"),
        # A failover that left the URL on the demoted node, a missing grant,
        # a half-applied migration: none of them is the message's doing.
        wrapped(psycopg.errors.ReadOnlySqlTransaction("cannot execute INSERT in a read-only transaction")),
        wrapped(psycopg.errors.IdleInTransactionSessionTimeout("terminating connection due to idle")),
        wrapped(psycopg.errors.InsufficientPrivilege("permission denied for table todos")),
        wrapped(psycopg.errors.UndefinedTable('relation "todos" does not exist')),
        wrapped(psycopg.errors.UniqueViolation("duplicate key value violates unique constraint")),
        sa_exc.InvalidRequestError("Can't reconnect until invalid transaction is rolled back"),
    ],
    ids=lambda e: type(getattr(e, "orig", e)).__name__,
)
def test_failures_outside_the_data_are_transient(error: BaseException) -> None:
    """Issue 11, item 1: none of these may count against a message."""
    assert is_transient(store_error(error))


@pytest.mark.parametrize(
    "error",
    [
        wrapped(psycopg.errors.NumericValueOutOfRange("value out of range")),
        wrapped(psycopg.errors.ProgramLimitExceeded("total size of jsonb array elements exceeds")),
        wrapped(psycopg.errors.UntranslatableCharacter("unsupported Unicode escape sequence")),
        wrapped(psycopg.DataError("cannot dump a value")),  # psycopg's own, client-side
    ],
    ids=lambda e: type(getattr(e, "orig", e)).__name__,
)
def test_failures_the_data_can_cause_are_not_transient(error: BaseException) -> None:
    """A message the server refuses fails the same way every time: counted,
    so max_deliveries ends it."""
    assert not is_transient(store_error(error))
