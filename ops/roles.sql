-- Least-privilege PostgreSQL roles for Switchboard (issues 15 and 32).
--
-- Run it as a superuser (or a role with CREATEROLE that owns the database),
-- connected to Switchboard's database, twice: once before the first
-- `switchboard migrate` (it creates the roles and lets the migrator create
-- the schema; the table grants are skipped with a notice while there are no
-- tables), and again after every `switchboard migrate` (the grants are per
-- table and per column, which ALTER DEFAULT PRIVILEGES cannot express, so a
-- migration's new table or column gets its grants from this run). Every
-- statement is idempotent: run it as often as you like. Run first after a
-- migrate as another user, it hands Switchboard's tables to the migrator.
--
--   psql "postgresql://admin@db/switchboard" -v ON_ERROR_STOP=1 -f ops/roles.sql
--
-- The roles (ops/README.md has the table of what each may do):
--
--   switchboard_migrator  LOGIN: owns the schema; runs `switchboard migrate`.
--   switchboard_ingester  NOLOGIN group: `switchboard ingest` (the pull
--                         adapters).
--   switchboard_receiver  NOLOGIN group: `switchboard receive` (the webhook
--                         receiver): its push adapters' inbox rows (with no
--                         ack target), events and todos, and its heartbeat.
--   switchboard_acker     NOLOGIN group: `switchboard ack` (acks, the rescuer,
--                         the pruner), `switchboard prune`,
--                         `switchboard status` and the read-only commands
--                         (trace, inbox list/show, todos list/show); a member
--                         of the auditor, for the views `status` reads.
--   switchboard_worker    NOLOGIN group: `switchboard worker`.
--   switchboard_operator  NOLOGIN group: the operator's actions (adapters
--                         enable/disable, inbox replay, todos retry/cancel),
--                         from the CLI or the console (`switchboard web`,
--                         whose heartbeat it writes), and the read-only
--                         commands and `status`; a member of the auditor.
--   switchboard_viewer    NOLOGIN group: `switchboard web` read-only, the
--                         console of someone who may look and not act: what
--                         its pages read, and its own heartbeat; no other
--                         write (the console sees it may not act and shows
--                         no action).
--   switchboard_auditor   NOLOGIN group: SELECT on the audit_* views only.
--
-- and one login user per group, switchboard_<group>_login, created without a
-- password: set one from your secret store (\password in psql, or ALTER ROLE
-- ... PASSWORD), or grant the group to login users of your own. The migrator
-- logs in as itself because it must own what it creates: a member's tables
-- would belong to the member.
--
-- Column grants are where the table grant would allow more than the code
-- does. What no grant can say, which rows and which changes of a row, is
-- said by row-level security policies on adapters, inbox, ack_queue, todos,
-- todo_events, events, delivery_attempts and processes. RLS binds every role but the tables'
-- owner: not the migrator, nor the audit views, which run with its rights.
-- In a policy, USING is read on the row as it was (and, for UPDATE, also
-- decides which rows a FOR UPDATE / FOR SHARE lock sees: a row it refuses
-- is skipped, not an error), WITH CHECK on the row as written (refused:
-- SQLSTATE 42501). A change is a pair (status before, status after): where
-- a policy needs the status before, it reads the row in the statement's
-- snapshot (`SELECT ... FROM todos o WHERE o.id = todos.id`), which is the
-- row as it was before the statement, even inside a statement whose CTEs
-- change it (one primary-key probe per row written). A row changed by a
-- commit between the statement's snapshot and its lock is read as it was
-- at the snapshot. Such a change (an operator's retry landing under a
-- worker's end of the same todo, say) is refused once and written again by
-- its caller (the workers' state writer writes again a batch refused for
-- other than its data). A done
-- todo never changes again, so a todo done at the snapshot is done.
--
-- * The ingester writes ack_state and acked_at only to ask for an ack again
--   (store_inbox_native_cte: ack_state back to 'pending', acked_at NULL), or
--   to mark the acks an AMQP adapter sent on its own channel (mark_own_acks,
--   settle_own_acks: ack_kind 'amqp' only, the target unchanged), and
--   'none' only for a row whose ack_kind is 'none'; an ack_xid only its own
--   transaction's id (an older one would put the row behind the acker's
--   cursor); and never a row's ack stream or list (ack_key), which
--   would send its ack to an entry never stored. It locks ack_queue rows (FOR
--   UPDATE in existing_body_pending, lock_pending_copies; a row lock needs
--   UPDATE on one column) and writes none. It deletes only todos,
--   todo_events and events its own transaction inserted (the store's undo,
--   delete_todos and delete_events): `xmin` is the inserting transaction's
--   id, compared with pg_current_xact_id(), so the store must not write them
--   in a subtransaction (SAVEPOINT: a subtransaction has an id of its own);
--   a todo also has its created_at equal to this transaction's now(), since
--   the ingester's dedup (a no-op UPDATE of the active todo) gives an
--   existing todo a new xmin too.
-- * The todos' state changes, by role (backhalf/queries.sql, "The todo
--   lifecycle"): the acker only running -> pending or failed (the rescuer,
--   a lapsed lease); the worker only pending (or an older version's
--   dispatched) -> running (a claim), running -> running (a lease extended)
--   and running -> done, failed or pending (an end, a retry or a claim
--   given back); the operator only
--   pending, dispatched or running -> cancelled and failed or cancelled ->
--   pending (and the no-op update of inbox replay's dedup). Nobody moves a
--   done todo. A todo_events row must be one of its role's pairs, of a todo
--   whose status could make that change; a creation row (NULL -> pending)
--   only for a todo the snapshot does not hold yet (the one its statement
--   creates).
-- * Deletes: the acker (the pruner, backhalf.housekeeping.retention) deletes todos only
--   when terminal and no ack waits for them, their todo_events only when the
--   todo is terminal or gone, inbox rows only with their ack done ('acked' or
--   'none') and no ack_queue row; ack_queue rows only when claimed (owed now).
-- * Acks waiting for a todo (ack_after = "complete") are released (waiting_for
--   to NULL, release_acks, release_orphaned_acks) only when the todo has ended.
-- * The operator's inbox replay makes only a 'rejected' row 'stored', with
--   its todo and event; its event is never `verified`.
-- * processes: each process role inserts and updates only rows of its own
--   `role` (ingest, receive, ack, worker; the operator's and the viewer's
--   web, the console's, whichever of them it runs as); any of them
--   deletes a row stopped or silent for a day
--   (backhalf.housekeeping.heartbeats.FORGET_AFTER_S), and no other.
--
-- Every policy this file makes is named switchboard_*: each run drops every
-- policy of that name on Switchboard's tables and makes them again, so a run
-- leaves exactly these (a policy of your own for a role of your own: give
-- it another name).
--
-- LISTEN/NOTIFY and pg_advisory_lock (migrate's lock) need no grant.


-- The roles, each created once: the migrator, a role per kind of process
-- (the grants below), and a login in each, made after the role it joins.
DO $roles$
DECLARE
    r record;
BEGIN
    FOR r IN
        SELECT name, login, member_of FROM (VALUES
            ('switchboard_migrator', true, NULL),
            ('switchboard_ingester', false, NULL), ('switchboard_receiver', false, NULL),
            ('switchboard_acker', false, NULL), ('switchboard_worker', false, NULL),
            ('switchboard_operator', false, NULL), ('switchboard_viewer', false, NULL),
            ('switchboard_auditor', false, NULL),
            ('switchboard_ingester_login', true, 'switchboard_ingester'),
            ('switchboard_receiver_login', true, 'switchboard_receiver'),
            ('switchboard_acker_login', true, 'switchboard_acker'),
            ('switchboard_worker_login', true, 'switchboard_worker'),
            ('switchboard_operator_login', true, 'switchboard_operator'),
            ('switchboard_viewer_login', true, 'switchboard_viewer'),
            ('switchboard_auditor_login', true, 'switchboard_auditor')
        ) AS roles(name, login, member_of)
        ORDER BY member_of IS NOT NULL
    LOOP
        CONTINUE WHEN EXISTS (SELECT FROM pg_roles WHERE rolname = r.name);
        EXECUTE format('CREATE ROLE %I %s', r.name, CASE WHEN r.login THEN 'LOGIN' ELSE 'NOLOGIN' END)
            || CASE WHEN r.member_of IS NULL THEN '' ELSE format(' IN ROLE %I', r.member_of) END;
    END LOOP;
END
$roles$;

-- The migrator creates the schema in public (PostgreSQL 15 took CREATE on
-- public from PUBLIC); the others only use it. Before 15, PUBLIC could
-- create in public: taken back here (a no-op on 15+).
REVOKE CREATE ON SCHEMA public FROM PUBLIC;
GRANT USAGE, CREATE ON SCHEMA public TO switchboard_migrator;
GRANT USAGE ON SCHEMA public
    TO switchboard_ingester, switchboard_receiver, switchboard_acker, switchboard_worker, switchboard_operator,
       switchboard_viewer, switchboard_auditor;
-- CONNECT (and TEMPORARY) on Switchboard's database are PUBLIC's by default:
-- any login of the cluster could connect and, holding a transaction open,
-- hold back the acker's cursor (backhalf/queries.sql, ack_horizon_cte) and
-- with it every stream ack. Only Switchboard's roles connect here (grant
-- CONNECT to a role of your own that must).
DO $connect$
BEGIN
    EXECUTE format('REVOKE CONNECT, TEMPORARY ON DATABASE %I FROM PUBLIC', current_database());
    EXECUTE format('GRANT CONNECT ON DATABASE %I TO switchboard_migrator, switchboard_ingester,'
                   ' switchboard_receiver, switchboard_acker, switchboard_worker, switchboard_operator,'
                   ' switchboard_viewer, switchboard_auditor', current_database());
END
$connect$;
-- `switchboard status` (the acker's, and the operator's) reads the audit views too.
-- Not the viewer: the console reads the tables (backhalf.reads.console_views), no view.
GRANT switchboard_auditor TO switchboard_acker, switchboard_operator;


-- The grants, per table, for the tables `switchboard migrate` created.
DO $grants$
DECLARE
    view_name name;
    pol record;
    owned record;
    tbl text;
BEGIN
    IF to_regclass('public.inbox') IS NULL THEN
        RAISE NOTICE 'no Switchboard tables yet: roles created; run `switchboard migrate` as'
            ' switchboard_migrator, then this file again for the table grants';
        RETURN;
    END IF;

    -- The order need not be kept: tables a `switchboard migrate` made as
    -- another role (the database's owner, say, before this file was ever
    -- run) are handed to the migrator, which must own what it migrates and
    -- which no policy binds. Switchboard's own tables and audit views only,
    -- by name (never REASSIGN OWNED, which would take every object of that
    -- role); a table's sequences and indexes follow it.
    FOR owned IN
        SELECT c.relname, c.relkind, pg_get_userbyid(c.relowner) AS owner
        FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = 'public' AND c.relkind IN ('r', 'p', 'v')
          AND (c.relname IN ('adapters', 'inbox', 'inbox_keys', 'ack_queue', 'ack_cursors', 'events', 'todos',
                             'todo_events', 'delivery_attempts', 'stream_groups', 'processes',
                             'alembic_version', 'todos_live', 'todos_done', 'todos_done_late')
               -- The history tables' partitions (backhalf.housekeeping.partitions): an
               -- owner's ALTER of a partitioned table does not reach them.
               OR c.relname ~ '^(inbox|events|todo_events|todos_done)_p[0-9]{6}$'
               OR (c.relkind = 'v' AND c.relname LIKE 'audit\_%'))
          AND c.relowner <> 'switchboard_migrator'::regrole
    LOOP
        EXECUTE format('ALTER %s %I OWNER TO switchboard_migrator',
                       CASE owned.relkind WHEN 'v' THEN 'VIEW' ELSE 'TABLE' END, owned.relname);
        RAISE NOTICE 'Switchboard''s % was owned by %: now by switchboard_migrator, which migrates it',
            owned.relname, owned.owner;
    END LOOP;

    -- Start from nothing, so a grant taken out of this file is revoked by its next run.
    REVOKE ALL ON adapters, inbox, inbox_keys, ack_queue, ack_cursors, events, todos, todo_events,
                  delivery_attempts, stream_groups, processes, alembic_version
        FROM switchboard_ingester, switchboard_receiver, switchboard_acker, switchboard_worker,
             switchboard_operator, switchboard_viewer, switchboard_auditor;
    -- The history's partitions are reached through their partitioned tables
    -- only (partition 0 was the table itself before migrations 0015 and
    -- 0017, and kept its grants); todos_live is granted below what the
    -- store writes there.
    FOR owned IN
        SELECT c.relname, c.relkind, '' AS owner FROM pg_class c
        WHERE c.relnamespace = 'public'::regnamespace AND c.relkind IN ('r', 'p')
          AND (c.relname ~ '^(inbox|events|todo_events|todos_done)_p[0-9]{6}$'
               OR c.relname IN ('todos_live', 'todos_done', 'todos_done_late'))
    LOOP
        EXECUTE format('REVOKE ALL ON %I FROM switchboard_ingester, switchboard_receiver, switchboard_acker,'
                       ' switchboard_worker, switchboard_operator, switchboard_viewer, switchboard_auditor',
                       owned.relname);
    END LOOP;
    REVOKE ALL ON ALL SEQUENCES IN SCHEMA public
        FROM switchboard_ingester, switchboard_receiver, switchboard_acker, switchboard_worker,
             switchboard_operator, switchboard_viewer, switchboard_auditor;

    -- Every process role: its heartbeat row (backhalf.housekeeping.heartbeats), and the
    -- rows a day silent it deletes; `status` reads them all. Whose rows: the
    -- policies below. The console (`switchboard web`) is a process too, run
    -- as the operator's login or the viewer's.
    GRANT SELECT, INSERT, DELETE, UPDATE (seen_at, detail, stopped_at) ON processes
        TO switchboard_ingester, switchboard_receiver, switchboard_acker, switchboard_worker,
           switchboard_operator, switchboard_viewer;
    -- Every process reads the migration version at start (not migrated: exit 3).
    GRANT SELECT ON alembic_version
        TO switchboard_ingester, switchboard_receiver, switchboard_acker, switchboard_worker,
           switchboard_operator, switchboard_viewer;

    -- The two storing roles: the ingester (`switchboard ingest`: backhalf.writes.store,
    -- registry, attempts, stream_groups) and the receiver (`switchboard
    -- receive`: backhalf.writes.store with no ack, as ingest.processes.push.push_store
    -- calls it, and registry). One store statement serves both and names the
    -- inbox's ack columns and ack_queue whatever it writes (privileges are
    -- checked per statement, not per row): the same grants, and the policies
    -- below tell them apart (the receiver: its push adapters' rows, with no
    -- ack target and no ack queued).
    -- Registration: its adapters' rows, never the operator's `enabled` flag.
    GRANT SELECT, INSERT (name, family, transport, mode, settings),
          UPDATE (transport, mode, settings, updated_at)
        ON adapters TO switchboard_ingester, switchboard_receiver;
    -- todos_create_cte: insert (with the message's trace context, DESIGN.md
    -- section 14), or the no-op update of a dedup; the store's undo deletes
    -- what it created (delete_todos); store_ack_queue_cte locks with FOR
    -- SHARE, which the updated_at grant covers.
    GRANT SELECT, INSERT (queue, idempotency_key, payload, trace_context), UPDATE (updated_at), DELETE
        ON todos TO switchboard_ingester, switchboard_receiver;
    -- It writes into todos_live, the partition whose unique index is the
    -- dedup's (decision 0007); the id is its default's (todos' sequence),
    -- never one a role chooses.
    GRANT SELECT, INSERT (queue, idempotency_key, payload, trace_context), UPDATE (updated_at)
        ON todos_live TO switchboard_ingester, switchboard_receiver, switchboard_operator;
    GRANT SELECT (id, todo_id), INSERT (todo_id, from_status, to_status, detail), DELETE
        ON todo_events TO switchboard_ingester, switchboard_receiver;
    GRANT SELECT, INSERT (family, adapter, trust_mode, verified, verify_detail, idempotency_key,
                          source_message_id, payload, todo_id), DELETE
        ON events TO switchboard_ingester, switchboard_receiver;
    -- A stream entry's row takes the id its key drew in inbox_keys
    -- (store_keys_cte), so the store names ``id``.
    GRANT SELECT,
          INSERT (id, adapter, idempotency_key, source_message_id, consumer, body, body_size, body_sha256,
                  ack_kind, ack_key, ack_group, ack_entry_id, ack_copies, ack_after, ack_state,
                  deliveries, status, error, todo_id, event_id, ack_xid, source_attributes),
          -- merge_inbox_body, and a redelivery's ON CONFLICT update (ack_state
          -- and acked_at only back to pending: the policies below; ack_xid
          -- for the acker's cursor to meet the row again; ack_entry_id for
          -- the newest delivery's ack ref, a JetStream reply subject).
          UPDATE (ack_copies, deliveries, consumer, ack_key, ack_group, ack_entry_id, ack_state, acked_at,
                  ack_xid)
        ON inbox TO switchboard_ingester, switchboard_receiver;
    GRANT SELECT, INSERT (inbox_id, adapter, ack_kind, ack_key, idempotency_key, waiting_for, by_body)
        ON ack_queue TO switchboard_ingester, switchboard_receiver;
    -- store_keys_cte: a key claimed, or (the no-op update of a stored key)
    -- locked and read. Whose keys: the policies below.
    GRANT SELECT, INSERT (adapter, idempotency_key, inbox_id), UPDATE (inbox_id)
        ON inbox_keys TO switchboard_ingester, switchboard_receiver;
    GRANT USAGE ON SEQUENCE inbox_id_seq, events_id_seq, todos_id_seq, todo_events_id_seq
        TO switchboard_ingester, switchboard_receiver;
    -- The ingester's alone. It queues acks; the UPDATE grant on ack_queue
    -- is for row locks only (policy below).
    GRANT UPDATE (waiting_for) ON ack_queue TO switchboard_ingester;
    GRANT SELECT, INSERT (adapter, idempotency_key, attempts), UPDATE (attempts, last_attempt_at), DELETE
        ON delivery_attempts TO switchboard_ingester;
    GRANT SELECT, INSERT (broker, stream, group_name, adapter, start_id) ON stream_groups
        TO switchboard_ingester;
    -- The receiver's registration checks the table is there (stream_groups.present).
    GRANT SELECT (start_id) ON stream_groups TO switchboard_receiver;

    -- The acker: claim_acks marks acks; the rescuer moves todos whose lease
    -- lapsed (rescue_todos) but creates none; release_orphaned_acks;
    -- the pruner (backhalf.housekeeping.retention) deletes what retention allows; status
    -- reads every table.
    GRANT SELECT ON adapters, events, stream_groups, delivery_attempts TO switchboard_acker;
    -- ack_xid: reset_ack_cursor, after a restore into a new cluster.
    GRANT SELECT, UPDATE (ack_state, acked_at, ack_xid), DELETE ON inbox TO switchboard_acker;
    -- The pruner deletes the keys of the rows it deletes.
    GRANT SELECT, DELETE ON inbox_keys TO switchboard_acker;
    -- cursor_acks makes an adapter's cursor on first use, and moves it.
    GRANT SELECT, INSERT, UPDATE (xid, inbox_id, cluster, moved_at) ON ack_cursors TO switchboard_acker;
    GRANT SELECT, UPDATE (waiting_for), DELETE ON ack_queue TO switchboard_acker;
    GRANT SELECT, UPDATE (status, updated_at, lease_until, run_token, run_after, last_error), DELETE
        ON todos TO switchboard_acker;
    GRANT SELECT, INSERT (todo_id, from_status, to_status, detail), DELETE
        ON todo_events TO switchboard_acker;
    GRANT DELETE ON events, delivery_attempts TO switchboard_acker;
    -- The pruner locks the attempts it deletes (FOR UPDATE SKIP LOCKED), and a
    -- row lock needs UPDATE on one column: the least telling one.
    GRANT UPDATE (last_attempt_at) ON delivery_attempts TO switchboard_acker;
    GRANT USAGE ON SEQUENCE todo_events_id_seq TO switchboard_acker;
    -- The history's partitions (backhalf.housekeeping.partitions): where the identities
    -- stand, and a new period begun (setval). Making and dropping the
    -- partitions is the owner's: `switchboard migrate`.
    GRANT SELECT, UPDATE ON SEQUENCE inbox_id_seq, events_id_seq, todo_events_id_seq, todos_id_seq
        TO switchboard_acker;

    -- The worker: claim_todos, end_runs and extend_leases, and release_acks
    -- for ack_after = "complete"; it reads no inbox row, and writes none.
    GRANT SELECT, UPDATE (status, attempts, lease_until, run_token, run_after, last_error, updated_at)
        ON todos TO switchboard_worker;
    GRANT INSERT (todo_id, from_status, to_status, detail) ON todo_events TO switchboard_worker;
    GRANT SELECT (waiting_for, adapter), UPDATE (waiting_for) ON ack_queue TO switchboard_worker;
    GRANT USAGE ON SEQUENCE todo_events_id_seq TO switchboard_worker;

    -- The operator (ingest.actions): reads every table (trace, inbox and
    -- todos list/show, adapters list, status); flips an adapter's `enabled`
    -- (registry.set_enabled); replays a rejected inbox row (backhalf.writes.replay:
    -- the row locked, a todo created or deduped with its 'pending' log row,
    -- an event, the row made 'stored'); retries and cancels todos
    -- (retry_todos, cancel_todos, then release_acks). No ack, no delete.
    GRANT SELECT ON adapters, inbox, inbox_keys, ack_queue, ack_cursors, events, todos, todo_events,
                    delivery_attempts, stream_groups, processes, alembic_version
        TO switchboard_operator;
    GRANT UPDATE (enabled, updated_at) ON adapters TO switchboard_operator;
    GRANT UPDATE (status, error, todo_id, event_id) ON inbox TO switchboard_operator;
    GRANT INSERT (family, adapter, trust_mode, verified, verify_detail, idempotency_key, source_message_id,
                  payload, todo_id)
        ON events TO switchboard_operator;
    -- (trace_context: the create statement names it; a replay's todo keeps none)
    GRANT INSERT (queue, idempotency_key, payload, trace_context),
          UPDATE (status, attempts, lease_until, run_after, updated_at)
        ON todos TO switchboard_operator;
    GRANT INSERT (todo_id, from_status, to_status, detail) ON todo_events TO switchboard_operator;
    GRANT UPDATE (waiting_for) ON ack_queue TO switchboard_operator;
    GRANT USAGE ON SEQUENCE events_id_seq, todos_id_seq, todo_events_id_seq TO switchboard_operator;

    -- The viewer (`switchboard web` read-only): what the console's pages
    -- read (ingest.web: the overview's figures, trails, the rejected inbox,
    -- todos and their history, processes, charts), and no write but its
    -- heartbeat (above). Not delivery_attempts nor stream_groups, which no
    -- page reads; not the audit views. The console asks has_column_privilege
    -- at start (ingest.web.server.WRITES) and, refused, shows no action.
    GRANT SELECT ON adapters, inbox, inbox_keys, ack_queue, ack_cursors, events, todos, todo_events
        TO switchboard_viewer;

    -- The auditor: the audit views, which read the tables with their owner's
    -- rights; every audit_* view migrations have made so far.
    FOR view_name IN
        SELECT viewname FROM pg_views WHERE schemaname = 'public' AND viewname LIKE 'audit\_%'
    LOOP
        EXECUTE format('REVOKE ALL ON %I FROM switchboard_auditor', view_name);
        EXECUTE format('GRANT SELECT ON %I TO switchboard_auditor', view_name);
    END LOOP;

    -- Row-level rules (the header says why). Every switchboard_* policy is
    -- dropped and made again, so a run always leaves exactly these, whatever
    -- an earlier version of this file made.
    ALTER TABLE adapters ENABLE ROW LEVEL SECURITY;
    ALTER TABLE inbox ENABLE ROW LEVEL SECURITY;
    ALTER TABLE inbox_keys ENABLE ROW LEVEL SECURITY;
    ALTER TABLE ack_queue ENABLE ROW LEVEL SECURITY;
    ALTER TABLE todos ENABLE ROW LEVEL SECURITY;
    ALTER TABLE todos_live ENABLE ROW LEVEL SECURITY;
    ALTER TABLE todo_events ENABLE ROW LEVEL SECURITY;
    ALTER TABLE events ENABLE ROW LEVEL SECURITY;
    ALTER TABLE processes ENABLE ROW LEVEL SECURITY;
    ALTER TABLE delivery_attempts ENABLE ROW LEVEL SECURITY;
    FOR pol IN
        SELECT tablename, policyname FROM pg_policies
        WHERE schemaname = 'public' AND left(policyname, length('switchboard_')) = 'switchboard_'
    LOOP
        EXECUTE format('DROP POLICY %I ON %I', pol.policyname, pol.tablename);
    END LOOP;

    -- adapters: each storing role registers its own family's adapters (the
    -- ingester 'queue', the receiver 'push'), and the rows it may store for
    -- are those (inbox, events and todos below); the operator flips
    -- `enabled` on any.
    CREATE POLICY switchboard_read ON adapters FOR SELECT
        TO switchboard_ingester, switchboard_receiver, switchboard_acker, switchboard_operator,
           switchboard_viewer
        USING (true);
    CREATE POLICY switchboard_ingester_register ON adapters FOR ALL TO switchboard_ingester
        USING (family = 'queue') WITH CHECK (family = 'queue');
    CREATE POLICY switchboard_receiver_register ON adapters FOR ALL TO switchboard_receiver
        USING (family = 'push') WITH CHECK (family = 'push');
    CREATE POLICY switchboard_operator_enable ON adapters FOR UPDATE TO switchboard_operator
        USING (true) WITH CHECK (true);

    -- inbox.
    CREATE POLICY switchboard_read ON inbox FOR SELECT
        TO switchboard_ingester, switchboard_receiver, switchboard_acker, switchboard_operator,
           switchboard_viewer
        USING (true);
    -- The store's rows, of a pull adapter: never acked, 'none' only for what
    -- nothing acks, and ack_xid only the storing transaction's own id.
    CREATE POLICY switchboard_ingester_insert ON inbox FOR INSERT TO switchboard_ingester
        WITH CHECK (ack_state <> 'acked' AND acked_at IS NULL AND (ack_state = 'none') = (ack_kind = 'none')
                    AND (ack_xid IS NULL OR ack_xid = pg_current_xact_id()::text::int8)
                    AND EXISTS (SELECT FROM adapters a WHERE a.name = inbox.adapter AND a.family = 'queue'));
    -- merge_inbox_body and a redelivery (store_inbox_native_cte): the same,
    -- and a row keeps its ack's stream or list (ack_key), pending or not (an
    -- acked row asked for again is pending by the same statement): repointed,
    -- the acker would ack an entry never stored. Its group and its entry's
    -- ref (ack_group, ack_entry_id) change only on a row stored again, which
    -- counts the delivery (``deliveries`` up): a JetStream redelivery's newer
    -- reply subject, the same entry redelivered through a group renamed in
    -- the config. The acker, for its part, acts only on targets its own
    -- config names (the acknowledgers' ``ack_target_refused``), whatever a
    -- row says.
    CREATE POLICY switchboard_ingester_update ON inbox FOR UPDATE TO switchboard_ingester
        USING (true)
        WITH CHECK (ack_state <> 'acked' AND acked_at IS NULL AND (ack_state = 'none') = (ack_kind = 'none')
                    AND (ack_xid IS NULL OR ack_xid = pg_current_xact_id()::text::int8)
                    AND NOT EXISTS (SELECT FROM inbox o
                                    WHERE o.id = inbox.id
                                      AND (o.ack_key IS DISTINCT FROM inbox.ack_key
                                           OR (inbox.deliveries <= o.deliveries
                                               AND (o.ack_group, o.ack_entry_id)
                                                   IS DISTINCT FROM (inbox.ack_group, inbox.ack_entry_id)))));
    -- A consumer-acked transport (AMQP: the ingester acks on the channel that
    -- received the messages, after the commit; mark_own_acks,
    -- settle_own_acks): its pending intents marked acked, their target
    -- unchanged. Only this kind: every other ack is the acker's.
    CREATE POLICY switchboard_ingester_own_acks ON inbox FOR UPDATE TO switchboard_ingester
        USING (ack_kind = 'amqp' AND ack_state = 'pending')
        WITH CHECK (ack_kind = 'amqp' AND ack_state = 'acked' AND acked_at IS NOT NULL AND ack_xid IS NULL
                    AND NOT EXISTS (SELECT FROM inbox o
                                    WHERE o.id = inbox.id
                                      AND (o.ack_key, o.ack_group, o.ack_entry_id)
                                          IS DISTINCT FROM (inbox.ack_key, inbox.ack_group, inbox.ack_entry_id)));
    -- The receiver's rows: a push adapter's, with no ack at all (nothing to
    -- ack: the HTTP answer is the acknowledgement), as first stored or as a
    -- resent delivery's ON CONFLICT update leaves them.
    CREATE POLICY switchboard_receiver_store ON inbox FOR ALL TO switchboard_receiver
        USING (ack_kind = 'none')
        WITH CHECK (ack_kind = 'none' AND ack_state = 'none' AND acked_at IS NULL AND ack_xid IS NULL
                    AND ack_key IS NULL AND ack_group IS NULL AND ack_entry_id IS NULL
                    AND EXISTS (SELECT FROM adapters a WHERE a.name = inbox.adapter AND a.family = 'push'));
    -- claim_acks and mark_cursor_acks mark pending rows acked, with their
    -- time; reset_ack_cursor re-stamps pending ones. Any row: the pruner
    -- locks the acked rows it deletes.
    CREATE POLICY switchboard_acker_update ON inbox FOR UPDATE TO switchboard_acker
        USING (true)
        WITH CHECK ((ack_state = 'acked' AND acked_at IS NOT NULL)
                    OR (ack_state = 'pending' AND acked_at IS NULL));
    -- The pruner: only rows whose ack is done and no longer queued
    -- (backhalf.housekeeping.retention's own condition, ACK_DONE_STATES), and never one
    -- younger than retention's floors (backhalf.housekeeping.retention: an hour; three
    -- days, the senders' retry span, for a push adapter's), whatever the
    -- config says: a resend must still meet the row that dedups it.
    CREATE POLICY switchboard_acker_delete ON inbox FOR DELETE TO switchboard_acker
        USING (ack_state IN ('acked', 'none')
               AND NOT EXISTS (SELECT FROM ack_queue q WHERE q.inbox_id = inbox.id)
               AND stored_at < now() - interval '1 hour'
               AND (stored_at < now() - interval '3 days'
                    OR EXISTS (SELECT FROM adapters a WHERE a.name = inbox.adapter AND a.family = 'queue')));
    -- inbox_keys: each storing role claims its own family's adapters' keys,
    -- and a stored key keeps the row it names (the store's no-op update
    -- rewrites the same id): repointed, a redelivery would count against
    -- another message's row. The pruner deletes the keys of rows it deletes
    -- (rows past the floors: a key whose row is younger is refused).
    CREATE POLICY switchboard_read ON inbox_keys FOR SELECT
        TO switchboard_ingester, switchboard_receiver, switchboard_acker, switchboard_operator,
           switchboard_viewer
        USING (true);
    CREATE POLICY switchboard_ingester_keys ON inbox_keys FOR INSERT TO switchboard_ingester
        WITH CHECK (EXISTS (SELECT FROM adapters a WHERE a.name = inbox_keys.adapter AND a.family = 'queue'));
    CREATE POLICY switchboard_receiver_keys ON inbox_keys FOR INSERT TO switchboard_receiver
        WITH CHECK (EXISTS (SELECT FROM adapters a WHERE a.name = inbox_keys.adapter AND a.family = 'push'));
    CREATE POLICY switchboard_store_keys_kept ON inbox_keys FOR UPDATE
        TO switchboard_ingester, switchboard_receiver
        USING (true)
        WITH CHECK (NOT EXISTS (SELECT FROM inbox_keys o
                                WHERE o.adapter = inbox_keys.adapter
                                  AND o.idempotency_key = inbox_keys.idempotency_key
                                  AND o.inbox_id <> inbox_keys.inbox_id));
    CREATE POLICY switchboard_acker_delete ON inbox_keys FOR DELETE TO switchboard_acker
        USING (NOT EXISTS (SELECT FROM inbox i
                           WHERE i.id = inbox_keys.inbox_id
                             AND (i.ack_state = 'pending'
                                  OR EXISTS (SELECT FROM ack_queue q WHERE q.inbox_id = i.id)
                                  OR i.stored_at >= now() - interval '1 hour'
                                  OR (i.stored_at >= now() - interval '3 days'
                                      AND NOT EXISTS (SELECT FROM adapters a
                                                      WHERE a.name = i.adapter AND a.family = 'queue')))));
    -- Inbox replay: a rejected row becomes 'stored', with its todo and event.
    -- Any row may be locked: replay locks before it reads the status.
    CREATE POLICY switchboard_operator_replay ON inbox FOR UPDATE TO switchboard_operator
        USING (true)
        WITH CHECK (status = 'stored' AND error IS NULL AND todo_id IS NOT NULL AND event_id IS NOT NULL
                    AND EXISTS (SELECT FROM inbox o WHERE o.id = inbox.id AND o.status = 'rejected'));

    -- ack_queue.
    CREATE POLICY switchboard_read ON ack_queue FOR SELECT
        TO switchboard_ingester, switchboard_acker, switchboard_worker, switchboard_operator,
           switchboard_viewer
        USING (true);
    CREATE POLICY switchboard_ingester_insert ON ack_queue FOR INSERT TO switchboard_ingester
        WITH CHECK (true);
    CREATE POLICY switchboard_ingester_lock ON ack_queue FOR UPDATE TO switchboard_ingester
        USING (true) WITH CHECK (false);
    -- The store's statement names ack_queue; a push row queues no ack.
    CREATE POLICY switchboard_receiver_none ON ack_queue FOR INSERT TO switchboard_receiver
        WITH CHECK (false);
    -- release_acks (worker, operator's cancel, rescuer) and
    -- release_orphaned_acks: an ack waiting for a todo that has ended.
    CREATE POLICY switchboard_release ON ack_queue FOR UPDATE
        TO switchboard_acker, switchboard_worker, switchboard_operator
        USING (EXISTS (SELECT FROM todos t
                       WHERE t.id = ack_queue.waiting_for AND t.status IN ('done', 'failed', 'cancelled')))
        WITH CHECK (waiting_for IS NULL);
    -- claim_acks locks and deletes acks owed now, and only those.
    CREATE POLICY switchboard_acker_claim ON ack_queue FOR UPDATE TO switchboard_acker
        USING (waiting_for IS NULL) WITH CHECK (waiting_for IS NULL);
    CREATE POLICY switchboard_acker_delete ON ack_queue FOR DELETE TO switchboard_acker
        USING (waiting_for IS NULL);

    -- todos. An UPDATE policy's USING is true where the role locks rows of
    -- any status (end_runs and extend_leases lock the todos of their runs,
    -- whatever their status now, to answer with it; the pruner locks terminal todos; an
    -- operator's retry and cancel lock before they read): its WITH CHECK
    -- holds it to its pairs.
    CREATE POLICY switchboard_read ON todos FOR SELECT
        TO switchboard_ingester, switchboard_receiver, switchboard_acker, switchboard_worker,
           switchboard_operator, switchboard_viewer
        USING (true);
    -- The store's todos: on the queue of one of the role's own adapters
    -- (registered with its family); inbox replay's, the operator's, on any.
    -- The role registers its adapters itself, so this holds it to the
    -- queues its family's rows name (a change shows in adapters.updated_at),
    -- not against itself. During a rollout that changes an adapter's queue,
    -- an ingester still on the old config has its stores refused (42501,
    -- retried: nothing lost) until it is restarted. One definition for
    -- todos and for todos_live, the partition todos_create_cte writes
    -- directly (decision 0007), whose own policies are the ones that hold.
    FOREACH tbl IN ARRAY ARRAY['todos', 'todos_live'] LOOP
        EXECUTE format('CREATE POLICY switchboard_create ON %I FOR INSERT TO switchboard_operator'
                       ' WITH CHECK (status = ''pending'')', tbl);
        EXECUTE format('CREATE POLICY switchboard_ingester_create ON %I FOR INSERT TO switchboard_ingester'
                       ' WITH CHECK (status = ''pending'' AND EXISTS (SELECT FROM adapters a'
                       ' WHERE a.family = ''queue'' AND a.settings ->> ''queue'' = %I.queue))', tbl, tbl);
        EXECUTE format('CREATE POLICY switchboard_receiver_create ON %I FOR INSERT TO switchboard_receiver'
                       ' WITH CHECK (status = ''pending'' AND EXISTS (SELECT FROM adapters a'
                       ' WHERE a.family = ''push'' AND a.settings ->> ''queue'' = %I.queue))', tbl, tbl);
    END LOOP;
    -- The dedup's no-op update, and store_ack_queue_cte's FOR SHARE: active todos.
    CREATE POLICY switchboard_ingester_update ON todos FOR UPDATE TO switchboard_ingester, switchboard_receiver
        USING (status IN ('pending', 'dispatched', 'running'))
        WITH CHECK (status IN ('pending', 'dispatched', 'running'));
    -- The store's undo: todos this transaction created.
    CREATE POLICY switchboard_ingester_delete ON todos FOR DELETE TO switchboard_ingester, switchboard_receiver
        USING (xmin = pg_current_xact_id()::xid AND created_at = now() AND status = 'pending');
    -- (updated_at now: else a todo moved to failed could carry an old
    -- updated_at past the delete's floor below.)
    CREATE POLICY switchboard_acker_update ON todos FOR UPDATE TO switchboard_acker
        USING (true)
        WITH CHECK (updated_at = now()
                    AND EXISTS (SELECT FROM todos o WHERE o.id = todos.id
                              AND (o.status, todos.status) IN (('running', 'pending'),
                                                               ('running', 'failed'))));
    -- The pruner (backhalf.housekeeping.retention): terminal todos no ack waits for, an
    -- hour ended at least (retention's floor).
    CREATE POLICY switchboard_acker_delete ON todos FOR DELETE TO switchboard_acker
        USING (status IN ('done', 'failed', 'cancelled')
               AND NOT EXISTS (SELECT FROM ack_queue q WHERE q.waiting_for = todos.id)
               AND updated_at < now() - interval '1 hour');
    CREATE POLICY switchboard_worker_update ON todos FOR UPDATE TO switchboard_worker
        USING (true)
        WITH CHECK (EXISTS (SELECT FROM todos o WHERE o.id = todos.id
                              AND (o.status, todos.status) IN (('pending', 'running'),
                                                               ('dispatched', 'running'),
                                                               ('running', 'running'),
                                                               ('running', 'done'),
                                                               ('running', 'failed'),
                                                               ('running', 'pending'))));
    -- Cancel, retry, and inbox replay's dedup (a no-op update of an active todo).
    CREATE POLICY switchboard_operator_update ON todos FOR UPDATE TO switchboard_operator
        USING (true)
        WITH CHECK (EXISTS (SELECT FROM todos o WHERE o.id = todos.id
                              AND (o.status, todos.status) IN (('pending', 'cancelled'),
                                                               ('dispatched', 'cancelled'),
                                                               ('running', 'cancelled'),
                                                               ('failed', 'pending'),
                                                               ('cancelled', 'pending'),
                                                               ('pending', 'pending'),
                                                               ('dispatched', 'dispatched'),
                                                               ('running', 'running'))));

    -- todos_live, written directly by todos_create_cte only (every other
    -- statement reaches it through todos, whose policies above hold): its
    -- rules of creation are todos' (made in the loop above), and the
    -- dedup's no-op update.
    CREATE POLICY switchboard_read ON todos_live FOR SELECT
        TO switchboard_ingester, switchboard_receiver, switchboard_operator
        USING (true);
    CREATE POLICY switchboard_dedup ON todos_live FOR UPDATE
        TO switchboard_ingester, switchboard_receiver, switchboard_operator
        USING (status IN ('pending', 'dispatched', 'running'))
        WITH CHECK (status IN ('pending', 'dispatched', 'running'));

    -- todo_events: each row one of its role's changes, of a todo whose status
    -- (read in the snapshot: before the statement's own change) could make
    -- that change.
    CREATE POLICY switchboard_read ON todo_events FOR SELECT
        TO switchboard_ingester, switchboard_receiver, switchboard_acker, switchboard_operator,
           switchboard_viewer
        USING (true);
    -- todos_create_cte's 'pending' row: of the todo its statement creates,
    -- which the snapshot does not hold yet.
    CREATE POLICY switchboard_created ON todo_events FOR INSERT
        TO switchboard_ingester, switchboard_receiver, switchboard_operator
        WITH CHECK (from_status IS NULL AND to_status = 'pending'
                    AND NOT EXISTS (SELECT FROM todos t WHERE t.id = todo_events.todo_id));
    CREATE POLICY switchboard_acker_insert ON todo_events FOR INSERT TO switchboard_acker
        WITH CHECK ((from_status, to_status) IN (('running', 'pending'), ('running', 'failed'))
                    AND EXISTS (SELECT FROM todos t WHERE t.id = todo_events.todo_id
                                  AND (t.status, todo_events.to_status) IN (('running', 'pending'),
                                                                           ('running', 'failed'))));
    CREATE POLICY switchboard_worker_insert ON todo_events FOR INSERT TO switchboard_worker
        WITH CHECK ((from_status, to_status) IN (('pending', 'running'), ('dispatched', 'running'),
                                                 ('running', 'done'), ('running', 'failed'),
                                                 ('running', 'pending'))
                    AND EXISTS (SELECT FROM todos t WHERE t.id = todo_events.todo_id
                                  AND (t.status, todo_events.to_status) IN (('pending', 'running'),
                                                                           ('dispatched', 'running'),
                                                                           ('running', 'done'),
                                                                           ('running', 'failed'),
                                                                           ('running', 'pending'))));
    CREATE POLICY switchboard_operator_insert ON todo_events FOR INSERT TO switchboard_operator
        WITH CHECK ((from_status, to_status) IN (('pending', 'cancelled'), ('dispatched', 'cancelled'),
                                                 ('running', 'cancelled'), ('failed', 'pending'),
                                                 ('cancelled', 'pending'))
                    AND EXISTS (SELECT FROM todos t WHERE t.id = todo_events.todo_id
                                  AND (t.status, todo_events.to_status) IN (('pending', 'cancelled'),
                                                                           ('dispatched', 'cancelled'),
                                                                           ('running', 'cancelled'),
                                                                           ('failed', 'pending'),
                                                                           ('cancelled', 'pending'))));
    -- The store's undo (delete_todos): the rows this transaction inserted.
    CREATE POLICY switchboard_ingester_delete ON todo_events FOR DELETE
        TO switchboard_ingester, switchboard_receiver
        USING (xmin = pg_current_xact_id()::xid);
    -- The pruner: the history of a todo that is terminal, or gone, an hour
    -- old at least.
    CREATE POLICY switchboard_acker_delete ON todo_events FOR DELETE TO switchboard_acker
        USING (created_at < now() - interval '1 hour'
               AND NOT EXISTS (SELECT FROM todos t
                           WHERE t.id = todo_events.todo_id
                             AND t.status IN ('pending', 'dispatched', 'running')));

    -- events.
    CREATE POLICY switchboard_read ON events FOR SELECT
        TO switchboard_ingester, switchboard_receiver, switchboard_acker, switchboard_operator,
           switchboard_viewer
        USING (true);
    -- A pull event is never verified (a broker vouches for no sender); a
    -- push event is the receiver's, of one of its adapters.
    CREATE POLICY switchboard_ingester_insert ON events FOR INSERT TO switchboard_ingester
        WITH CHECK (family = 'queue' AND trust_mode = 'queue' AND NOT verified
                    AND EXISTS (SELECT FROM adapters a WHERE a.name = events.adapter AND a.family = 'queue'));
    CREATE POLICY switchboard_receiver_insert ON events FOR INSERT TO switchboard_receiver
        WITH CHECK (family = 'push'
                    AND EXISTS (SELECT FROM adapters a WHERE a.name = events.adapter AND a.family = 'push'));
    -- Inbox replay's event is never verified: the operator vouches for nothing.
    CREATE POLICY switchboard_operator_insert ON events FOR INSERT TO switchboard_operator
        WITH CHECK (NOT verified);
    -- The store's undo (delete_events): the rows this transaction inserted.
    CREATE POLICY switchboard_ingester_delete ON events FOR DELETE TO switchboard_ingester, switchboard_receiver
        USING (xmin = pg_current_xact_id()::xid);
    -- The pruner deletes an inbox row's event with it (retention's walk
    -- holds the inbox row and names the link; no index leads from an event
    -- to it, so the policy holds the age): past the inbox's floors.
    CREATE POLICY switchboard_acker_delete ON events FOR DELETE TO switchboard_acker
        USING (received_at < now() - interval '1 hour'
               AND (received_at < now() - interval '3 days'
                    OR EXISTS (SELECT FROM adapters a WHERE a.name = events.adapter AND a.family = 'queue')));

    -- delivery_attempts: the ingester's count of lone attempts; the pruner
    -- locks (a lock needs UPDATE on a column) and deletes those past
    -- retention's floor.
    CREATE POLICY switchboard_read ON delivery_attempts FOR SELECT
        TO switchboard_ingester, switchboard_acker, switchboard_operator USING (true);
    CREATE POLICY switchboard_ingester_attempts ON delivery_attempts FOR ALL TO switchboard_ingester
        USING (true) WITH CHECK (true);
    CREATE POLICY switchboard_acker_lock ON delivery_attempts FOR UPDATE TO switchboard_acker
        USING (last_attempt_at < now() - interval '1 hour') WITH CHECK (false);
    CREATE POLICY switchboard_acker_delete ON delivery_attempts FOR DELETE TO switchboard_acker
        USING (last_attempt_at < now() - interval '1 hour');

    -- processes: each process role its own rows (`role`); the day-silent
    -- clean-up (backhalf.housekeeping.heartbeats.forget_statement, FORGET_AFTER_S) anyone's.
    CREATE POLICY switchboard_read ON processes FOR SELECT
        TO switchboard_ingester, switchboard_receiver, switchboard_acker, switchboard_worker,
           switchboard_operator, switchboard_viewer
        USING (true);
    CREATE POLICY switchboard_ingester_insert ON processes FOR INSERT TO switchboard_ingester
        WITH CHECK (role = 'ingest');
    CREATE POLICY switchboard_ingester_update ON processes FOR UPDATE TO switchboard_ingester
        USING (role = 'ingest') WITH CHECK (role = 'ingest');
    -- `switchboard receive` (role 'receive', migration 0011).
    CREATE POLICY switchboard_receiver_insert ON processes FOR INSERT TO switchboard_receiver
        WITH CHECK (role = 'receive');
    CREATE POLICY switchboard_receiver_update ON processes FOR UPDATE TO switchboard_receiver
        USING (role = 'receive') WITH CHECK (role = 'receive');
    CREATE POLICY switchboard_acker_insert ON processes FOR INSERT TO switchboard_acker
        WITH CHECK (role = 'ack');
    CREATE POLICY switchboard_acker_update ON processes FOR UPDATE TO switchboard_acker
        USING (role = 'ack') WITH CHECK (role = 'ack');
    CREATE POLICY switchboard_worker_insert ON processes FOR INSERT TO switchboard_worker
        WITH CHECK (role = 'worker');
    CREATE POLICY switchboard_worker_update ON processes FOR UPDATE TO switchboard_worker
        USING (role = 'worker') WITH CHECK (role = 'worker');
    -- The console (`switchboard web`, role 'web', migration 0012), as the
    -- operator's login (its actions) or the viewer's (read-only).
    CREATE POLICY switchboard_web_insert ON processes FOR INSERT TO switchboard_operator, switchboard_viewer
        WITH CHECK (role = 'web');
    CREATE POLICY switchboard_web_update ON processes FOR UPDATE TO switchboard_operator, switchboard_viewer
        USING (role = 'web') WITH CHECK (role = 'web');
    CREATE POLICY switchboard_forget ON processes FOR DELETE
        TO switchboard_ingester, switchboard_receiver, switchboard_acker, switchboard_worker,
           switchboard_operator, switchboard_viewer
        USING (stopped_at < now() - interval '1 day' OR seen_at < now() - interval '1 day');
END
$grants$;
