WITH writers AS MATERIALIZED (
    SELECT r.oid FROM pg_roles AS r
    WHERE r.rolsuper OR r.rolcreaterole
       OR pg_has_role(r.oid, (SELECT c.relowner FROM pg_class AS c WHERE c.oid = 'inbox'::regclass), 'MEMBER')
       OR has_column_privilege(r.oid, 'inbox'::regclass, 'ack_xid', 'INSERT, UPDATE')
)
SELECT 'session' AS kind, a.pid::text AS name, a.usename AS who, age(a.backend_xid) AS behind,
       now() - a.xact_start AS open_for, a.state
FROM pg_stat_activity AS a
WHERE a.backend_xid IS NOT NULL AND a.datname = current_database() AND a.pid <> pg_backend_pid()
  AND (has_column_privilege(a.usesysid, 'inbox'::regclass, 'ack_xid', 'INSERT, UPDATE')
       OR EXISTS (SELECT FROM writers AS w WHERE pg_has_role(a.usesysid, w.oid, 'MEMBER'))) IS NOT FALSE
UNION ALL
SELECT 'prepared transaction', gid, owner::text, age(transaction), now() - prepared, NULL
FROM pg_prepared_xacts
ORDER BY behind DESC LIMIT 1
