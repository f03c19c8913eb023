-- All SQL of the back half's hot paths, as static text with bound parameters.
--
-- These run on the psycopg connection under SQLAlchemy's transaction, because
-- set-based ``unnest`` inserts with binary array parameters (``%(name)b``) are
-- several times cheaper than SQLAlchemy ``executemany`` (issue 5). Table
-- definitions, migrations and the cooler queries stay in SQLAlchemy Core.
-- No statement here is ever built from runtime values.
--
-- Each block starts with ``-- name: <name>``; the comment lines under it say
-- why the statement is shaped as it is. Comment lines are not sent to the
-- server. A block whose name ends in ``_cte`` is one or more complete CTEs
-- (``name AS (...)``), never a fragment of one; ``backhalf/queries.py``
-- composes those, at CTE boundaries only, into the statements named there, and
-- ``tests/unit/backhalf/snapshots/`` holds each composed statement as the server gets
-- it. Every other block is a whole statement or a composed statement's final
-- part.


-- name: existing_native
-- Which stream entries (native ids) the inbox holds already: they are stored
-- once per adapter while inbox rows are kept. A batch of first deliveries
-- skips this read (see ``backhalf.writes.store``).
--
-- One index probe per key, whatever the statistics say: the LATERAL subquery
-- (LIMIT keeps it from being flattened into a join) can only run as a nested
-- loop with the key as its index condition. The plain form, ``idempotency_key
-- = ANY(...)``, was planned on a table not analyzed yet (a new database
-- draining a backlog: autoanalyze waits at least ``autovacuum_naptime``) as a
-- bitmap scan of every entry of the adapter in the keys' index plus a
-- recheck of every heap page, a cost that grows with the table
-- (docs/architecture.md, "Plans that do not depend on statistics").
SELECT u.k FROM unnest(%(keys)b::text[]) AS u(k)
CROSS JOIN LATERAL (
    SELECT 1 FROM inbox_keys
    WHERE adapter = %(adapter)s AND idempotency_key = u.k
    LIMIT 1
) AS found


-- name: existing_body_pending
-- List copies: the pending row of each (key, processing list), to merge into.
--
-- Locked, not just read: a pending row the acker is marking acked right now
-- must be waited for (and then no longer counts), or the new copy would be
-- taken as merged into a row that is about to stop being pending, and be
-- stored without its todo.
--
-- Pending means queued (``ack_queue``); both rows are locked, so a queue row
-- the acker deletes meanwhile drops out of the result once it commits.
--
-- One probe per key on ``uq_ack_queue_body``, as above: a subquery with FOR
-- UPDATE is never flattened, so it runs once per key. The plain form was
-- planned, without statistics, as a scan of every entry of the adapter in the
-- index, where acked rows leave theirs until VACUUM. Rows are locked in the
-- order of ``keys``, which the store sorts, the order its inbox writes then
-- take them in.
SELECT p.idempotency_key, p.ack_key, p.id FROM unnest(%(keys)b::text[]) AS u(k)
CROSS JOIN LATERAL (
    SELECT i.idempotency_key, i.ack_key, i.id FROM ack_queue q JOIN inbox i ON i.id = q.inbox_id
    WHERE q.adapter = %(adapter)s AND q.idempotency_key = u.k AND q.by_body
      AND q.ack_key = ANY(%(ack_keys)b::text[])
    FOR UPDATE
) AS p


-- name: merge_inbox_body
-- A copy of a body already pending on the same processing list merges into
-- that row (locked by existing_body_pending): ``ack_copies`` counts the copies
-- the acker must remove.
UPDATE inbox SET ack_copies = inbox.ack_copies + u.c,
                 deliveries = inbox.deliveries + u.d,
                 consumer = %(consumer)s
FROM unnest(%(ids)b::int8[], %(copies)b::int4[], %(deliveries)b::int4[]) AS u(id, c, d)
WHERE inbox.id = u.id


