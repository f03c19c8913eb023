WITH u AS (
    SELECT * FROM unnest(%(keys)b::text[], %(ids)b::text[], %(bodies)b::bytea[], %(payloads)b::text[],
                         %(ack_keys)b::text[], %(entry_ids)b::text[], %(copies)b::int4[],
                         %(deliveries)b::int4[], %(errors)b::text[], %(sizes)b::int8[],
                         %(digests)b::bytea[], %(attributes)b::text[], %(trace_contexts)b::text[])
        WITH ORDINALITY AS u(k, m, b, p, ak, e, c, d, err, bs, bh, sa, tc, n)
),
keyed AS (
    SELECT k.idempotency_key, k.inbox_id, false AS fresh FROM inbox_keys k
    WHERE k.adapter = %(adapter)s AND k.idempotency_key = ANY(%(keys)b::text[])
),
again AS (
    UPDATE inbox SET deliveries = GREATEST(inbox.deliveries + 1, coalesce(r.d, 1)),
                     consumer = %(consumer)s,
                     ack_key = coalesce(r.ak, %(ack_key)s),
                     ack_group = %(ack_group)s,
                     ack_entry_id = CASE WHEN %(entry_is_id)s THEN r.m ELSE r.e END,
                     ack_state = CASE WHEN inbox.ack_kind = 'none' THEN 'none' ELSE 'pending' END,
                     acked_at = NULL,
                     ack_xid = CASE WHEN %(by_cursor)s THEN (SELECT pg_current_xact_id()::text::int8) END
    FROM (SELECT u.*, keyed.inbox_id FROM u JOIN keyed ON keyed.idempotency_key = u.k AND NOT keyed.fresh) AS r
    WHERE inbox.id = ANY(ARRAY(SELECT inbox_id FROM keyed WHERE NOT fresh))
      AND inbox.id = r.inbox_id AND inbox.adapter = %(adapter)s AND inbox.idempotency_key = r.k
      AND (%(id_names_message)s
           OR coalesce(inbox.body_sha256, sha256(inbox.body)) = coalesce(r.bh, sha256(r.b))
           OR starts_with(r.err, 'lost_before_ingest'))
    RETURNING inbox.id, inbox.adapter, inbox.idempotency_key, inbox.ack_kind, inbox.ack_key, inbox.ack_state,
              inbox.ack_after, inbox.todo_id, false AS inserted
),
written AS (
    SELECT * FROM again
),
still_active AS (
    SELECT id FROM todos
    WHERE id IN (SELECT todo_id FROM written WHERE NOT inserted AND ack_after = 'complete')
      AND status IN ('pending', 'dispatched', 'running')
    ORDER BY id
    FOR SHARE
),
queued AS (
    INSERT INTO ack_queue (inbox_id, adapter, ack_kind, ack_key, idempotency_key, waiting_for, by_body)
    SELECT id, adapter, ack_kind, ack_key, idempotency_key,
           CASE WHEN ack_after = 'complete' AND (inserted OR todo_id IN (SELECT id FROM still_active))
                THEN todo_id END,
           %(by_body)s
    FROM written
    WHERE ack_state = 'pending' AND NOT %(by_cursor)s
    ON CONFLICT (inbox_id) DO NOTHING
)
SELECT idempotency_key FROM written
