"""inbox.source_attributes: what the broker says of a message beyond its id

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-02 22:40:00.000000

JSON, for audit: an SQS FIFO queue's ``MessageGroupId`` and
``SequenceNumber`` (issue 27). Nullable and without a default, so adding it
rewrites no row. Every store inserts it, so where ``ops/roles.sql``'s
ingester role exists it is granted the column here (the table's owner may),
and stores go on without waiting for the file to run again.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("inbox", sa.Column("source_attributes", JSONB(), nullable=True))
    op.execute(
        """
        DO $$
        BEGIN
            IF EXISTS (SELECT FROM pg_roles WHERE rolname = 'switchboard_ingester') THEN
                GRANT INSERT (source_attributes) ON inbox TO switchboard_ingester;
            END IF;
        END
        $$
        """
    )


def downgrade() -> None:
    op.drop_column("inbox", "source_attributes")