-- The store's write (store_native, store_body): todos, their 'created' log
-- rows, events, inbox rows and the acker's queue, in one statement, so each
-- array (keys, ids, payloads) is sent and dumped once (dumping arrays is a
-- large share of the ingester's CPU) and the batch costs one round trip, not
-- three. Every row is written once, already linked: todos first, events
-- carrying their todo, inbox rows carrying both. Writing the inbox first and
-- linking it afterwards cost a second, non-HOT write of every inbox row.
--
-- Lock order: both inserts that can wait on another transaction (todos,
-- inbox) sort by the batch's key order (ORDER BY u.n), and the sort under the
-- inbox insert reads all its input first, so every store locks all its todos
-- in key order, then all its inbox rows in key order: two stores cannot
-- deadlock. The CTEs below are composed in this order.

-- name: store_rows_cte
-- ``u`` holds the rows to write, in the order of ``keys`` (sorted by the
-- store, so concurrent stores take row locks in one order); ``payload`` is
-- NULL for a message that gets no todo and no event (rejected, or already in
-- the inbox). Keys are unique within a batch, so every join is one to one.
--
-- A column that holds the same value for every message of the batch (the
-- common case: every copy count and delivery 1, no error, the batch's ack
-- key, each entry acked by its own id) is sent as a NULL array, which unnest
-- pads with NULLs, and its value is filled in where the row is written
-- (``coalesce``, ``entry_is_id``): no array is dumped, sent and parsed for
-- it. Measured: 1.5 us of the server's CPU per message (scripts/store_probe.py).
u AS (
    SELECT * FROM unnest(%(keys)b::text[], %(ids)b::text[], %(bodies)b::bytea[], %(payloads)b::text[],
                         %(ack_keys)b::text[], %(entry_ids)b::text[], %(copies)b::int4[],
                         %(deliveries)b::int4[], %(errors)b::text[], %(sizes)b::int8[],
                         %(digests)b::bytea[], %(attributes)b::text[], %(trace_contexts)b::text[])
        WITH ORDINALITY AS u(k, m, b, p, ak, e, c, d, err, bs, bh, sa, tc, n)
)


-- name: todos_create_cte
-- Create or dedup a todo: the one definition, owned by ``backhalf.lifecycle.todos``
-- (the store's write embeds it; so does create_todo, for inbox replay).
-- Reads ``u(k, p, tc, n)``: key, payload JSON text (NULL: no todo), trace
-- context JSON text (NULL: none; a dedup keeps the first's), order. Yields
-- ``t(id, idempotency_key, created)``: the new todo, or on a dedup the active
-- one with the same (queue, key). A created todo gets its 'pending' log row,
-- with ``todo_detail`` saying who created it, in the same statement.
--
-- Written to ``todos_live``, the partition of ``todos`` that holds every todo
-- not finished, whose own unique index is the dedup's (a partitioned
-- table's could not be: decision 0007). A partition has no identity of its
-- own: its id's default draws from ``todos``'s sequence (migration 0017). The
-- conflict target's WHERE must be the partial index's predicate exactly
-- (schema.tables.TODO_ACTIVE_PREDICATE), or PostgreSQL will not infer it. The
-- no-op DO UPDATE makes RETURNING yield the existing todo on a dedup.
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


-- name: store_events_cte
-- One event per todo written, linked to it. Family and trust metadata are
-- the batch's (``backhalf.records.Provenance``), bound, so the same statement
-- serves any family.
ev AS (
    INSERT INTO events (family, adapter, trust_mode, verified, verify_detail,
                        idempotency_key, source_message_id, payload, todo_id)
    SELECT %(family)s, %(adapter)s, %(trust_mode)s, %(verified)s, %(verify_detail)s,
           u.k, u.m, u.p::jsonb, t.id
    FROM u JOIN t ON t.idempotency_key = u.k
    RETURNING id, idempotency_key, todo_id
)


-- name: store_keys_cte
-- Stream entries (native ids) are stored once per adapter while their inbox
-- rows are kept; ``inbox_keys`` holds their keys (the inbox is partitioned,
-- and a unique index there could not span its partitions: decision 0005).
-- Each key of the batch is claimed here, in key order (u is sorted): a new
-- key with the id its inbox row will take (``fresh``), a stored one with its
-- row's id, locked. Two stores of one key meet on the key's row: the second
-- waits for the first to commit and then finds it (the no-op update returns
-- it). ``xmax = 0`` is true exactly for rows this statement inserted. An id
-- drawn for a key that was stored already is never used: ids are not dense.
-- The sequence is looked up once (a subquery), not per row: 2.6 us a row.
keyed AS (
    INSERT INTO inbox_keys AS k (adapter, idempotency_key, inbox_id)
    SELECT %(adapter)s, u.k, nextval((SELECT pg_get_serial_sequence('inbox', 'id')::regclass)) FROM u ORDER BY u.n
    ON CONFLICT (adapter, idempotency_key) DO UPDATE SET inbox_id = k.inbox_id
    RETURNING k.idempotency_key, k.inbox_id, (k.xmax = 0) AS fresh
)


-- name: known_keys_cte
-- The stored keys of the batch, for ``redeliver_native``: the keys of rows
-- committed by another store after the write's snapshot was taken.
keyed AS (
    SELECT k.idempotency_key, k.inbox_id, false AS fresh FROM inbox_keys k
    WHERE k.adapter = %(adapter)s AND k.idempotency_key = ANY(%(keys)b::text[])
)


-- name: store_inbox_native_cte
-- A new key's row is inserted under the id its key took. A stored key's row
-- is a redelivery: it bumps ``deliveries`` and asks the acker again (an ack is
-- idempotent; the entry may be pending again after its group was recreated).
--
-- Only a redelivery: the same entry id with the same message (compared by
-- the whole message's sha256, kept for a prefix and computed for a whole
-- body, so a message stored whole under one max_message_bytes and as a
-- prefix under another is still one message), or a report that the entry is
-- gone (its body is lost, so nothing can differ). A different message on a stored id
-- (a broker restored from an older snapshot, a stream deleted and refilled with
-- explicit ids) is not updated and so not returned: the store stores it
-- again under a derived key (backhalf.writes.store, "reused ids"), except where the
-- id alone names the message (``id_names_message``: a webhook's signed
-- delivery id, whose resend may carry its body serialized anew; not
-- GitHub's, which is outside the signature). The comparison
-- reads the stored body only for a stored key, which first deliveries do not
-- have. A row another store committed after this statement began is not
-- seen by this statement's update (nor returned): the store asks again
-- (``redeliver_native``) before it takes a key for reused.
--
-- ``ack_xid`` (``by_cursor``: stream entries acked on store): the storing
-- transaction's id, by which the acker finds the row (cursor_acks); a
-- redelivery asking for its ack again takes this transaction's, so the
-- cursor, which has passed the old one, meets the row again. It also takes
-- the newest delivery's ack ref: a JetStream reply subject names one
-- delivery, and the newest is the one sure to ack (a stream entry id is the
-- same in every delivery).
--
-- The same insert as store_inbox_body_cte plus the id its key took
-- (tests/unit/test_queries.py holds them to that).
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
)


-- name: store_again_cte
-- The redeliveries of stored keys (see store_inbox_native_cte), each row
-- reached by its id through the primary key (``= ANY(ARRAY(...))``: index
-- probes whatever the statistics say; joined plainly, a new database's
-- inbox, small when analyzed, was read whole by every store as it grew),
-- none at all for a batch of first deliveries. The row must hold the key
-- that named it: a key pointing elsewhere (forged, or left behind) never
-- moves another message's ack.
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
)


-- name: store_written_native_cte
-- The rows written, as the acker's queue and the result read them.
written AS (
    SELECT * FROM fresh UNION ALL SELECT * FROM again
)


-- name: store_written_again_cte
-- redeliver_native's rows written: the redeliveries only.
written AS (
    SELECT * FROM again
)


-- name: store_inbox_body_cte
-- List items and pub/sub messages (no native id) with no pending row to
-- merge into. Two stores racing to queue the same body on the same
-- processing list (which only its owner and, once it is dead, one recoverer
-- write to) meet on ``uq_ack_queue_body``: the loser fails and is
-- redelivered, and then merges. Pub/sub rows (ack_state 'none') are not
-- queued; the todo index dedups them.
written AS (
    INSERT INTO inbox (adapter, idempotency_key, source_message_id, consumer, body, body_size, body_sha256,
                       ack_kind, ack_key, ack_group, ack_entry_id, ack_copies, ack_after,
                       ack_state, deliveries, status, error, todo_id, event_id, ack_xid, source_attributes)
    SELECT %(adapter)s, u.k, u.m, %(consumer)s, u.b, u.bs, u.bh,
           %(ack_kind)s, coalesce(u.ak, %(ack_key)s), %(ack_group)s,
           CASE WHEN %(entry_is_id)s THEN u.m ELSE u.e END, coalesce(u.c, 1), %(ack_after)s,
           %(ack_state)s, coalesce(u.d, 1), CASE WHEN u.err IS NULL THEN 'stored' ELSE 'rejected' END, u.err,
           ev.todo_id, ev.id, CASE WHEN %(by_cursor)s THEN (SELECT pg_current_xact_id()::text::int8) END,
           u.sa::jsonb
    FROM u LEFT JOIN ev ON ev.idempotency_key = u.k
    ORDER BY u.n
    RETURNING id, adapter, idempotency_key, ack_kind, ack_key, ack_state, ack_after, todo_id,
              (xmax = 0) AS inserted
)


-- name: store_ack_queue_cte
-- Every row left pending is queued for the acker in the same statement,
-- unless the acker finds it by its ``ack_xid`` (``by_cursor``: stream
-- entries acked on store, the common case, with no queue row to insert and
-- delete):
-- owed now (``waiting_for`` NULL), or, with ack_after 'complete', waiting for
-- its todo, which the transaction that ends the todo releases
-- (release_acks). A rejected row has no todo: its ack is owed now.
--
-- No release can be missed. A row inserted here waits for the todo this
-- statement created or deduped to, which it holds locked (todos_create_cte's
-- insert or no-op update), so the todo's end waits for this commit, and its
-- release (a statement of its own, with a snapshot taken after that wait)
-- sees the row. A redelivered row waits for its old todo only if that todo
-- is still active, read with FOR SHARE: the latest committed version, locked
-- the same way; a todo that ended meanwhile leaves the ack owed now. In id
-- order, as the workers' writer takes its rows, though it never waits for
-- a row a store holds (write_states).
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


-- name: store_result
-- The store's final SELECT, after its CTEs: one row per message written,
-- whether its inbox row was inserted (NULL: neither inserted nor updated, a
-- reused id), and the event and todo this statement wrote for it, which the
-- store deletes again if the row was stored already.
SELECT u.k, w.inserted, ev.id, ev.todo_id, t.created
FROM u
LEFT JOIN written w ON w.idempotency_key = u.k
LEFT JOIN ev ON ev.idempotency_key = u.k
LEFT JOIN t ON t.idempotency_key = u.k


-- name: redeliver_result
-- The keys whose stored row was found at last and counted as a redelivery.
SELECT idempotency_key FROM written


-- name: delete_events
-- Events of messages already stored (our inbox insert conflicted: a
-- concurrent store won, or a recreated group delivered them again): the
-- stored row's event is the record; ours would be a second history row.
DELETE FROM events WHERE id = ANY(%(ids)b::int8[]) AND id BETWEEN %(low_id)s AND %(high_id)s


-- name: delete_todos
-- Todos this store created for such messages: the stored message's todo had
-- finished (or it never had one: a rejected row), so the upsert made a new
-- one. Its log rows go with it. Still pending (this transaction made
-- them), so only ``todos_live`` is read.
WITH gone AS (DELETE FROM todo_events WHERE todo_id = ANY(%(ids)b::int8[]))
DELETE FROM todos WHERE id = ANY(%(ids)b::int8[]) AND status = 'pending'


-- name: notify_store
-- Delivered only when the store's transaction commits: the acker's LISTEN
-- when acks are owed, the workers' when todos were created (their claim
-- reads the committed rows). One round trip for both; a branch whose flag
-- is false sends nothing.
SELECT CASE WHEN %(acks)s THEN pg_notify(%(ack_channel)s, %(adapter)s) END,
       CASE WHEN %(todos)s THEN pg_notify(%(todo_channel)s, %(queue)s) END


-- name: replay_row_cte
-- Inbox replay's one row, shaped as the store's ``u`` for todos_create_cte.
-- A replay makes a new todo of the stored message: the trace context it
-- came with was its first todo's, not the inbox row's; none is kept.
u AS (SELECT %(key)s::text AS k, %(payload)s::text AS p, NULL::text AS tc, 1 AS n)


-- name: create_todo_result
-- create_todo's final SELECT: the todo created, or deduped to.
SELECT id FROM t


-- name: record_attempts
-- Attempts at messages not stored yet, each committed before the attempt.
INSERT INTO delivery_attempts (adapter, idempotency_key, attempts)
SELECT %(adapter)s, u.k, 1 FROM unnest(%(keys)b::text[]) AS u(k)
ON CONFLICT (adapter, idempotency_key)
DO UPDATE SET attempts = delivery_attempts.attempts + 1, last_attempt_at = now()
RETURNING idempotency_key, attempts


-- name: known_attempts
SELECT idempotency_key FROM delivery_attempts
WHERE adapter = %(adapter)s AND idempotency_key = ANY(%(keys)b::text[])


-- name: clear_attempts
DELETE FROM delivery_attempts WHERE adapter = %(adapter)s AND idempotency_key = ANY(%(keys)b::text[])


-- name: claim_plan
-- Run before cursor_acks and claim_acks, in the claim's own transaction only
-- (``true``: local to it), in one round trip; it takes no transaction id, so
-- cursor_acks's snapshot is still the transaction's first that counts:
-- plan the claim on the queue's primary key in id order, whatever the statistics, so the scan stops after ``limit`` rows.
-- Without statistics (a new database draining a backlog) PostgreSQL took the
-- queue for a few hundred rows and chose a bitmap scan, or a sequential scan,
-- joined every row to inbox and sorted them all. Deleted rows stay in the
-- heap and the index until VACUUM, so either plan re-read every row deleted
-- so far on every claim, and with a backlog queued every pending row too. An
-- index scan marks deleted entries dead in the index the first time (LP_DEAD)
-- and skips them after that.
SELECT set_config('enable_seqscan', 'off', true), set_config('enable_bitmapscan', 'off', true)


-- name: claim_acks
-- The acker's claim, which is also its mark: committed intents only
-- (uncommitted rows are invisible), locked (SKIP LOCKED) so concurrent ackers
-- split the work instead of sharing a cursor, and set to 'acked' in the same
-- statement, so each row is written once. The acker commits only after the
-- broker ack succeeded; a failure or a crash rolls the rows back to pending.
--
-- The queue rows are deleted and the inbox rows marked acked in one
-- statement; no index covers ack_state or acked_at, so the mark is a HOT
-- update (inbox leaves room on each page for it). Both rows are locked up
-- front, queue row first as everywhere else, and skipped if either is taken:
-- a store re-requesting the ack of a redelivered entry holds the inbox row
-- while it queues it again, and waiting for it here while it waits for our
-- queue row would be a deadlock; so would two redelivered rows the store and
-- the acker lock in opposite orders (key order against id order). The join
-- that takes the inbox lock costs a little per row claimed; it stays, since
-- dropping it would turn those rare waits into deadlocks. ``acked_at`` is
-- this statement's time, not the transaction's start (the claim plan's
-- statement before it): the audit's ack latency, and the proof in the
-- tests that no ack with ack_after 'complete' came before its todo's end.
WITH picked AS (
    SELECT q.inbox_id FROM ack_queue q JOIN inbox i ON i.id = q.inbox_id
    WHERE q.adapter = ANY(%(adapters)s::text[]) AND q.waiting_for IS NULL
    ORDER BY q.inbox_id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), claimed AS (
    DELETE FROM ack_queue WHERE inbox_id IN (SELECT inbox_id FROM picked)
    RETURNING inbox_id, by_body
)
UPDATE inbox SET ack_state = 'acked', acked_at = statement_timestamp()
FROM claimed WHERE inbox.id = claimed.inbox_id
RETURNING id, adapter, ack_kind, ack_key, ack_group, ack_entry_id, ack_copies,
          CASE WHEN claimed.by_body THEN body END AS body


-- name: ack_writers_cte
-- The roles whose sessions may write what the ack cursor reads (issue 43):
-- an inbox row's ``ack_xid`` (INSERT or UPDATE of that column, table-wide
-- grants and pg_write_all_data included), the inbox's owner and every role
-- that may act as it (the owner can grant itself anything, even after
-- revoking its own rights), superusers, and CREATEROLE roles (before
-- PostgreSQL 16 they may grant themselves any role, a writer's too). A
-- session may write if its login is a member of one of these in any way:
-- ``pg_has_role(..., 'MEMBER')`` is true for a NOINHERIT membership too,
-- through which the session can ``SET ROLE`` to the writer mid-transaction,
-- and for a superuser always. pg_roles, not pg_authid: every role may read
-- it. Materialized, and read only for a session of this database that holds
-- an id and whose login has no such right of its own (a worker's, an
-- operator's, a stranger's), so most looks never compute it.
writers AS MATERIALIZED (
    SELECT r.oid FROM pg_roles AS r
    WHERE r.rolsuper OR r.rolcreaterole
       OR pg_has_role(r.oid, (SELECT c.relowner FROM pg_class AS c WHERE c.oid = 'inbox'::regclass), 'MEMBER')
       OR has_column_privilege(r.oid, 'inbox'::regclass, 'ack_xid', 'INSERT, UPDATE')
)


-- name: ack_horizon_cte
-- Where the ack cursor may walk to (``h.xmin``): below the oldest transaction
-- still running that may write this database's rows, as of this statement's
-- snapshot. Every transaction below it has ended, so a row stored later has
-- a larger ack_xid and can never land behind the cursor. Transaction ids are
-- the cluster's, so the snapshot's own xmin is held back by any transaction
-- of the cluster; two kinds that pg_stat_activity shows cannot write a row
-- the cursor reads and are passed over (datid, usesysid and backend_xid are
-- shown for every session, whatever the role): one in another database, and
-- one of this database whose login is no writer (ack_writers_cte: a
-- worker's, an operator's, a login with no grant at all that merely holds a
-- transaction open, issue 43). Any other (a writer's, a prepared
-- transaction, one that ended after the snapshot, one not shown, one whose
-- login pg_stat_activity does not name) bounds the walk, as the snapshot's
-- xmin does: the test is ``IS FALSE``, so a NULL bounds. Rights are judged
-- as they are now, not as they were when the transaction began: a writer
-- whose role is granted to a session mid-transaction (or revoked from one
-- that has written) can leave rows behind the cursor, which the claim sweep
-- then redelivers and acks (docs/architecture.md, "The horizon"). A
-- SECURITY DEFINER function of a writer's that another role may call would
-- make that role a writer too: Switchboard makes none. ``running``: the
-- transactions that bound, for the peek's ``held``. The comparison is of
-- the ids' low 32 bits (backend_xid is an xid): ids running at once are less
-- than 2^31 apart. The writer check short-circuits on the login's own right,
-- so Switchboard's ingesters and ackers never read ``writers``.
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
)


