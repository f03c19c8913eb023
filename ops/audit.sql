-- SQL-level audit questions. The views are created by the migrations.

-- The trail of one message: inbox -> event -> todo -> ack.
SELECT * FROM audit_message_trail WHERE idempotency_key = 'redis:orders:1700000000000-0';

-- Stored but not yet acknowledged at the broker, oldest first.
SELECT adapter, idempotency_key, age FROM audit_unacked ORDER BY stored_at LIMIT 50;

-- Rejected (poison) and lost-before-ingest messages.
SELECT adapter, idempotency_key, error, deliveries, stored_at FROM audit_rejected ORDER BY inbox_id DESC LIMIT 50;

-- Per adapter: stored, rejected, pending acks, acked, oldest unacked age.
SELECT * FROM audit_adapter_counts;

-- The invariant: at most one non-terminal todo per (queue, key). Always empty.
SELECT queue, idempotency_key, count(*) FROM todos
WHERE status IN ('pending', 'dispatched', 'running')
GROUP BY 1, 2 HAVING count(*) > 1;
