WITH u AS (SELECT %(key)s::text AS k, %(payload)s::text AS p, NULL::text AS tc, 1 AS n),
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
)
SELECT id FROM t