-- name: cursor_peek_cte
-- Before cursor_acks, unlocked: is there anything for the cursor to do? A
-- claim that locks the cursor row takes a transaction id, and its commit a
-- WAL flush, so an acker looking every few milliseconds for acks held back
-- must not lock when nothing is owed. ``work``: no cursor yet, a cursor
-- from another cluster or ahead of this snapshot's xmax (a restore), or an
-- owed row below the xmin. ``held``: a transaction at or above the xmin has
-- ended (the snapshot's range holds more ids than are still running), so
-- rows may be owed that no claim can take yet; the acker looks again soon.
-- Both are read from one snapshot, so the cursor read is never newer than
-- the snapshot it is compared with.
c AS (
    SELECT xid, inbox_id, cluster FROM ack_cursors WHERE adapter = %(adapter)s
)


-- name: cursor_peek
-- The peek's answer (cursor_peek_cte above says what it asks).
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


-- name: cursor_acks_cte
-- The acker's other claim (docs/architecture.md, "The ack cursor"): an
-- adapter's stream entries whose ack is owed now, found by ``ack_xid``, the
-- id of the transaction that stored them, from where the adapter's cursor
-- stands. Only rows of transactions below this snapshot's xmin are read:
-- every one of those has ended, so a row that commits later has a larger
-- ack_xid and can never land behind the cursor, however late it commits.
-- The cost: a long transaction anywhere in the database holds the acks of
-- every row stored after it back until it ends (their age shows in
-- switchboard_oldest_unacked_age_seconds; the claim sweep finds them owed,
-- and leaves them).
--
-- Run before the transaction has an id of its own (only claim_plan and
-- cursor_peek before it), which would hold its own snapshot's xmin back.
-- The cursor row is made on first use, stamped with the cluster's system
-- identifier, and locked (SKIP LOCKED: a second acker of the adapter leaves
-- the cursor to the first, and claims only from the queue, getting no row
-- here). Otherwise the answer starts with the cursor's position, the
-- snapshot's xmin, and whether the cursor must be reset (reset_ack_cursor):
-- made by another cluster, or ahead of this transaction's own id, which
-- the lock has just assigned and which is above every id of a transaction
-- that wrote the cursor's newest version (FOR UPDATE returns the newest
-- version, which can be newer than the snapshot, so the snapshot's xmin
-- would not do). Then the rows claimed (none: one row of NULLs); the mark
-- (mark_cursor_acks) moves the cursor after the ack.
--
-- The walk runs once, on ix_inbox_ack_cursor from the cursor onwards, in
-- its order, and stops at the limit. Behind the cursor the index holds the
-- adapter's acked rows, which the walk never reads.
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


