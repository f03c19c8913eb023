"""Audit views: the SQL-level answers an operator asks for (DESIGN.md section 4).

The DDL is static text (no runtime values). A migration carries a frozen copy
of the statements it applied; ``tests/integration/test_migrations.py`` checks
that the newest migration's views match these.
"""

from __future__ import annotations

MESSAGE_TRAIL = """
CREATE OR REPLACE VIEW audit_message_trail AS
SELECT i.id AS inbox_id,
       i.adapter,
       i.idempotency_key,
       i.source_message_id,
       i.consumer,
       i.status AS inbox_status,
       i.error,
       i.deliveries,
       i.stored_at,
       e.id AS event_id,
       e.family,
       e.trust_mode,
       e.verified,
       e.verify_detail,
       e.received_at,
       t.id AS todo_id,
       t.queue,
       t.status AS todo_status,
       i.ack_kind,
       i.ack_key,
       i.ack_group,
       i.ack_entry_id,
       i.ack_state,
       i.acked_at
FROM inbox i
LEFT JOIN events e ON e.id = i.event_id
LEFT JOIN todos t ON t.id = i.todo_id
"""

UNACKED = """
CREATE OR REPLACE VIEW audit_unacked AS
SELECT i.id AS inbox_id,
       i.adapter,
       i.idempotency_key,
       i.source_message_id,
       i.ack_kind,
       i.ack_key,
       i.ack_entry_id,
       i.status AS inbox_status,
       i.stored_at,
       now() - i.stored_at AS age
FROM inbox i
WHERE i.ack_state = 'pending'
"""

REJECTED = """
CREATE OR REPLACE VIEW audit_rejected AS
SELECT i.id AS inbox_id,
       i.adapter,
       i.idempotency_key,
       i.source_message_id,
       i.error,
       i.deliveries,
       i.ack_state,
       i.stored_at
FROM inbox i
WHERE i.status = 'rejected'
"""

ADAPTER_COUNTS = """
CREATE OR REPLACE VIEW audit_adapter_counts AS
SELECT a.name AS adapter,
       a.enabled,
       count(i.id) FILTER (WHERE i.status = 'stored') AS stored,
       count(i.id) FILTER (WHERE i.status = 'rejected') AS rejected,
       count(i.id) FILTER (WHERE i.ack_state = 'pending') AS pending_acks,
       count(i.id) FILTER (WHERE i.ack_state = 'acked') AS acked,
       now() - min(i.stored_at) FILTER (WHERE i.ack_state = 'pending') AS oldest_unacked_age
FROM adapters a
LEFT JOIN inbox i ON i.adapter = a.name
GROUP BY a.name, a.enabled
"""

# name -> CREATE statement, in creation order.
VIEWS: dict[str, str] = {
    "audit_message_trail": MESSAGE_TRAIL,
    "audit_unacked": UNACKED,
    "audit_rejected": REJECTED,
    "audit_adapter_counts": ADAPTER_COUNTS,
}
