"""The CLI boundary's one line per failure (``ingest.cli.errors.explain``);
the real processes meet these in tests/system/test_cli_errors.py."""

from __future__ import annotations

import psycopg
import psycopg.errors
import pytest
import redis.exceptions
from sqlalchemy import exc as sa_exc

from backhalf.errors import BackhalfError, DeadlineExceeded
from ingest.cli.errors import Failure, explain
from ingest.config import from_mapping
from ingest.errors import BrokerError, ConfigError
from ingest.exit_codes import EXIT_CONFIG, EXIT_DATABASE, EXIT_FAILURE
from tests.support import driver_errors
from tests.support.driver_errors import wrapped

SECRET = "pw-never-shown-41"
SETTINGS = from_mapping({"database": {"url": f"postgresql://sb:{SECRET}@db.example:6432/sbdb"}}, {})
TARGET = "database 'sbdb' at db.example:6432 as user 'sb' (from [database] url)"
SLOW = Failure(f"cannot reach the {TARGET}: no answer in time", EXIT_FAILURE)


def at_connect(text: str) -> psycopg.OperationalError:
    return driver_errors.at_connect(text, "10.0.0.5", 6432)


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (wrapped(at_connect("Connection refused\n\tIs the server running on that host?")),
         Failure(f"cannot reach the {TARGET}: connection refused"
                 " (is PostgreSQL running there, on that port?)", EXIT_FAILURE)),
        (wrapped(psycopg.OperationalError("failed to resolve host 'db.example': [Errno -2] Name or service")),
         Failure(f"cannot reach the {TARGET}: host name not found (check the host)", EXIT_FAILURE)),
        (wrapped(at_connect("timeout expired")), SLOW),
        (wrapped(at_connect("FATAL:  the database system is starting up")),
         Failure(f"cannot reach the {TARGET}: the server is starting up", EXIT_FAILURE)),
        (wrapped(at_connect("FATAL:  sorry, too many clients already")),
         Failure(f"cannot reach the {TARGET}: no free connection slot", EXIT_FAILURE)),
        (DeadlineExceeded("x: no reply from the database within 30000 ms"),
         SLOW),
        (sa_exc.TimeoutError("QueuePool limit"), SLOW),
        (wrapped(at_connect('FATAL:  password authentication failed for user "sb"')),
         Failure("the database refused the password: check the user and password in the database URL"
                 f" [{TARGET}]", EXIT_DATABASE)),
        (wrapped(psycopg.errors.UndefinedTable('relation "adapters" does not exist')),
         Failure("the database has no Switchboard tables (undefined table): run `switchboard migrate` first"
                 f" [{TARGET}]", EXIT_DATABASE)),
        (wrapped(psycopg.errors.DiskFull("could not extend file\nDETAIL: more")),
         Failure(f"the {TARGET} failed (SQLSTATE 53100): could not extend file", EXIT_FAILURE)),
        (BrokerError(f"adapter orders: XINFO: redis://u:{SECRET}@cache/0 said no"),
         Failure("adapter orders: XINFO: redis://u:***@cache/0 said no", EXIT_FAILURE)),
        (redis.exceptions.AuthenticationError("invalid username-password pair"),
         Failure("the broker refused the login: check the user and password in the broker URL"
                 " (SWITCHBOARD_REDIS_URL, [redis] url or the adapter's url)", EXIT_FAILURE)),
        (ConfigError("adapter 'x': key 'y' is bad"),
         Failure("config error: adapter 'x': key 'y' is bad", EXIT_CONFIG)),
        (BackhalfError("the migrations are missing: reinstall"),
         Failure("the migrations are missing: reinstall", EXIT_FAILURE)),
    ],
)  # fmt: skip
def test_each_failure_is_one_line_with_its_exit_code(exc: BaseException, expected: Failure) -> None:
    failure = explain(exc, SETTINGS)
    assert failure == expected
    assert "\n" not in failure.message
    assert SECRET not in failure.message


def test_a_wrapped_driver_error_is_found_through_the_chain() -> None:
    try:
        try:
            raise wrapped(at_connect("Connection refused"))
        except sa_exc.DBAPIError as exc:
            raise BackhalfError("store: OperationalError: ...") from exc
    except BackhalfError as outer:
        failure = explain(outer, SETTINGS)
    assert failure is not None
    assert failure.message.startswith(f"cannot reach the {TARGET}: connection refused")


def test_a_bug_is_not_explained_away() -> None:
    assert explain(KeyError("oops"), SETTINGS) is None
    assert explain(AssertionError("unreachable"), SETTINGS) is None


def test_the_origin_of_the_url_is_named() -> None:
    env = {"SWITCHBOARD_DATABASE_URL": f"postgresql://sb:{SECRET}@/sbdb?host=/run/postgresql"}
    failure = explain(wrapped(at_connect("Connection refused")), from_mapping({}, env))
    assert failure is not None
    assert (
        "database 'sbdb' at the local socket as user 'sb' (from SWITCHBOARD_DATABASE_URL)" in failure.message
    )


def _wrapped_in_broker_error(cause: BaseException) -> BrokerError:
    try:
        try:
            raise cause
        except BaseException as exc:
            raise BrokerError("adapter orders: reading orders") from exc
    except BrokerError as outer:
        return outer


def test_a_clients_connection_error_subclass_is_a_broker_out_of_reach() -> None:
    """A Redis still loading its dataset raises a subclass of redis-py's
    ConnectionError: found by the client's class tree, not its exact name."""
    loading = _wrapped_in_broker_error(redis.exceptions.BusyLoadingError("LOADING Redis is loading"))
    assert explain(loading, SETTINGS) == Failure(
        "cannot reach the broker: LOADING Redis is loading", EXIT_FAILURE
    )


def test_a_refused_login_names_where_its_own_transports_url_comes_from() -> None:
    import aiormq.exceptions  # the amqp extra (the dev kit's): imported here, not by the CLI

    refused = _wrapped_in_broker_error(aiormq.exceptions.AuthenticationError("ACCESS_REFUSED"))
    failure = explain(refused, SETTINGS)
    assert failure is not None
    assert "SWITCHBOARD_AMQP_URL" in failure.message
    assert "REDIS" not in failure.message
