"""stream_groups: where each consumer group Switchboard created started

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02 10:00:00.000000

A stream adapter records its group's concrete start id here before it
creates the group, and recreates a destroyed group at that id instead of at
the configured ``start_id`` (whose ``$`` would by then mean "later").
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0002'
down_revision: str | None = '0001'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('stream_groups',
    sa.Column('broker', sa.Text(), nullable=False),
    sa.Column('stream', sa.Text(), nullable=False),
    sa.Column('group_name', sa.Text(), nullable=False),
    sa.Column('adapter', sa.Text(), nullable=False),
    sa.Column('start_id', sa.Text(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    # Frozen as applied (schema.tables.STREAM_ID_PATTERN holds the current text).
    sa.CheckConstraint("start_id ~ '^[0-9]+(-[0-9]+)?$'", name=op.f('ck_stream_groups_start_id')),
    sa.PrimaryKeyConstraint('broker', 'stream', 'group_name', name=op.f('pk_stream_groups'))
    )


def downgrade() -> None:
    op.drop_table('stream_groups')
