"""The todo keeps its message's trace context (issue 47)

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-06 15:00:00.000000

``todos.trace_context`` (jsonb, NULL without one): the W3C
``traceparent`` and ``tracestate`` its message carried, kept so that a run
days later, after a crash, a rescue or a retry, joins its producer's trace
(DESIGN.md section 14, backhalf.tracing). A nullable column with no default:
a change of the catalog only, whatever the table holds.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("todos", sa.Column("trace_context", JSONB(), nullable=True))


def downgrade() -> None:
    op.drop_column("todos", "trace_context")
