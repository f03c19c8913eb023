"""inbox.body_size, inbox.body_sha256: a rejected oversize message is kept
as a prefix plus its full length and digest

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01 12:40:00.000000

The store keeps at most ``max_message_bytes`` of any message, or the first
4096 bytes of one over it (``backhalf.writes.normalize.RawForm``); these columns
hold what the prefix cannot: how long the message was and its sha256. Both
NULL for a body kept whole. The digest is also what tells a redelivery of a
prefix-stored message from another message on the same entry id.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = '0003'
down_revision: str | None = '0002'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Nullable, no default: a catalog-only change, no table rewrite.
    op.add_column('inbox', sa.Column('body_size', sa.BigInteger(), nullable=True))
    op.add_column('inbox', sa.Column('body_sha256', postgresql.BYTEA(), nullable=True))


def downgrade() -> None:
    op.drop_column('inbox', 'body_sha256')
    op.drop_column('inbox', 'body_size')