-- name: cursor_acks
-- The claim's answer (cursor_acks_cte above says what it takes).
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


-- name: ack_horizon_holder
-- ``switchboard status`` (backhalf.reads.audit.ack_horizon_holder): the oldest
-- transaction holding the ack cursor's horizon back, by the horizon's own
-- rule (ack_horizon_cte): a session of this database with an id whose
-- login may write (``IS NOT FALSE``: one pg_stat_activity names no login
-- for bounds too), or a prepared transaction of any database, which no
-- session shows.
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


-- name: reset_ack_cursor
-- A cursor made by another cluster, or ahead of this cluster's ids: the
-- database was restored into a new cluster (pg_dump), which counts ids from
-- low again. Rows stamped by the old cluster would wait until its ids catch
-- up, and rows stamped by the new one may lie behind the cursor. So every
-- pending row of the adapter takes this transaction's id, and the cursor
-- moves to this snapshot's xmin, below that id: every owed row is found
-- again, and no walk from the start re-reads the acked history. Rare; one
-- walk of the adapter's rows in ix_inbox_ack_cursor.
WITH restamped AS (
    UPDATE inbox SET ack_xid = pg_current_xact_id()::text::int8
    WHERE adapter = %(adapter)s AND ack_xid IS NOT NULL AND ack_state = 'pending'
    RETURNING id
), reset AS (
    UPDATE ack_cursors
    SET xid = pg_snapshot_xmin(pg_current_snapshot())::text::int8, inbox_id = 0, moved_at = now(),
        cluster = (SELECT system_identifier::text FROM pg_control_system())
    WHERE adapter = %(adapter)s
)
SELECT count(*) FROM restamped


