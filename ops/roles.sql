-- Least-privilege PostgreSQL roles for Switchboard (issue 15).
--
-- Run it as a superuser (or a role with CREATEROLE that owns the database),
-- connected to Switchboard's database, twice: once before the first
-- `switchboard migrate` (it creates the roles and lets the migrator create
-- the schema; the table grants are skipped with a notice while there are no
-- tables), and again after every `switchboard migrate` (the grants are per
-- table and per column, which ALTER DEFAULT PRIVILEGES cannot express, so a
-- migration's new table or column gets its grants from this run). Every
-- statement is idempotent: run it as often as you like.
--
--   psql "postgresql://admin@db/switchboard" -v ON_ERROR_STOP=1 -f ops/roles.sql
--
-- The roles (ops/README.md has the table of what each may do):
--
--   switchboard_migrator  LOGIN: owns the schema; runs `switchboard migrate`
--                         and the operator commands (adapters enable/disable,
--                         inbox replay, todos retry/cancel).
--   switchboard_ingester  NOLOGIN group: `switchboard ingest`.
--   switchboard_acker     NOLOGIN group: `switchboard ack` (acks, the dispatch
--                         relay, the rescuer, the pruner), `switchboard prune`,
--                         `switchboard status` and the read-only commands
--                         (trace, inbox list/show, todos list/show); a member
--                         of the auditor, for the views `status` reads.
--   switchboard_worker    NOLOGIN group: `switchboard worker`.
--   switchboard_auditor   NOLOGIN group: SELECT on the audit_* views only.
--
-- and one login user per group, switchboard_<group>_login, created without a
-- password: set one from your secret store (\password in psql, or ALTER ROLE
-- ... PASSWORD), or grant the group to login users of your own. The migrator
-- logs in as itself because it must own what it creates: a member's tables
-- would belong to the member.
--
-- Column grants are where the table grant would allow more than the code
-- does. Two rules cannot be said with grants and are row-level security
-- policies on inbox and ack_queue (the migrator owns both tables, so RLS does
-- not apply to it, nor to the audit views, which run with its rights):
--
-- * The ingester must write ack_state and acked_at: a redelivered stream
--   entry asks for its ack again (store_inbox_native_cte sets ack_state back
--   to 'pending' and acked_at to NULL). So it may write them only that way:
--   its INSERT and UPDATE policies refuse a row with ack_state 'acked' or an
--   acked_at (SQLSTATE 42501): only the acker marks acks.
-- * The ingester locks ack_queue rows (FOR UPDATE in existing_body_pending
--   and lock_pending_copies), and a row lock needs UPDATE on one column; its
--   UPDATE policy lets it lock and refuses every write (WITH CHECK false).
--   The worker and the acker only ever release a waiting ack (waiting_for to
--   NULL, release_acks and release_orphaned_acks), and may do nothing else.
--
-- LISTEN/NOTIFY and pg_advisory_lock (migrate's lock) need no grant.


-- The roles, each created once.
DO $roles$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'switchboard_migrator') THEN
        CREATE ROLE switchboard_migrator LOGIN;
    END IF;
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'switchboard_ingester') THEN
        CREATE ROLE switchboard_ingester NOLOGIN;
    END IF;
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'switchboard_acker') THEN
        CREATE ROLE switchboard_acker NOLOGIN;
    END IF;
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'switchboard_worker') THEN
        CREATE ROLE switchboard_worker NOLOGIN;
    END IF;
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'switchboard_auditor') THEN
        CREATE ROLE switchboard_auditor NOLOGIN;
    END IF;
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'switchboard_ingester_login') THEN
        CREATE ROLE switchboard_ingester_login LOGIN IN ROLE switchboard_ingester;
    END IF;
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'switchboard_acker_login') THEN
        CREATE ROLE switchboard_acker_login LOGIN IN ROLE switchboard_acker;
    END IF;
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'switchboard_worker_login') THEN
        CREATE ROLE switchboard_worker_login LOGIN IN ROLE switchboard_worker;
    END IF;
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'switchboard_auditor_login') THEN
        CREATE ROLE switchboard_auditor_login LOGIN IN ROLE switchboard_auditor;
    END IF;
END
$roles$;

-- The migrator creates the schema in public (PostgreSQL 15 took CREATE on
-- public from PUBLIC); the others only use it. CONNECT on the database is
-- PUBLIC's by default; where it was revoked, grant it to the five roles.
-- Before 15, PUBLIC could create in public: taken back here (a no-op on 15+).
REVOKE CREATE ON SCHEMA public FROM PUBLIC;
GRANT USAGE, CREATE ON SCHEMA public TO switchboard_migrator;
GRANT USAGE ON SCHEMA public
    TO switchboard_ingester, switchboard_acker, switchboard_worker, switchboard_auditor;
