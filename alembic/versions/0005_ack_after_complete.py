"""ack_queue.waiting_for: acks that wait for their todo's end (ack_after =
"complete"); todos.run_token: a worker's start recognizes its own run

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01 15:00:00.000000

An adapter with ``ack_after = "complete"`` queues its acks as waiting for
their todo; the transaction that makes the todo terminal releases them to
the acker. ``ix_ack_queue_ready`` keeps the acker's claim a walk of the acks
owed now only. ``todos.run_token`` is chosen by the worker for each start,
so a start written again after a lost reply finds its own run.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = '0005'
down_revision: str | None = '0004'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column('ack_queue', sa.Column('waiting_for', sa.BigInteger(), nullable=True))
    op.add_column('todos', sa.Column('run_token', postgresql.UUID(as_uuid=True), nullable=True))
    op.create_index('ix_ack_queue_ready', 'ack_queue', ['inbox_id'], unique=False, postgresql_where=sa.text('waiting_for IS NULL'))
    op.create_index('ix_ack_queue_waiting', 'ack_queue', ['waiting_for'], unique=False, postgresql_where=sa.text('waiting_for IS NOT NULL'))


def downgrade() -> None:
    op.drop_index('ix_ack_queue_waiting', table_name='ack_queue', postgresql_where=sa.text('waiting_for IS NOT NULL'))
    op.drop_index('ix_ack_queue_ready', table_name='ack_queue', postgresql_where=sa.text('waiting_for IS NULL'))
    op.drop_column('ack_queue', 'waiting_for')
    op.drop_column('todos', 'run_token')