-- name: mark_cursor_acks
-- (``low_id``, ``high_id``: the ids' bounds, by which only the partitions
-- between them are read, not every one: backhalf.housekeeping.partitions.id_bounds.)
-- After the ack, in the claim's transaction: the rows claimed by the
-- cursor marked acked, and the cursor moved past them. A row asked for its
-- ack again by a store since the claim read it has an ack_xid at or above
-- the claim's xmin (its transaction had not ended when the claim's
-- snapshot was taken), so it is left pending: the cursor meets it again.
-- The mark waits for a row a store holds, and then checks it again on its
-- newest version. ``acked_at`` is this statement's time, after the ack.
WITH marked AS (
    UPDATE inbox SET ack_state = 'acked', acked_at = statement_timestamp()
    WHERE id = ANY(%(ids)b::int8[]) AND id BETWEEN %(low_id)s AND %(high_id)s
      AND ack_xid < %(xmin)s AND ack_state = 'pending'
    RETURNING id
)
UPDATE ack_cursors SET xid = %(to_xid)s, inbox_id = %(to_id)s, moved_at = now()
WHERE adapter = %(adapter)s
RETURNING (SELECT count(*) FROM marked)


-- name: mark_own_acks
-- A consumer-acked transport (AMQP: the ingester acks on the channel that
-- received the messages, after the commit): the intents it just acked,
-- named by their refs (a channel session and a delivery tag: unique), marked
-- acked. ``ack_xid`` is cleared too: no acker cursor walks these rows, and
-- so ``ix_inbox_ack_cursor`` holds only this adapter's intents still
-- pending, the small set this statement and settle_own_acks search. A row
-- redelivered meanwhile on another channel took that delivery's ref and is
-- not marked here: that delivery's own ack marks it.
UPDATE inbox SET ack_state = 'acked', acked_at = statement_timestamp(), ack_xid = NULL
WHERE adapter = %(adapter)s AND ack_xid IS NOT NULL AND ack_state = 'pending'
  AND ack_entry_id = ANY(%(refs)b::text[])


-- name: settle_own_acks
-- A consumer-acked transport's channel just opened: the intents its
-- consumer left pending on earlier channels are settled. Each such channel
-- has ended (the process restarted, or its connection was lost), and a
-- channel's end settles its deliveries at the broker: acked, or requeued
-- (then delivered again, stored again, which points the row at the new
-- delivery, and acked). Nothing is owed on them any more; left pending they
-- would be pending forever (an ack sent just before a crash, never marked).
UPDATE inbox SET ack_state = 'acked', acked_at = statement_timestamp(), ack_xid = NULL
WHERE adapter = %(adapter)s AND ack_xid IS NOT NULL AND ack_state = 'pending'
  AND consumer = %(consumer)s AND NOT starts_with(coalesce(ack_entry_id, ''), %(session)s)


-- name: owed_native
-- The claim sweep's question (stream mode): which of these entries are
-- stored with their ack pending (owed now, through the cursor or the queue,
-- or waiting for their todo)? Those need no redelivery, only their ack,
-- which the acker sends; claiming them again would re-store each one every
-- sweep while its todo runs. One probe per key, as in existing_native.
SELECT u.k FROM unnest(%(keys)b::text[]) AS u(k)
CROSS JOIN LATERAL (
    SELECT 1 FROM inbox_keys k JOIN inbox i ON i.id = k.inbox_id
    WHERE k.adapter = %(adapter)s AND k.idempotency_key = u.k AND i.ack_state = 'pending'
    LIMIT 1
) AS found


