"""processes: a heartbeat row per running ingest, ack and worker process

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01 18:00:00.000000

``switchboard status`` reads it to say which processes are alive and which
died (a row neither stopped nor seen within the heartbeat TTL, and not
replaced by a newer process of its role on its host).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = '0006'
down_revision: str | None = '0005'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        'processes',
        sa.Column('instance', postgresql.UUID(as_uuid=True), nullable=False),
        sa.Column('role', sa.Text(), nullable=False),
        sa.Column('host', sa.Text(), nullable=False),
        sa.Column('pid', sa.Integer(), nullable=False),
        sa.Column('detail', postgresql.JSONB(astext_type=sa.Text()), server_default=sa.text("'{}'::jsonb"), nullable=False),
        sa.Column('started_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
        sa.Column('seen_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
        sa.Column('stopped_at', sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint("role IN ('ingest', 'ack', 'worker')", name=op.f('ck_processes_role')),
        sa.PrimaryKeyConstraint('instance', name=op.f('pk_processes')),
    )
    op.create_index('ix_processes_role_host', 'processes', ['role', 'host'], unique=False)


def downgrade() -> None:
    op.drop_index('ix_processes_role_host', table_name='processes')
    op.drop_table('processes')
