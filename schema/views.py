"""Audit views: the SQL-level answers an operator asks for (DESIGN.md section 4).

The DDL is static text (no runtime values). A migration carries a frozen copy
of the statements it applied; ``tests/integration/backhalf/test_migrations.py`` checks
each view here against the newest migration that defines it.
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

# Redeliveries: a delivery of a message the inbox holds already makes no new
# row. A stream entry's row counts it in ``deliveries`` (the store's ON
# CONFLICT bumps it; the broker's own count seeds it on a first store after
# a crash); a list copy merged into its pending row adds to it too. So
# ``deliveries - 1`` is how many deliveries of the row's message were
# absorbed. Whole-table aggregates: for ad-hoc questions, not dashboards.
REDELIVERIES = """
CREATE OR REPLACE VIEW audit_redeliveries AS
SELECT i.adapter,
       count(*) AS inbox_rows,
       count(*) FILTER (WHERE i.deliveries > 1) AS redelivered_rows,
       sum(i.deliveries - 1) AS redeliveries,
       max(i.deliveries) AS max_deliveries
FROM inbox i
GROUP BY i.adapter
"""

# The distribution: how many rows of each adapter were delivered N times.
DELIVERY_COUNTS = """
CREATE OR REPLACE VIEW audit_delivery_counts AS
SELECT i.adapter,
       i.deliveries,
       count(*) AS inbox_rows
FROM inbox i
GROUP BY i.adapter, i.deliveries
"""

# Per adapter and per minute (``date_trunc('minute', ...)``):
#   consumed            inbox rows first stored that minute (one per message);
#   deduplicated_inbox  deliveries those rows absorbed (deliveries - 1: stream
#                       redeliveries, list copies merged), counted in the
#                       minute the row was first stored, as the inbox keeps no
#                       time per delivery;
#   deduplicated_todo   rows stored that minute whose todo existed before
#                       them: their event is not the first event of their todo
#                       (events are written in todo order, so the todo's first
#                       event is the row that created it; ix_events_todo_id
#                       answers per row). A redelivered list body or pub/sub
#                       message, or a replay, that found its todo still active;
#   rejected            rows stored that minute as rejected (poison, lost);
#   acked               rows whose (latest) broker ack was that minute;
#   ack_latency_*_s     acked_at - stored_at of those acked rows, in seconds:
#                       percentiles by percentile_cont. A redelivered entry is
#                       acked again: its latency then runs from its first store.
# Two branches of one UNION ALL, so a WHERE on adapter or minute is pushed
# into both scans. There is no index on inbox.stored_at or acked_at (each
# index costs on the hot insert path), so each branch still reads the whole
# inbox: always filter (WHERE minute >= now() - interval '1 hour'), and on a
# big inbox run it on a replica.
ADAPTER_MINUTES = """
CREATE OR REPLACE VIEW audit_adapter_minutes AS
SELECT m.adapter,
       m.minute,
       count(*) FILTER (WHERE m.stored) AS consumed,
       coalesce(sum(m.redeliveries), 0) AS deduplicated_inbox,
       count(*) FILTER (WHERE m.todo_dedup) AS deduplicated_todo,
       count(*) FILTER (WHERE m.rejected) AS rejected,
       count(*) FILTER (WHERE NOT m.stored) AS acked,
       percentile_cont(0.5) WITHIN GROUP (ORDER BY m.ack_latency_s) AS ack_latency_p50_s,
       percentile_cont(0.95) WITHIN GROUP (ORDER BY m.ack_latency_s) AS ack_latency_p95_s,
       percentile_cont(0.99) WITHIN GROUP (ORDER BY m.ack_latency_s) AS ack_latency_p99_s
FROM (
    SELECT i.adapter,
           date_trunc('minute', i.stored_at) AS minute,
           true AS stored,
           i.deliveries - 1 AS redeliveries,
           i.status = 'rejected' AS rejected,
           EXISTS (SELECT 1 FROM events e WHERE e.todo_id = i.todo_id AND e.id < i.event_id) AS todo_dedup,
           NULL::double precision AS ack_latency_s
    FROM inbox i
    UNION ALL
    SELECT i.adapter,
           date_trunc('minute', i.acked_at),
           false,
           NULL,
           false,
           false,
           extract(epoch FROM i.acked_at - i.stored_at)::double precision
    FROM inbox i
    WHERE i.acked_at IS NOT NULL
) m
GROUP BY m.adapter, m.minute
"""

# name -> CREATE statement, in creation order.
VIEWS: dict[str, str] = {
    "audit_message_trail": MESSAGE_TRAIL,
    "audit_unacked": UNACKED,
    "audit_rejected": REJECTED,
    "audit_adapter_counts": ADAPTER_COUNTS,
    "audit_redeliveries": REDELIVERIES,
    "audit_delivery_counts": DELIVERY_COUNTS,
    "audit_adapter_minutes": ADAPTER_MINUTES,
}
