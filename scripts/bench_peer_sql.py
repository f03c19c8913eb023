"""The FastStream peer's statements (scripts/bench_faststream.py), apart from
FastStream, so that the suite runs them against the schema as it is
(tests/integration/backhalf/test_bench_peer_sql.py): a peer whose SQL no
longer fits the schema stores nothing and measures nothing."""

# The native key first (inbox_keys, as the store claims it), the inbox row
# under the id it took; todos and events only for the rows it inserted. A
# todo goes into todos_live, the partition whose unique index of active
# todos ON CONFLICT infers (schema.tables), as the store's does.
STORE_SQL = """
WITH u AS (
    SELECT * FROM unnest(%(keys)b::text[], %(ids)b::text[], %(bodies)b::bytea[], %(payloads)b::text[])
        WITH ORDINALITY AS u(k, m, b, p, n)
), keyed AS (
    INSERT INTO inbox_keys (adapter, idempotency_key, inbox_id)
    SELECT 'bench', u.k, nextval(pg_get_serial_sequence('inbox', 'id')) FROM u ORDER BY u.n
    ON CONFLICT (adapter, idempotency_key) DO NOTHING
    RETURNING idempotency_key, inbox_id
), ins AS (
    INSERT INTO inbox (id, adapter, idempotency_key, source_message_id, consumer, body, ack_kind, ack_key,
                       ack_group, ack_entry_id, ack_state, status)
    SELECT keyed.inbox_id, 'bench', u.k, u.m, %(consumer)s, u.b, 'xack', %(stream)s, %(group)s, u.m,
           'pending', 'stored'
    FROM u JOIN keyed ON keyed.idempotency_key = u.k ORDER BY u.n
    RETURNING id, idempotency_key
), t AS (
    INSERT INTO todos_live (queue, idempotency_key, payload)
    SELECT 'bench', u.k, u.p::jsonb FROM u JOIN ins ON ins.idempotency_key = u.k ORDER BY u.n
    ON CONFLICT (queue, idempotency_key) WHERE status IN ('pending', 'dispatched', 'running') DO NOTHING
    RETURNING id, idempotency_key
){logged}, ev AS (
INSERT INTO events (family, adapter, trust_mode, verified, verify_detail, idempotency_key,
                    source_message_id, payload, todo_id)
SELECT 'queue', 'bench', 'queue', false, 'redis acl: default', u.k, u.m, u.p::jsonb, t.id
FROM u JOIN t ON t.idempotency_key = u.k
)
SELECT array_agg(id) FROM ins
"""
LOGGED = """, logged AS (
    INSERT INTO todo_events (todo_id, from_status, to_status, detail)
    SELECT id, NULL, 'pending', 'created by the peer' FROM t
)"""
MARK_SQL = "UPDATE inbox SET ack_state = 'acked', acked_at = now() WHERE id = ANY(%(ids)b::int8[])"
