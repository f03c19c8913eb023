"""ack kinds registered by the transports: no constraint lists them; the copy
bookkeeping keyed on ack_queue.by_body, not on a kind

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-02 05:20:00.000000

The inbox and the ack queue no longer list the ack kinds (``xack``, ``lrem``,
``none``) in check constraints: a kind is a transport's word, registered with
its modes (issue 23). What the back half needs of a list's intents, that
copies of one body on one key merge into one row and recovery locks them by
key, is ``ack_queue.by_body``; the two partial indexes that served it are
rebuilt on it. The queue holds only acks still owed, so the rebuild is small.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("ack_queue", sa.Column("by_body", sa.Boolean(), server_default=sa.false(), nullable=False))
    op.execute("UPDATE ack_queue SET by_body = true WHERE ack_kind = 'lrem'")
    op.drop_index("uq_ack_queue_body", table_name="ack_queue", postgresql_where=sa.text("ack_kind = 'lrem'"))
    op.drop_index(
        "ix_ack_queue_lrem_ack_key", table_name="ack_queue", postgresql_where=sa.text("ack_kind = 'lrem'")
    )
    op.create_index(
        "uq_ack_queue_body",
        "ack_queue",
        ["adapter", "idempotency_key", "ack_key"],
        unique=True,
        postgresql_where=sa.text("by_body"),
    )
    op.create_index(
        "ix_ack_queue_body_ack_key",
        "ack_queue",
        ["ack_key"],
        unique=False,
        postgresql_where=sa.text("by_body"),
    )
    op.drop_constraint(op.f("ck_ack_queue_ack_kind"), "ack_queue", type_="check")
    op.drop_constraint(op.f("ck_inbox_ack_kind"), "inbox", type_="check")


def downgrade() -> None:
    op.create_check_constraint(op.f("ck_inbox_ack_kind"), "inbox", "ack_kind IN ('xack', 'lrem', 'none')")
    op.create_check_constraint(op.f("ck_ack_queue_ack_kind"), "ack_queue", "ack_kind IN ('xack', 'lrem')")
    op.drop_index("ix_ack_queue_body_ack_key", table_name="ack_queue", postgresql_where=sa.text("by_body"))
    op.drop_index("uq_ack_queue_body", table_name="ack_queue", postgresql_where=sa.text("by_body"))
    op.create_index(
        "ix_ack_queue_lrem_ack_key",
        "ack_queue",
        ["ack_key"],
        unique=False,
        postgresql_where=sa.text("ack_kind = 'lrem'"),
    )
    op.create_index(
        "uq_ack_queue_body",
        "ack_queue",
        ["adapter", "idempotency_key", "ack_key"],
        unique=True,
        postgresql_where=sa.text("ack_kind = 'lrem'"),
    )
    op.drop_column("ack_queue", "by_body")
