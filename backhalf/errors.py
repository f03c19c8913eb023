"""Exceptions of the back half.

::

    BackhalfError
     ├── PoisonMessage      control flow: this message can never become a todo
     ├── StoreError         a store transaction failed (driver error attached as __cause__)
     ├── ChangeRefused      the database refused one change for its data: never retried
     ├── AckStateError      reading or marking ack intents failed
     ├── DeadlineExceeded   a transaction got no reply within its client-side deadline
     ├── PruneError         a retention batch failed (driver error attached as __cause__)
     └── InjectedFault      a failpoint configured to raise fired (tests only)

Driver errors (psycopg, SQLAlchemy) are wrapped here with ``raise ... from exc``
so callers log one type with context and the original stays in the chain.
``PoisonMessage`` is an outcome, not a failure: it is stored as a rejected
inbox row and is never logged as an error.
"""

from __future__ import annotations

from typing import ClassVar


class BackhalfError(Exception):
    """Root of every back-half error."""

    # What failed, for the metrics' ``kind`` label: the back half talks to
    # the database, save where a subclass says otherwise (dramatiq's broker).
    failed: ClassVar[str] = "database"


class PoisonMessage(BackhalfError):
    """The message can never be normalized; it is stored as ``rejected``."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class StoreError(BackhalfError):
    """Storing a batch failed; nothing of it was committed."""


class ChangeRefused(BackhalfError):
    """The database refused one todo's state change for the data it carries
    (an id out of range, a text it cannot store): written again, it would
    fail again, so it is not (unlike :class:`StoreError`)."""


class AckStateError(BackhalfError):
    """Claiming or marking ack intents failed."""


class DeadlineExceeded(BackhalfError):
    """A transaction did not finish within ``transaction_deadline_ms``; its
    connection was cancelled or closed and its outcome is unknown."""


class PruneError(BackhalfError):
    """A retention batch failed; its transaction deleted nothing."""


class InjectedFault(BackhalfError):
    """A failpoint set to ``raise`` fired."""
