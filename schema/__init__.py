"""The database schema: one SQLAlchemy Core ``MetaData``, the single source for
migrations (alembic's ``env.py`` targets it) and for every query.

Table and column names here are the external contract of DESIGN.md section 4.

``schema`` is also the import name of an unrelated PyPI library; installed in
the same environment it replaces this file. ``SWITCHBOARD_SCHEMA`` is how the
console entry (``ingest.entry``) tells this package from that one.
"""

from typing import Final

from schema.tables import (
    ACK_STATES,
    ACTIVE_TODO_STATUSES,
    INBOX_STATUSES,
    TODO_STATUSES,
    adapters,
    delivery_attempts,
    events,
    inbox,
    metadata,
    processes,
    stream_groups,
    todo_events,
    todos,
)
from schema.views import VIEWS

SWITCHBOARD_SCHEMA: Final = True

__all__ = [
    "ACK_STATES",
    "ACTIVE_TODO_STATUSES",
    "INBOX_STATUSES",
    "SWITCHBOARD_SCHEMA",
    "TODO_STATUSES",
    "VIEWS",
    "adapters",
    "delivery_attempts",
    "events",
    "inbox",
    "metadata",
    "processes",
    "stream_groups",
    "todo_events",
    "todos",
]
