WITH writers AS MATERIALIZED (
    SELECT r.oid FROM pg_roles AS r
    WHERE r.rolsuper OR r.rolcreaterole
       OR pg_has_role(r.oid, (SELECT c.relowner FROM pg_class AS c WHERE c.oid = 'inbox'::regclass), 'MEMBER')
       OR has_column_privilege(r.oid, 'inbox'::regclass, 'ack_xid', 'INSERT, UPDATE')
),
h AS (
    SELECT snap.xmax, coalesce(min(ours.xid), snap.xmax) AS xmin, count(ours.xid) AS running
    FROM (SELECT s, pg_snapshot_xmax(s)::text::int8 AS xmax FROM pg_current_snapshot() AS s) AS snap
    LEFT JOIN LATERAL (
        SELECT x::text::int8 AS xid FROM pg_snapshot_xip(snap.s) AS x
        WHERE x::text::int8 %% 4294967296 NOT IN (
            SELECT a.backend_xid::text::int8 FROM pg_stat_activity AS a
            WHERE a.backend_xid IS NOT NULL
              AND (a.datid <> (SELECT oid FROM pg_database WHERE datname = current_database())
                   OR (has_column_privilege(a.usesysid, 'inbox'::regclass, 'ack_xid', 'INSERT, UPDATE')
                       OR EXISTS (SELECT FROM writers AS w WHERE pg_has_role(a.usesysid, w.oid, 'MEMBER')))
                      IS FALSE))
    ) AS ours ON true
    GROUP BY snap.xmax
),
opened AS (
    INSERT INTO ack_cursors (adapter, xid, inbox_id, cluster)
    VALUES (%(adapter)s, 0, 0, (SELECT system_identifier::text FROM pg_control_system()))
    ON CONFLICT (adapter) DO NOTHING
    RETURNING xid, inbox_id, cluster
), locked AS (
    SELECT xid, inbox_id, cluster FROM ack_cursors WHERE adapter = %(adapter)s FOR UPDATE SKIP LOCKED
), c AS (
    SELECT xid, inbox_id, cluster FROM opened UNION ALL SELECT xid, inbox_id, cluster FROM locked
)
SELECT c.xid, h.xmin,
       c.cluster <> (SELECT system_identifier::text FROM pg_control_system())
           OR c.xid > pg_current_xact_id()::text::int8 AS reset,
       i.id, i.adapter, i.ack_kind, i.ack_key, i.ack_group, i.ack_entry_id, i.ack_copies, i.ack_xid
FROM c CROSS JOIN h
LEFT JOIN LATERAL (
    SELECT id, adapter, ack_kind, ack_key, ack_group, ack_entry_id, ack_copies, ack_xid FROM inbox
    WHERE adapter = %(adapter)s AND ack_xid IS NOT NULL
      AND (ack_xid, id) > (c.xid, c.inbox_id) AND ack_xid < h.xmin AND ack_state = 'pending'
    ORDER BY ack_xid, id
    LIMIT %(limit)s
) AS i ON true
