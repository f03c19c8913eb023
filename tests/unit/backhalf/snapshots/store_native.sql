WITH u AS (
    SELECT * FROM unnest(%(keys)b::text[], %(ids)b::text[], %(bodies)b::bytea[], %(payloads)b::text[],
                         %(ack_keys)b::text[], %(entry_ids)b::text[], %(copies)b::int4[],
                         %(deliveries)b::int4[], %(errors)b::text[], %(sizes)b::int8[],
                         %(digests)b::bytea[], %(attributes)b::text[], %(trace_contexts)b::text[])
        WITH ORDINALITY AS u(k, m, b, p, ak, e, c, d, err, bs, bh, sa, tc, n)
),
t AS (
    INSERT INTO todos_live (queue, idempotency_key, payload, trace_context)
    SELECT %(queue)s, u.k, u.p::jsonb, u.tc::jsonb FROM u WHERE u.p IS NOT NULL ORDER BY u.n
    ON CONFLICT (queue, idempotency_key) WHERE status IN ('pending', 'dispatched', 'running')
    DO UPDATE SET updated_at = todos_live.updated_at
    RETURNING id, idempotency_key, (xmax = 0) AS created
),
logged AS (
    INSERT INTO todo_events (todo_id, from_status, to_status, detail)
    SELECT id, NULL, 'pending', %(todo_detail)s FROM t WHERE created
),
ev AS (
    INSERT INTO events (family, adapter, trust_mode, verified, verify_detail,
                        idempotency_key, source_message_id, payload, todo_id)
    SELECT %(family)s, %(adapter)s, %(trust_mode)s, %(verified)s, %(verify_detail)s,
           u.k, u.m, u.p::jsonb, t.id
    FROM u JOIN t ON t.idempotency_key = u.k
    RETURNING id, idempotency_key, todo_id
),
keyed AS (
    INSERT INTO inbox_keys AS k (adapter, idempotency_key, inbox_id)
    SELECT %(adapter)s, u.k, nextval((SELECT pg_get_serial_sequence('inbox', 'id')::regclass)) FROM u ORDER BY u.n
    ON CONFLICT (adapter, idempotency_key) DO UPDATE SET inbox_id = k.inbox_id
    RETURNING k.idempotency_key, k.inbox_id, (k.xmax = 0) AS fresh
),
fresh AS (
    INSERT INTO inbox (id, adapter, idempotency_key, source_message_id, consumer, body, body_size, body_sha256,
                       ack_kind, ack_key, ack_group, ack_entry_id, ack_copies, ack_after,
                       ack_state, deliveries, status, error, todo_id, event_id, ack_xid, source_attributes)
    SELECT keyed.inbox_id, %(adapter)s, u.k, u.m, %(consumer)s, u.b, u.bs, u.bh,
           %(ack_kind)s, coalesce(u.ak, %(ack_key)s), %(ack_group)s,
           CASE WHEN %(entry_is_id)s THEN u.m ELSE u.e END, coalesce(u.c, 1), %(ack_after)s,
           %(ack_state)s, coalesce(u.d, 1), CASE WHEN u.err IS NULL THEN 'stored' ELSE 'rejected' END, u.err,
           ev.todo_id, ev.id, CASE WHEN %(by_cursor)s THEN (SELECT pg_current_xact_id()::text::int8) END,
           u.sa::jsonb
    FROM u JOIN keyed ON keyed.idempotency_key = u.k AND keyed.fresh
    LEFT JOIN ev ON ev.idempotency_key = u.k
    ORDER BY u.n
    RETURNING id, adapter, idempotency_key, ack_kind, ack_key, ack_state, ack_after, todo_id, true AS inserted
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
    SELECT * FROM fresh UNION ALL SELECT * FROM again
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
SELECT u.k, w.inserted, ev.id, ev.todo_id, t.created
FROM u
LEFT JOIN written w ON w.idempotency_key = u.k
LEFT JOIN ev ON ev.idempotency_key = u.k
LEFT JOIN t ON t.idempotency_key = u.k
