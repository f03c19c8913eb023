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
c AS (
    SELECT xid, inbox_id, cluster FROM ack_cursors WHERE adapter = %(adapter)s
)
SELECT NOT EXISTS (SELECT 1 FROM c)
       OR EXISTS (SELECT 1 FROM c WHERE c.cluster <> (SELECT system_identifier::text FROM pg_control_system())
                                     OR c.xid > h.xmax)
       OR EXISTS (SELECT 1 FROM c CROSS JOIN LATERAL (
                      SELECT 1 FROM inbox
                      WHERE adapter = %(adapter)s AND ack_xid IS NOT NULL
                        AND (ack_xid, id) > (c.xid, c.inbox_id) AND ack_xid < h.xmin AND ack_state = 'pending'
                      ORDER BY ack_xid, id
                      LIMIT 1) AS owed),
       h.xmax - h.xmin > h.running AS held
FROM h
