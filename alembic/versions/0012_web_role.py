"""processes.role: 'web', the operator console's heartbeat (issue 31)

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-03 10:20:00.000000

``switchboard web`` beats in the processes table beside the other
processes, so that `status` and the console's own processes page show it.
Only the check constraint changes; no row is rewritten.
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.drop_constraint(op.f("ck_processes_role"), "processes", type_="check")
    op.create_check_constraint(
        op.f("ck_processes_role"), "processes", "role IN ('ingest', 'ack', 'worker', 'receive', 'web')"
    )


def downgrade() -> None:
    op.execute("DELETE FROM processes WHERE role = 'web'")
    op.drop_constraint(op.f("ck_processes_role"), "processes", type_="check")
    op.create_check_constraint(
        op.f("ck_processes_role"), "processes", "role IN ('ingest', 'ack', 'worker', 'receive')"
    )
