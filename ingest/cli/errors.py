"""The CLI boundary: a failure a user can cause, as one line and an exit code.

Every verb's failure ends in :func:`explain`. It gives a :class:`Failure`
(one line that says what is wrong and what to do, and the exit code), or
None for what no user can cause: a bug, which the caller logs with its
traceback (redacted, like every log line).

::

    database refuses for good       backhalf.db_errors.classify   EXIT_DATABASE
      (not migrated, login refused,   (the one classifier; also what
       no such database, no privilege) stops ``ingest``/``ack``)
    database out of reach           _unreachable (below)           EXIT_FAILURE
      (refused, no such host, timeout, starting up, no free slot)
    any other database error        its SQLSTATE and first line    EXIT_FAILURE
    broker error                    its redacted message           EXIT_FAILURE
    config error met late           its message                    EXIT_CONFIG
    another Switchboard error       its redacted message           EXIT_FAILURE

A message never holds a password: the database is named by host, port,
database name and user, read from the parsed URL, and any driver text in it
goes through :func:`ingest.observe.logs.redact`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import psycopg
from sqlalchemy.engine import make_url
from sqlalchemy.exc import TimeoutError as PoolTimeout

from backhalf import db_errors
from backhalf.errors import BackhalfError, DeadlineExceeded
from ingest.config import Settings
from ingest.errors import ConfigError, IngestError
from ingest.exit_codes import EXIT_CONFIG, EXIT_DATABASE, EXIT_FAILURE
from ingest.observe.dependency import from_a_client, login_refused, unreachable
from ingest.observe.logs import redact


@dataclass(frozen=True, slots=True)
class Failure:
    message: str  # one line, no password
    exit_code: int


# libpq's and the server's (English) texts for a database out of reach, in
# the order they are tried: what to say in the parentheses.
_UNREACHABLE: tuple[tuple[re.Pattern[str], str], ...] = (
    (
        re.compile(r"Connection refused", re.IGNORECASE),
        "connection refused (is PostgreSQL running there, on that port?)",
    ),
    (
        re.compile(r"failed to resolve host|could not translate host name|Name or service not known"),
        "host name not found (check the host)",
    ),
    (re.compile(r"timeout expired|timed out", re.IGNORECASE), "no answer in time"),
    (re.compile(r"No route to host|Network is unreachable"), "no route to the host"),
    (re.compile(r"the database system is (starting up|shutting down|in recovery mode)"), "the server is {0}"),
    (
        re.compile(r"too many clients|too many connections|remaining connection slots"),
        "no free connection slot",
    ),
)


def database_target(settings: Settings) -> str:
    """``database 'x' at host:port as user 'u' (from SWITCHBOARD_DATABASE_URL)``:
    read from the parsed URL, never its password."""
    url = make_url(settings.database.url)
    where = f"{url.host}:{url.port or 5432}" if url.host else "the local socket"
    user = f" as user {url.username!r}" if url.username else ""
    return f"database {url.database!r} at {where}{user} (from {settings.database_url_origin})"


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return redact(lines[0]) if lines else type(exc).__name__


def _unreachable(error: psycopg.OperationalError) -> str | None:
    text = str(error)
    for pattern, words in _UNREACHABLE:
        match = pattern.search(text)
        if match:
            return words.format(*match.groups())
    return None


def _database(
    exc: BaseException, chain: list[BaseException], settings: Settings, role_hint: str | None
) -> Failure | None:
    target = database_target(settings)
    problem = db_errors.classify(exc)
    if problem is not None and problem.kind == "permission_denied" and role_hint is not None:
        # Not "migrate": the tables are there, this login is another role's.
        return Failure(f"the database user lacks a privilege this command needs: {role_hint} [{target}]",
                       EXIT_DATABASE)  # fmt: skip
    if problem is not None:
        return Failure(f"{problem.message} [{target}]", EXIT_DATABASE)
    for e in chain:
        if isinstance(e, DeadlineExceeded | PoolTimeout):
            return Failure(f"cannot reach the {target}: no answer in time", EXIT_FAILURE)
        if isinstance(e, psycopg.OperationalError) and (reason := _unreachable(e)) is not None:
            return Failure(f"cannot reach the {target}: {reason}", EXIT_FAILURE)
    for e in chain:
        if isinstance(e, psycopg.Error):
            state = f" (SQLSTATE {e.sqlstate})" if e.sqlstate else ""
            return Failure(f"the {target} failed{state}: {_first_line(e)}", EXIT_FAILURE)
    return None


def explain(exc: BaseException, settings: Settings, role_hint: str | None = None) -> Failure | None:
    """The one line and exit code for ``exc``, raised by a verb run with
    ``settings``; None if no user could have caused it (a bug).
    ``role_hint``: which role's login runs the command, for a privilege refused."""
    chain = db_errors.error_chain(exc)
    database = _database(exc, chain, settings, role_hint)
    if database is not None:
        return database
    for e in chain:
        if (refusing := login_refused(e)) is not None:
            # Where that transport's URL comes from: its variables, its table.
            table = [f"[{refusing.name}] url"] if refusing.file_table is not None else []
            where = ", ".join([*refusing.variables, *table])
            return Failure(
                "the broker refused the login: check the user and password in the broker URL"
                f" ({where} or the adapter's url)",
                EXIT_FAILURE,
            )
        if unreachable(e):
            return Failure(f"cannot reach the broker: {_first_line(e)}", EXIT_FAILURE)
    if isinstance(exc, ConfigError):
        return Failure(f"config error: {exc}", EXIT_CONFIG)
    if isinstance(exc, IngestError | BackhalfError) or from_a_client(exc):
        return Failure(_first_line(exc), EXIT_FAILURE)
    return None