-- name: lock_pending_copies
-- List recovery: the pending copies on one processing list, locked with the
-- same row locks the acker takes, so LRANGE and these counts agree.
SELECT i.id, i.idempotency_key, i.ack_copies FROM ack_queue q JOIN inbox i ON i.id = q.inbox_id
WHERE q.adapter = %(adapter)s AND q.ack_key = %(ack_key)s AND q.by_body
ORDER BY i.id
FOR UPDATE


-- The todo lifecycle (backhalf.lifecycle.todos): the todos table is the workers'
-- queue (DESIGN.md section 7b). pending -> running (a worker's claim) ->
-- done, or back to pending to wait out a retry's backoff (run_after), or
-- failed after the last attempt; running -> pending (or failed) when its
-- lease lapses (the rescuer); any active state -> cancelled; failed or
-- cancelled -> pending (an operator's retry). Every change writes its
-- todo_events row in the same statement, so each todo's rows are one
-- continuous path. 'dispatched' is on rows an older version (the dramatiq
-- relay) left: claimed like 'pending'.

-- name: claim_todos
-- A worker process's claim: up to ``limit`` due todos of the queues it
-- serves, as many as its free threads can start now (plus a small
-- prefetch), marked running with their attempt counted, a lease of
-- ``lease_s`` and a run token of their own, each with its todo_events row,
-- in one statement: its own transaction on the worker's autocommit
-- connection. SKIP LOCKED: worker processes claiming at once split the work.
--
-- One walk of ``ix_todos_claimable`` (queue, run_after, id; claimable rows
-- only) per queue, by equality on the queue and a range on run_after, in
-- the index's own order: it stops at its limit, never reads a finished todo
-- nor a retry still waiting out its backoff, whatever the statistics say
-- (on a connection set up by claimer_session, below).
-- The queues are walked in the order given (the worker rotates it, so no
-- queue's backlog starves another's), each up to a limit of its own (the
-- free threads, and a prefetch only for a queue whose runs are quick); the
-- outer LIMIT stops the walk, and only the rows it returns are locked.
--
-- The update reaches its rows by ``id = ANY(ARRAY(...))`` alone: an index
-- probe per row, of ``todos_live`` only (``status NOT IN ('done',
-- 'cancelled')`` reaches that partition only: a parameter's ``= ANY``
-- prunes no partition at planning, a constant status does). Not the
-- claimable two the walk locked (no one else can change a row this
-- statement locked): naming these two made ix_todos_claimable a way to
-- the rows, and a plan that took it read every claimable entry, the whole
-- backlog, for the ids of a claim. Nor todos_live's four statuses by name:
-- ``status = ANY`` of four on the primary key's second column made
-- PostgreSQL descend the key four times per id; ``NOT IN`` is never an
-- index condition, and no partial index's predicate follows from it.
-- end_runs and extend_leases below reach todos_live so too. Joined to the
-- claimed rows, a generic plan guessed LIMIT $n at a tenth of the table
-- and hashed the whole primary key (DESIGN.md section 7b), or probed the
-- key once per pair of rows. The old status, which todo_events records,
-- comes from ``picked``, joined to ``claimed`` (two CTEs of a claim's size).
WITH picked AS (
    SELECT c.id, c.status
    FROM unnest(%(queues)b::text[], %(limits)b::int4[]) AS q(name, lim)
    CROSS JOIN LATERAL (
        SELECT id, status FROM todos
        WHERE queue = q.name AND status IN ('pending', 'dispatched') AND run_after <= now()
        ORDER BY run_after, id
        LIMIT q.lim
        FOR UPDATE SKIP LOCKED
    ) AS c
    LIMIT %(limit)s
), claimed AS (
    UPDATE todos t
    SET status = 'running', attempts = t.attempts + 1, run_token = gen_random_uuid(),
        lease_until = now() + make_interval(secs => %(lease_s)s), updated_at = now()
    WHERE t.id = ANY(ARRAY(SELECT id FROM picked)) AND t.status NOT IN ('done', 'cancelled')
    RETURNING t.id, t.queue, t.payload, t.idempotency_key, t.attempts, t.run_token, t.trace_context
), logged AS (
    INSERT INTO todo_events (todo_id, from_status, to_status, detail)
    SELECT c.id, p.status, 'running', %(detail)s FROM claimed c JOIN picked p ON p.id = c.id ORDER BY c.id
)
SELECT id, queue, payload::text, idempotency_key, attempts, run_token, trace_context::text
FROM claimed ORDER BY id


-- name: by_id_session
-- Set on the workers' own connections (the claimer, the state writer and
-- the lease keeper), whose statements reach todos_live's rows by id: each
-- execution is planned against the table as it is at that moment, and
-- never by a sequential scan (a table the statistics still call small may
-- hold a backlog).
-- todos_live holds the work in flight, a handful of rows while the workers
-- keep up and a backlog of any size once they fall behind, and its
-- statistics lag (autovacuum analyzes it a minute later at best; a new
-- table, never). A plan kept from a quiet moment (a generic plan, made once
-- per connection) read the whole table or one of its indexes for every
-- claim and every batch of ends once a backlog had grown: the claim's
-- update walked ix_todos_claimable whole for its ids, the ends hashed every
-- live todo, and PostgreSQL's CPU per todo doubled and tripled as the
-- backlog grew, a drain slower the more it had to drain (decision 0039).
-- Planning costs 0.3-1.6 ms a statement, for a batch of rows.
SELECT set_config('plan_cache_mode', 'force_custom_plan', false), set_config('enable_seqscan', 'off', false)


-- name: claimer_session
-- Set once on the claimer's own connection, which runs claim_todos alone
-- (and its LISTEN): the claim's walk must be ix_todos_claimable in its own
-- order, stopping at the limit, whatever the statistics say. But
-- ix_todos_queue_status (now ix_todos_queue_status_id) answers the walk's WHERE too, and
-- with statistics taken while few todos were pending PostgreSQL chose it
-- and sorted what it read: a backlog arriving before the next ANALYZE
-- (which on a table of months of history is far off) was then read and
-- sorted whole by every claim, 20,000 rows and 8-13 ms a claim
-- (tests/integration/backhalf/test_claim_plans.py), a drain quadratic in
-- its length. With sorts priced out the claimable index, which gives the
-- order itself, is the one plan left; the statement's other sorts (of the
-- claimed rows, for todo_events and the answer) are in every plan alike.
--
-- The claim is planned at each execution too (by_id_session, set first):
-- a plan kept from an emptied, vacuumed todos_live reached the claimed ids
-- through ix_todos_live_queue_status_id whole (id is its third column),
-- 1,027 pages for a claim of 8 once a backlog had grown (decision 0039).
--
-- A claim's commit is not waited for on disk (synchronous_commit off): it
-- promises nothing outside the database. Lost in a server crash, the todo
-- is pending again, and the run's end (a durable commit) finds no claim of
-- its token and is discarded: the handler runs again, at least once, as
-- after any crash. It takes a WAL flush off each todo's way from store to
-- done, and off the server's load.
SELECT set_config('enable_sort', 'off', false), set_config('synchronous_commit', 'off', false)


-- name: end_runs
-- The workers' ends, a batch of them in one statement (every worker thread
-- of a process hands its ends to one writer, backhalf.lifecycle.state_writer), so
-- that a batch with no ack to release is one round trip and one implicit
-- transaction on an autocommit connection.
--
-- An end (done; failed on its last attempt; pending again for a retry,
-- due after its backoff, ``delay_s``) applies only if its run still holds
-- the todo: running, on its run's token. A cancelled todo, or one rescued
-- and claimed again meanwhile, keeps its state and the late result is
-- discarded. An end marked ``unrun`` gives back a claim whose handler never
-- ran (the worker stopping with it claimed): pending and due now, its
-- attempt not counted.
--
-- Every id of a batch is distinct (the writer defers a second change of a
-- todo to its next batch): one statement updates each row once. No end
-- waits for a row another transaction holds (SKIP LOCKED; answered 'busy',
-- and asked again by the writer a little later): an operator's cancel, the
-- rescuer, or a store deduping a message to the todo. Waiting would hold up
-- every other end of the batch, and every batch behind it. The answer has
-- one row per end that held its todo or found it busy. Only ``todos_live``
-- is read (finished statuses excluded): a todo no longer there finished
-- meanwhile (cancelled), and its end is discarded like any other lost
-- claim's.
--
-- The run's status is checked as ``locked`` read it (the statement holds
-- the row's lock: it cannot change meanwhile), never as ``t.status =
-- 'running'``: that is the running index's predicate, and a plan taking
-- that index read every entry a claim had left in it since the last
-- vacuum (dead, and a bitmap scan never marks them so) at every batch,
-- millions a drain of 20,000
-- (tests/integration/processes/test_worker_broker.py).
WITH e AS (
    SELECT * FROM unnest(%(ids)b::int8[], %(tokens)b::uuid[], %(to_status)b::text[],
                         %(errors)b::text[], %(details)b::text[], %(unrun)b::bool[], %(delay_s)b::float8[])
        AS e(id, token, to_status, error, detail, unrun, delay_s)
), locked AS (
    SELECT t.id, t.status FROM todos t
    WHERE t.id IN (SELECT id FROM e) AND t.status NOT IN ('done', 'cancelled')
    ORDER BY t.id
    FOR UPDATE SKIP LOCKED
), changed AS (
    UPDATE todos t
    SET status = e.to_status,
        attempts = t.attempts - CASE WHEN e.unrun THEN 1 ELSE 0 END,
        lease_until = NULL,
        run_token = NULL,
        last_error = coalesce(e.error, t.last_error),
        run_after = CASE WHEN e.to_status = 'pending' THEN now() + make_interval(secs => e.delay_s)
                         ELSE t.run_after END,
        updated_at = now()
    FROM e JOIN locked l ON l.id = e.id
    WHERE t.id = e.id AND t.status NOT IN ('done', 'cancelled') AND l.status = 'running'
      AND t.run_token = e.token
    RETURNING t.id, e.to_status, e.detail
), logged AS (
    INSERT INTO todo_events (todo_id, from_status, to_status, detail)
    SELECT id, 'running', to_status, detail FROM changed ORDER BY id
)
SELECT e.id, CASE WHEN c.id IS NOT NULL THEN 'ended' ELSE 'busy' END
FROM e LEFT JOIN locked l ON l.id = e.id LEFT JOIN changed c ON c.id = e.id
WHERE c.id IS NOT NULL
   OR (l.id IS NULL AND EXISTS (SELECT 1 FROM todos
                                WHERE id = e.id AND status NOT IN ('done', 'cancelled')))


