"""audit views: redeliveries, their distribution, per adapter per minute

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01 19:00:00.000000

Views only: no table or index changes (``audit_adapter_minutes`` reads the
inbox by scan on purpose; see schema/views.py).
"""

from collections.abc import Sequence

from alembic import op

revision: str = '0007'
down_revision: str | None = '0006'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Audit views, frozen as applied (schema/views.py holds the current text).
VIEWS = {
    'audit_redeliveries': '\nCREATE OR REPLACE VIEW audit_redeliveries AS\nSELECT i.adapter,\n       count(*) AS inbox_rows,\n       count(*) FILTER (WHERE i.deliveries > 1) AS redelivered_rows,\n       sum(i.deliveries - 1) AS redeliveries,\n       max(i.deliveries) AS max_deliveries\nFROM inbox i\nGROUP BY i.adapter\n',
    'audit_delivery_counts': '\nCREATE OR REPLACE VIEW audit_delivery_counts AS\nSELECT i.adapter,\n       i.deliveries,\n       count(*) AS inbox_rows\nFROM inbox i\nGROUP BY i.adapter, i.deliveries\n',
    'audit_adapter_minutes': "\nCREATE OR REPLACE VIEW audit_adapter_minutes AS\nSELECT m.adapter,\n       m.minute,\n       count(*) FILTER (WHERE m.stored) AS consumed,\n       coalesce(sum(m.redeliveries), 0) AS deduplicated_inbox,\n       count(*) FILTER (WHERE m.todo_dedup) AS deduplicated_todo,\n       count(*) FILTER (WHERE m.rejected) AS rejected,\n       count(*) FILTER (WHERE NOT m.stored) AS acked,\n       percentile_cont(0.5) WITHIN GROUP (ORDER BY m.ack_latency_s) AS ack_latency_p50_s,\n       percentile_cont(0.95) WITHIN GROUP (ORDER BY m.ack_latency_s) AS ack_latency_p95_s,\n       percentile_cont(0.99) WITHIN GROUP (ORDER BY m.ack_latency_s) AS ack_latency_p99_s\nFROM (\n    SELECT i.adapter,\n           date_trunc('minute', i.stored_at) AS minute,\n           true AS stored,\n           i.deliveries - 1 AS redeliveries,\n           i.status = 'rejected' AS rejected,\n           EXISTS (SELECT 1 FROM events e WHERE e.todo_id = i.todo_id AND e.id < i.event_id) AS todo_dedup,\n           NULL::double precision AS ack_latency_s\n    FROM inbox i\n    UNION ALL\n    SELECT i.adapter,\n           date_trunc('minute', i.acked_at),\n           false,\n           NULL,\n           false,\n           false,\n           extract(epoch FROM i.acked_at - i.stored_at)::double precision\n    FROM inbox i\n    WHERE i.acked_at IS NOT NULL\n) m\nGROUP BY m.adapter, m.minute\n",
}


def upgrade() -> None:
    for ddl in VIEWS.values():
        op.execute(ddl)


def downgrade() -> None:
    op.execute('DROP VIEW IF EXISTS audit_adapter_minutes')
    op.execute('DROP VIEW IF EXISTS audit_delivery_counts')
    op.execute('DROP VIEW IF EXISTS audit_redeliveries')
