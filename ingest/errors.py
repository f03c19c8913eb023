"""Exceptions of the ingest side.

::

    IngestError
     ├── ConfigError            bad config: names the adapter and the key
     ├── BrokerError            a broker call failed (the client's error attached as __cause__)
     │    └── GroupMissing      NOGROUP: the consumer group vanished; recreate it
     └── AckError               sending acks to the broker failed; rows stay pending

Each transport classifies its client's errors in one place (its folder's
``common``) and maps them to these at the adapter boundary with
``raise ... from exc``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sqlalchemy.exc import SQLAlchemyError

from backhalf.errors import BackhalfError

if TYPE_CHECKING:
    from structlog.typing import FilteringBoundLogger


class IngestError(Exception):
    """Root of every ingest-side error."""


class ConfigError(IngestError):
    """The configuration is invalid; the process must not start."""


class BrokerError(IngestError):
    """A broker operation failed; the loop backs off and retries."""


class GroupMissing(BrokerError):
    """The stream's consumer group no longer exists (NOGROUP)."""


class AckError(IngestError):
    """The broker refused or did not answer an ack; the intents stay pending."""


class wrapped_errors:  # a context manager, named like contextlib's
    """Raise a client library's errors (those in ``caught``) as ``error``
    with ``adapter X: what: detail``, the original as the cause; one
    subclass per transport says which errors and how they read."""

    caught: tuple[type[BaseException], ...] = (OSError, TimeoutError)

    def __init__(self, adapter: str, what: str, *, error: type[IngestError] | None = None) -> None:
        self._adapter, self._what, self._error = adapter, what, error or BrokerError

    @staticmethod
    def detail(exc: BaseException) -> str:
        return str(exc) or type(exc).__name__

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        if exc is None or isinstance(exc, IngestError):
            return
        if isinstance(exc, self.caught):
            raise self._error(f"adapter {self._adapter}: {self._what}: {self.detail(exc)}") from exc


class AcksRolledBack(AckError):
    """The broker answered, refusing some acks one by one, and none could be
    marked (some were claimed from the ack queue): the drain rolled back and
    backs off; the broker itself is up."""


class AcksRefused(AckError):
    """The broker refused some acks one by one (they stay pending) and took
    ``acked`` others, which are marked: the drain committed."""

    def __init__(self, message: str, *, acked: int) -> None:
        super().__init__(message)
        self.acked = acked


# What the loops expect to meet (the broker, the database, the errors we wrap
# them in): logged as warnings and retried. Anything else is a bug, logged
# with its traceback, and retried too.
EXPECTED_FAILURES = (IngestError, BackhalfError, SQLAlchemyError)


def failure_fields(exc: BaseException) -> dict[str, Any]:
    """The structured log fields every logged failure carries."""
    return {
        "error": exc,
        "error_type": type(exc).__name__,
        "cause": type(exc.__cause__).__name__ if exc.__cause__ else None,
    }


def log_failure(
    log: FilteringBoundLogger,
    event: str,
    exc: BaseException,
    *,
    expected: tuple[type[BaseException], ...] = EXPECTED_FAILURES,
    **fields: Any,
) -> None:
    """Log a failure under ``event`` with :func:`failure_fields` and ``fields``:
    a warning if it is ``expected``, else an error with its traceback (a bug)."""
    if isinstance(exc, expected):
        log.warning(event, **failure_fields(exc), **fields)
    else:
        log.exception(event, **failure_fields(exc), **fields, exc_info=exc)


def error_kind(exc: BaseException) -> str:
    """The metrics' ``kind`` of a failure: ``broker`` (a client's, wrapped as
    an IngestError at the adapter boundary), ``database`` (the driver's and
    the back half's, which wrap a database failure), or
    ``bug``: anything else is no outage but a fault of ours."""
    if isinstance(exc, IngestError):
        return "broker"
    if isinstance(exc, BackhalfError):
        return exc.failed
    if isinstance(exc, SQLAlchemyError):
        return "database"
    return "bug"