-- name: extend_leases
-- The worker's heartbeat extends the leases of every claim it holds, run
-- or waiting for a thread (docs/workers.md, "Leases"): only their own
-- run's, still running. No state change, so no todo_events row. Like
-- end_runs it waits for no row another transaction holds (the rescuer's, a
-- cancel's): such a row is answered 'busy'; the others 'extended', or
-- 'lost' (rescued or cancelled meanwhile: a claim not started yet is not
-- run). The status is checked as ``locked`` read it, as end_runs does.
WITH x AS (
    SELECT * FROM unnest(%(ids)b::int8[], %(tokens)b::uuid[]) AS x(id, token)
), locked AS (
    SELECT t.id, t.status FROM todos t
    WHERE t.id IN (SELECT id FROM x) AND t.status NOT IN ('done', 'cancelled')
    ORDER BY t.id FOR UPDATE SKIP LOCKED
), extended AS (
    UPDATE todos t SET lease_until = now() + make_interval(secs => %(lease_s)s)
    FROM x JOIN locked l ON l.id = x.id
    WHERE t.id = x.id AND t.status NOT IN ('done', 'cancelled') AND l.status = 'running'
      AND t.run_token = x.token
    RETURNING t.id, t.run_token
)
-- By run, not by todo: a process may hold an old claim of a todo (rescued
-- while it was cut off) beside a new one; only the new one is extended.
-- A todo no longer in todos_live (cancelled) is not locked, and lost.
SELECT x.id, x.token,
       CASE WHEN e.id IS NOT NULL THEN 'extended'
            WHEN l.id IS NULL AND EXISTS (SELECT 1 FROM todos
                                          WHERE id = x.id
                                            AND status NOT IN ('done', 'cancelled'))
                 THEN 'busy'
            ELSE 'lost' END
FROM x LEFT JOIN locked l ON l.id = x.id LEFT JOIN extended e ON e.id = x.id AND e.run_token = x.token


-- name: rescue_todos
-- Claims whose lease lapsed: their worker was killed, cut off, or stopped
-- without giving them back, whether their handler had started or not. Each
-- goes back to pending, due now (its attempt was counted by its claim), or
-- to failed when that was its last attempt; never run twice at once, as
-- its lease was extended for as long as its worker's heartbeat beat.
-- Through ``ix_todos_running_lease``: the running rows only, oldest lease
-- first. Locked with SKIP LOCKED, so rescuers running at once never take
-- the same todo.
WITH q AS (
    SELECT * FROM unnest(%(queues)b::text[], %(max_attempts)b::int4[]) AS q(queue, max_attempts)
), stuck AS (
    SELECT t.id, t.attempts, q.max_attempts FROM todos t JOIN q ON q.queue = t.queue
    WHERE t.status = 'running' AND t.lease_until < now()
    ORDER BY t.lease_until
    LIMIT %(limit)s
    FOR UPDATE OF t SKIP LOCKED
), moved AS (
    UPDATE todos t
    SET status = CASE WHEN s.attempts >= s.max_attempts THEN 'failed' ELSE 'pending' END,
        lease_until = NULL, run_token = NULL, run_after = now(), updated_at = now(),
        last_error = %(lease_error)s
    FROM stuck s WHERE t.id = s.id AND t.status = 'running'
    RETURNING t.id, t.queue, t.status AS to_status
), logged AS (
    INSERT INTO todo_events (todo_id, from_status, to_status, detail)
    SELECT id, 'running', to_status, %(lease_detail)s FROM moved ORDER BY id
)
SELECT id, queue, to_status FROM moved


-- name: notify_workers
-- Wakes the workers that serve these queues (their LISTEN), delivered only
-- when the caller's transaction commits: todos created, given back, rescued
-- or retried are due now. Worker processes that serve none of these queues
-- wake, find nothing to claim and wait again.
SELECT count(pg_notify(%(channel)s, q)) FROM (SELECT DISTINCT q FROM unnest(%(queues)b::text[]) AS u(q)) AS d


-- name: cancel_todos
-- An operator's cancel: any active todo. A handler still running finishes,
-- and its result is discarded (end_run's guard).
WITH old AS (
    SELECT id, status FROM todos
    WHERE id = ANY(%(ids)b::int8[]) AND status IN ('pending', 'dispatched', 'running')
    ORDER BY id
    FOR UPDATE
), cancelled AS (
    UPDATE todos t SET status = 'cancelled', lease_until = NULL, updated_at = now()
    FROM old WHERE t.id = old.id AND t.status IN ('pending', 'dispatched', 'running')
    RETURNING t.id, old.status AS from_status
), logged AS (
    INSERT INTO todo_events (todo_id, from_status, to_status, detail)
    SELECT id, from_status, 'cancelled', %(detail)s FROM cancelled
)
SELECT id FROM cancelled


-- name: retry_todos
-- An operator's retry: a failed or cancelled todo is pending again, with
-- fresh attempts. Refused (by the unique index, raising) if an active todo
-- holds the same (queue, key): the caller checks first and says so.
WITH old AS (
    SELECT id, status FROM todos
    WHERE id = ANY(%(ids)b::int8[]) AND status IN ('failed', 'cancelled')
    ORDER BY id
    FOR UPDATE
), retried AS (
    UPDATE todos t SET status = 'pending', attempts = 0, lease_until = NULL, run_after = now(),
                       updated_at = now()
    FROM old WHERE t.id = old.id AND t.status IN ('failed', 'cancelled')
    RETURNING t.id, t.queue, old.status AS from_status
), logged AS (
    INSERT INTO todo_events (todo_id, from_status, to_status, detail)
    SELECT id, from_status, 'pending', %(detail)s FROM retried
)
SELECT id, queue FROM retried


-- name: release_acks
-- ack_after 'complete': the acks waiting for these todos, which have just
-- ended (done, failed, cancelled), are owed now; the acker is woken on
-- commit. Run in the transaction that ended them, as a statement after the
-- one that did: its snapshot is taken after that statement's row-lock waits,
-- so it sees the waiting row of a store that held one of these todos locked
-- (store_ack_queue_cte). A CTE of that statement would not.
--
-- Only todos that are terminal in this snapshot release anything, so a
-- caller may name every todo whose end it asked for, held or not.
WITH released AS (
    UPDATE ack_queue q SET waiting_for = NULL
    FROM todos t
    WHERE q.waiting_for = ANY(%(ids)b::int8[]) AND t.id = q.waiting_for
      AND t.status IN ('done', 'failed', 'cancelled')
    RETURNING q.adapter
)
SELECT count(pg_notify(%(channel)s, a.adapter)) FROM (SELECT DISTINCT adapter FROM released) AS a


-- name: release_orphaned_acks
-- The rescuer's safety net under release_acks: acks still waiting for a
-- todo that has ended (a worker whose config said no adapter of its queue
-- acks on complete, while the ingester's said one does). Through
-- ix_ack_queue_waiting: a walk of the waiting acks only.
WITH orphaned AS (
    SELECT q.inbox_id FROM ack_queue q JOIN todos t ON t.id = q.waiting_for
    WHERE q.waiting_for IS NOT NULL AND t.status IN ('done', 'failed', 'cancelled')
    ORDER BY q.inbox_id
    LIMIT %(limit)s
    FOR UPDATE OF q SKIP LOCKED
), released AS (
    UPDATE ack_queue q SET waiting_for = NULL FROM orphaned o WHERE q.inbox_id = o.inbox_id
    RETURNING q.adapter
), notified AS (
    SELECT pg_notify(%(channel)s, a.adapter) FROM (SELECT DISTINCT adapter FROM released) AS a
)
SELECT (SELECT count(*) FROM released), (SELECT count(*) FROM notified)
