"""Driver errors as SQLAlchemy raises them, for unit tests of the classifiers
(backhalf.db_errors, ingest.cli.errors)."""

from __future__ import annotations

from typing import cast

import psycopg
from sqlalchemy import exc as sa_exc


def wrapped(orig: Exception) -> sa_exc.DBAPIError:
    """As SQLAlchemy raises it: the driver's error as ``orig``."""
    # A DBAPIError when orig is a psycopg.Error, as every caller's is; typed as
    # its base, StatementError, which it is for any other orig.
    return cast(sa_exc.DBAPIError, sa_exc.DBAPIError.instance("SELECT 1", {}, orig, psycopg.Error))


def at_connect(text: str, host: str = "127.0.0.1", port: int = 5432) -> psycopg.OperationalError:
    """libpq's error for a connection attempt that failed with ``text``."""
    return psycopg.OperationalError(
        f'connection failed: connection to server at "{host}", port {port} failed: {text}'
    )