-- `switchboard status` (the acker's) reads the audit views too.
GRANT switchboard_auditor TO switchboard_acker;


-- The grants, per table, for the tables `switchboard migrate` created.
DO $grants$
DECLARE
    view_name name;
BEGIN
    IF to_regclass('public.inbox') IS NULL THEN
        RAISE NOTICE 'no Switchboard tables yet: roles created; run `switchboard migrate` as'
            ' switchboard_migrator, then this file again for the table grants';
        RETURN;
    END IF;

    -- Start from nothing, so a grant taken out of this file is revoked by its next run.
    REVOKE ALL ON adapters, inbox, ack_queue, ack_cursors, events, todos, todo_events, delivery_attempts,
                  stream_groups, processes, alembic_version
        FROM switchboard_ingester, switchboard_acker, switchboard_worker, switchboard_auditor;
    REVOKE ALL ON ALL SEQUENCES IN SCHEMA public
        FROM switchboard_ingester, switchboard_acker, switchboard_worker, switchboard_auditor;

    -- Every process role: its heartbeat row (backhalf.heartbeats), and the
    -- rows a day silent it deletes; `status` reads them all.
    GRANT SELECT, INSERT, DELETE, UPDATE (seen_at, detail, stopped_at) ON processes
        TO switchboard_ingester, switchboard_acker, switchboard_worker;
    -- Every process reads the migration version at start (not migrated: exit 3).
    GRANT SELECT ON alembic_version TO switchboard_ingester, switchboard_acker, switchboard_worker;

    -- The ingester (backhalf.store, registry, attempts, stream_groups).
    -- Registration: its adapters' rows, never the operator's `enabled` flag.
    GRANT SELECT, INSERT (name, family, transport, mode, settings),
          UPDATE (transport, mode, settings, updated_at) ON adapters TO switchboard_ingester;
    -- todos_create_cte: insert, or the no-op update of a dedup; the store's
    -- undo deletes what it created (delete_todos); store_ack_queue_cte locks
    -- with FOR SHARE, which the updated_at grant covers.
    GRANT SELECT, INSERT (queue, idempotency_key, payload), UPDATE (updated_at), DELETE
        ON todos TO switchboard_ingester;
    GRANT SELECT (id, todo_id), INSERT (todo_id, from_status, to_status, detail), DELETE
        ON todo_events TO switchboard_ingester;
    GRANT SELECT, INSERT (family, adapter, trust_mode, verified, verify_detail, idempotency_key,
                          source_message_id, payload, todo_id), DELETE
        ON events TO switchboard_ingester;
    GRANT SELECT,
          INSERT (adapter, idempotency_key, source_message_id, consumer, body, body_size, body_sha256,
                  ack_kind, ack_key, ack_group, ack_entry_id, ack_copies, ack_after, ack_state,
                  deliveries, status, error, todo_id, event_id, ack_xid),
          -- merge_inbox_body, and a redelivery's ON CONFLICT update (ack_state
          -- and acked_at only back to pending: the policies below; ack_xid
          -- for the acker's cursor to meet the row again).
          UPDATE (ack_copies, deliveries, consumer, ack_key, ack_group, ack_state, acked_at, ack_xid)
        ON inbox TO switchboard_ingester;
    -- Queues acks; the UPDATE grant is for row locks only (policy below).
    GRANT SELECT, INSERT (inbox_id, adapter, ack_kind, ack_key, idempotency_key, waiting_for, by_body),
          UPDATE (waiting_for)
        ON ack_queue TO switchboard_ingester;
    GRANT SELECT, INSERT (adapter, idempotency_key, attempts), UPDATE (attempts, last_attempt_at), DELETE
        ON delivery_attempts TO switchboard_ingester;
    GRANT SELECT, INSERT (broker, stream, group_name, adapter, start_id) ON stream_groups
        TO switchboard_ingester;
    GRANT USAGE ON SEQUENCE inbox_id_seq, events_id_seq, todos_id_seq, todo_events_id_seq
        TO switchboard_ingester;

    -- The acker: claim_acks marks acks; the relay and the rescuer move todos
    -- (mark_dispatched, rescue_todos) but create none; release_orphaned_acks;
    -- the pruner (backhalf.retention) deletes what retention allows; status
    -- reads every table.
    GRANT SELECT ON adapters, events, stream_groups, delivery_attempts TO switchboard_acker;
    -- ack_xid: reset_ack_cursor, after a restore into a new cluster.
    GRANT SELECT, UPDATE (ack_state, acked_at, ack_xid), DELETE ON inbox TO switchboard_acker;
    -- cursor_acks makes an adapter's cursor on first use, and moves it.
    GRANT SELECT, INSERT, UPDATE (xid, inbox_id, cluster, moved_at) ON ack_cursors TO switchboard_acker;
    GRANT SELECT, UPDATE (waiting_for), DELETE ON ack_queue TO switchboard_acker;
    GRANT SELECT, UPDATE (status, dispatched_at, updated_at, lease_until, rescues, last_error), DELETE
        ON todos TO switchboard_acker;
    GRANT SELECT, INSERT (todo_id, from_status, to_status, detail), DELETE
        ON todo_events TO switchboard_acker;
    GRANT DELETE ON events, delivery_attempts TO switchboard_acker;
    -- The pruner locks the attempts it deletes (FOR UPDATE SKIP LOCKED), and a
    -- row lock needs UPDATE on one column: the least telling one.
    GRANT UPDATE (last_attempt_at) ON delivery_attempts TO switchboard_acker;
    GRANT USAGE ON SEQUENCE todo_events_id_seq TO switchboard_acker;

    -- The worker: write_states (starts and ends of runs) and release_acks
    -- for ack_after = "complete"; it reads no inbox row, and writes none.
    GRANT SELECT, UPDATE (status, attempts, rescues, lease_until, run_token, last_error, dispatched_at,
                          updated_at)
        ON todos TO switchboard_worker;
    GRANT INSERT (todo_id, from_status, to_status, detail) ON todo_events TO switchboard_worker;
    GRANT SELECT (waiting_for, adapter), UPDATE (waiting_for) ON ack_queue TO switchboard_worker;
    GRANT USAGE ON SEQUENCE todo_events_id_seq TO switchboard_worker;

    -- The auditor: the audit views, which read the tables with their owner's
    -- rights; every audit_* view migrations have made so far.
    FOR view_name IN
        SELECT viewname FROM pg_views WHERE schemaname = 'public' AND viewname LIKE 'audit\_%'
    LOOP
        EXECUTE format('REVOKE ALL ON %I FROM switchboard_auditor', view_name);
        EXECUTE format('GRANT SELECT ON %I TO switchboard_auditor', view_name);
    END LOOP;

    -- Row-level rules (the header says why). Policies are dropped and
    -- created again, so a run always leaves exactly these.
    ALTER TABLE inbox ENABLE ROW LEVEL SECURITY;
    ALTER TABLE ack_queue ENABLE ROW LEVEL SECURITY;
    DROP POLICY IF EXISTS switchboard_read ON inbox;
    DROP POLICY IF EXISTS switchboard_ingester_insert ON inbox;
    DROP POLICY IF EXISTS switchboard_ingester_update ON inbox;
    DROP POLICY IF EXISTS switchboard_acker_update ON inbox;
    DROP POLICY IF EXISTS switchboard_acker_delete ON inbox;
    DROP POLICY IF EXISTS switchboard_read ON ack_queue;
    DROP POLICY IF EXISTS switchboard_ingester_insert ON ack_queue;
    DROP POLICY IF EXISTS switchboard_ingester_lock ON ack_queue;
    DROP POLICY IF EXISTS switchboard_release ON ack_queue;
    DROP POLICY IF EXISTS switchboard_acker_delete ON ack_queue;

    CREATE POLICY switchboard_read ON inbox FOR SELECT
        TO switchboard_ingester, switchboard_acker USING (true);
    -- ack_xid only ever the storing transaction's own id: an older one
    -- would put the row behind the acker's cursor, its ack never sent.
    CREATE POLICY switchboard_ingester_insert ON inbox FOR INSERT TO switchboard_ingester
        WITH CHECK (ack_state <> 'acked' AND acked_at IS NULL
                    AND (ack_xid IS NULL OR ack_xid = pg_current_xact_id()::text::int8));
    CREATE POLICY switchboard_ingester_update ON inbox FOR UPDATE TO switchboard_ingester
        USING (true) WITH CHECK (ack_state <> 'acked' AND acked_at IS NULL
                                 AND (ack_xid IS NULL OR ack_xid = pg_current_xact_id()::text::int8));
    CREATE POLICY switchboard_acker_update ON inbox FOR UPDATE TO switchboard_acker
        USING (true) WITH CHECK (true);
    CREATE POLICY switchboard_acker_delete ON inbox FOR DELETE TO switchboard_acker USING (true);

    CREATE POLICY switchboard_read ON ack_queue FOR SELECT
        TO switchboard_ingester, switchboard_acker, switchboard_worker USING (true);
    CREATE POLICY switchboard_ingester_insert ON ack_queue FOR INSERT TO switchboard_ingester
        WITH CHECK (true);
    CREATE POLICY switchboard_ingester_lock ON ack_queue FOR UPDATE TO switchboard_ingester
        USING (true) WITH CHECK (false);
    CREATE POLICY switchboard_release ON ack_queue FOR UPDATE TO switchboard_acker, switchboard_worker
        USING (true) WITH CHECK (waiting_for IS NULL);
    CREATE POLICY switchboard_acker_delete ON ack_queue FOR DELETE TO switchboard_acker USING (true);
END
$grants$;
