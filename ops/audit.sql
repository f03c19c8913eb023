-- SQL-level audit questions. The views are created by the migrations.
-- Every statement reads the audit_* views only, so it runs as the auditor
-- role of ops/roles.sql (switchboard_auditor_login), which may read nothing else.

-- The trail of one message: inbox -> event -> todo -> ack.
SELECT * FROM audit_message_trail WHERE idempotency_key = 'redis:orders:1700000000000-0';

-- Stored but not yet acknowledged at the broker, oldest first.
SELECT adapter, idempotency_key, age FROM audit_unacked ORDER BY stored_at LIMIT 50;

-- Rejected (poison) and lost-before-ingest messages.
SELECT adapter, idempotency_key, error, deliveries, stored_at FROM audit_rejected ORDER BY inbox_id DESC LIMIT 50;

-- Per adapter: stored, rejected, pending acks, acked, oldest unacked age.
SELECT * FROM audit_adapter_counts;

-- The invariant: at most one non-terminal todo per (queue, key). Always empty.
SELECT queue, idempotency_key, count(DISTINCT todo_id) FROM audit_message_trail
WHERE todo_status IN ('pending', 'dispatched', 'running')
GROUP BY 1, 2 HAVING count(DISTINCT todo_id) > 1;

-- Every inbox row of one stream entry id, whichever adapter read it (the
-- CLI's `switchboard trace ENTRY_ID` does this through the native key index;
-- this form scans the inbox).
SELECT * FROM audit_message_trail WHERE source_message_id = '1700000000000-0';

-- Redeliveries per adapter: rows delivered more than once, and how many
-- deliveries the inbox absorbed (deliveries - 1 per row).
SELECT * FROM audit_redeliveries ORDER BY redeliveries DESC;

-- The distribution of deliveries per adapter: how many rows took N deliveries.
SELECT adapter, deliveries, inbox_rows FROM audit_delivery_counts ORDER BY adapter, deliveries;

-- The messages delivered most often (poison candidates near max_deliveries).
SELECT adapter, idempotency_key, deliveries, inbox_status, error FROM audit_message_trail
WHERE deliveries > 1 ORDER BY deliveries DESC LIMIT 20;

-- The last hour, per adapter and minute: consumed, deduplicated (by the inbox
-- and by the todo index), rejected, acked, and ack latency percentiles.
-- Always filter on minute: the filter reaches both scans of the inbox.
SELECT adapter, minute, consumed, deduplicated_inbox, deduplicated_todo, rejected, acked,
       round(ack_latency_p50_s::numeric, 3) AS p50_s,
       round(ack_latency_p95_s::numeric, 3) AS p95_s,
       round(ack_latency_p99_s::numeric, 3) AS p99_s
FROM audit_adapter_minutes
WHERE minute >= now() - interval '1 hour'
ORDER BY adapter, minute;

-- The same, one row per adapter for the whole hour (percentiles of the hour's
-- acks, not an average of per-minute percentiles).
SELECT adapter,
       count(*) AS acked,
       percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM acked_at - stored_at)) AS p50_s,
       percentile_cont(0.99) WITHIN GROUP (ORDER BY extract(epoch FROM acked_at - stored_at)) AS p99_s
FROM audit_message_trail
WHERE acked_at >= now() - interval '1 hour'
GROUP BY adapter;
