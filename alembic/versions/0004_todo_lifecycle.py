"""todos.dispatched_at, todos.lease_until, todos.rescues and the indexes of
the dispatch relay and the rescuer

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01 13:00:00.000000

The workers (issue 12) move todos pending -> dispatched -> running -> done
or failed. ``dispatched_at`` dates a todo's last hand-over to dramatiq and
``lease_until`` bounds a running one; past either without progress the
rescuer dispatches it again.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0004'
down_revision: str | None = '0003'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column('todos', sa.Column('dispatched_at', sa.DateTime(timezone=True), nullable=True))
    op.add_column('todos', sa.Column('lease_until', sa.DateTime(timezone=True), nullable=True))
    op.add_column('todos', sa.Column('rescues', sa.Integer(), server_default='0', nullable=False))
    op.create_index('ix_todos_pending', 'todos', ['queue', 'id'], unique=False, postgresql_where=sa.text("status = 'pending'"))
    op.create_index('ix_todos_running_lease', 'todos', ['lease_until'], unique=False, postgresql_where=sa.text("status = 'running'"))
    op.create_index('ix_todos_dispatched_at', 'todos', ['dispatched_at'], unique=False, postgresql_where=sa.text("status = 'dispatched'"))


def downgrade() -> None:
    op.drop_index('ix_todos_dispatched_at', table_name='todos', postgresql_where=sa.text("status = 'dispatched'"))
    op.drop_index('ix_todos_running_lease', table_name='todos', postgresql_where=sa.text("status = 'running'"))
    op.drop_index('ix_todos_pending', table_name='todos', postgresql_where=sa.text("status = 'pending'"))
    op.drop_column('todos', 'rescues')
    op.drop_column('todos', 'lease_until')
    op.drop_column('todos', 'dispatched_at')
