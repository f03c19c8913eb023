"""The todos table is the workers' queue: todos.run_after, ix_todos_claimable;
the relay's dispatched_at, rescues and their indexes dropped

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-06 06:00:00.000000

The workers claim due todos straight from ``todos`` (DESIGN.md section 7b,
docs/decisions/0001-workers-on-postgresql.md): ``run_after`` dates when a
todo may run (its creation, or the end of a retry's backoff), and the one
partial index that holds the claimable rows gives the claim its order. The
relay's bookkeeping goes: ``dispatched_at`` (its outbox's age) and
``rescues`` (its re-sends of lost messages), with their indexes. Rows an
older version left ``dispatched`` stay as they are and are claimed like
pending ones.

``run_after``'s default is ``now()``, a stable function: the column is added
without rewriting the table (every existing row reads the migration's time,
which makes them all due at once, in id order).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # The index's build reads the whole table (months of retained todos, if
    # retention is off): past env.py's statement_timeout for a big one.
    # Bounded all the same, for this migration's transaction only.
    op.execute("SET LOCAL statement_timeout = '1h'")
    op.add_column(
        "todos",
        sa.Column("run_after", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
    )
    op.create_index(
        "ix_todos_claimable",
        "todos",
        ["queue", "run_after", "id"],
        unique=False,
        postgresql_where=sa.text("status IN ('pending', 'dispatched')"),
    )
    op.drop_index("ix_todos_pending", table_name="todos", postgresql_where=sa.text("status = 'pending'"))
    op.drop_index(
        "ix_todos_dispatched_at", table_name="todos", postgresql_where=sa.text("status = 'dispatched'")
    )
    op.drop_column("todos", "rescues")
    op.drop_column("todos", "dispatched_at")


def downgrade() -> None:
    # The relay's columns back; todos the workers left pending are relayed
    # by the older version's acker as any pending todo.
    op.add_column("todos", sa.Column("dispatched_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column("todos", sa.Column("rescues", sa.Integer(), server_default="0", nullable=False))
    op.create_index(
        "ix_todos_dispatched_at",
        "todos",
        ["dispatched_at"],
        unique=False,
        postgresql_where=sa.text("status = 'dispatched'"),
    )
    op.create_index(
        "ix_todos_pending", "todos", ["queue", "id"], unique=False, postgresql_where=sa.text("status = 'pending'")
    )
    op.drop_index(
        "ix_todos_claimable", table_name="todos", postgresql_where=sa.text("status IN ('pending', 'dispatched')")
    )
    op.drop_column("todos", "run_after")
