"""processes.role: 'receive', the push ingester's heartbeat (issue 30)

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-03 07:30:00.000000

``switchboard receive`` beats in the processes table beside ingest, ack and
worker. Only the check constraint changes; no row is rewritten.
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.drop_constraint(op.f("ck_processes_role"), "processes", type_="check")
    op.create_check_constraint(
        op.f("ck_processes_role"), "processes", "role IN ('ingest', 'ack', 'worker', 'receive')"
    )


def downgrade() -> None:
    op.execute("DELETE FROM processes WHERE role = 'receive'")
    op.drop_constraint(op.f("ck_processes_role"), "processes", type_="check")
    op.create_check_constraint(op.f("ck_processes_role"), "processes", "role IN ('ingest', 'ack', 'worker')")
