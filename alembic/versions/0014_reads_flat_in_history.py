"""Reads that stay flat in the history (issue 45)

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-06 12:50:00.000000

Two indexes, measured by tests/integration/processes/test_flat_in_history.py
with ten times the history (buffers touched, not seconds):

* ``ix_todos_queue_status`` (queue, status) becomes
  ``ix_todos_queue_status_id`` (queue, status, id): a page of a queue's
  todos of one status, newest first, is read in the index's order instead
  of all of them sorted (the failed ones among months of done ones).
* ``ix_inbox_body_key`` (adapter, idempotency_key) for rows without a
  native id (list items, pub/sub messages): ``trace`` found those by a scan
  of the whole inbox. Stream entries' rows hold no entry in it.

Each build reads its whole table and holds writes to it back meanwhile
(about a second per million rows on the team's machine): run it in the
stop of an upgrade (docs/deploying.md).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Builds over months of history run past env.py's statement_timeout:
    # bounded all the same, for this migration's transaction only.
    op.execute("SET LOCAL statement_timeout = '1h'")
    op.create_index("ix_todos_queue_status_id", "todos", ["queue", "status", "id"], unique=False)
    op.drop_index("ix_todos_queue_status", table_name="todos")
    op.create_index(
        "ix_inbox_body_key",
        "inbox",
        ["adapter", "idempotency_key"],
        unique=False,
        postgresql_where=sa.text("source_message_id IS NULL"),
    )


def downgrade() -> None:
    op.execute("SET LOCAL statement_timeout = '1h'")
    op.drop_index("ix_inbox_body_key", table_name="inbox", postgresql_where=sa.text("source_message_id IS NULL"))
    op.create_index("ix_todos_queue_status", "todos", ["queue", "status"], unique=False)
    op.drop_index("ix_todos_queue_status_id", table_name="todos")
