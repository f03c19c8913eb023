"""The database schema: one SQLAlchemy Core ``MetaData``, the single source for
migrations (alembic's ``env.py`` targets it) and for every query.

Table and column names here are the external contract of DESIGN.md section 4.
"""

from schema.tables import (
    ACK_KINDS,
    ACK_STATES,
    ACTIVE_TODO_STATUSES,
    INBOX_STATUSES,
    TODO_STATUSES,
    adapters,
    delivery_attempts,
    events,
    inbox,
    metadata,
    todo_events,
    todos,
)
from schema.views import VIEWS

__all__ = [
    "ACK_KINDS",
    "ACK_STATES",
    "ACTIVE_TODO_STATUSES",
    "INBOX_STATUSES",
    "TODO_STATUSES",
    "VIEWS",
    "adapters",
    "delivery_attempts",
    "events",
    "inbox",
    "metadata",
    "todo_events",
    "todos",
]
