"""ack cursor: stream acks owed now found by transaction id, not an ack_queue row

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01 22:00:00.000000

``inbox.ack_xid`` holds the id of the transaction that stored a stream entry
whose ack is owed now (xack, ack_after "store"); the acker walks
``ix_inbox_ack_cursor`` from its ``ack_cursors`` row, below its snapshot's
xmin. Rows queued before this revision keep their ``ack_queue`` rows and are
acked from there.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0008'
down_revision: str | None = '0007'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column('inbox', sa.Column('ack_xid', sa.BigInteger(), nullable=True))
    op.create_index(
        'ix_inbox_ack_cursor',
        'inbox',
        ['adapter', 'ack_xid', 'id'],
        unique=False,
        postgresql_where=sa.text('ack_xid IS NOT NULL'),
    )
    op.create_table(
        'ack_cursors',
        sa.Column('adapter', sa.Text(), nullable=False),
        sa.Column('xid', sa.BigInteger(), nullable=False),
        sa.Column('inbox_id', sa.BigInteger(), nullable=False),
        sa.Column('cluster', sa.Text(), nullable=False),
        sa.Column('moved_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
        sa.PrimaryKeyConstraint('adapter', name=op.f('pk_ack_cursors')),
    )


def downgrade() -> None:
    # Acks owed through the cursor go back to ack_queue, so none is lost.
    op.execute(
        "INSERT INTO ack_queue (inbox_id, adapter, ack_kind, ack_key, idempotency_key)"
        " SELECT id, adapter, ack_kind, ack_key, idempotency_key FROM inbox"
        " WHERE ack_xid IS NOT NULL AND ack_state = 'pending' ON CONFLICT (inbox_id) DO NOTHING"
    )
    op.drop_table('ack_cursors')
    op.drop_index('ix_inbox_ack_cursor', table_name='inbox', postgresql_where=sa.text('ack_xid IS NOT NULL'))
    op.drop_column('inbox', 'ack_xid')
