"""Tables of DESIGN.md section 4.

Two dedup layers live here as unique indexes:

* ``inbox_keys``: a message with a native id (a stream entry) is stored
  once per adapter for as long as its inbox row is retained, so a late
  redelivery (after the todo finished) creates nothing new. A table of its
  own: the inbox is partitioned, and a unique index there could not span
  its partitions.
* ``uq_ack_queue_body``: a message without a native id (list item) is
  deduped only while an earlier copy on the same processing list still awaits
  its ack (is queued in ``ack_queue``); the copies merge into one inbox row.
  Pub/sub rows never await an ack, so only the todo index dedups them.
* ``uq_todos_queue_key_active``: pending work is unique on
  ``(queue, idempotency_key)`` among non-terminal todos. It is an index of
  the partition ``todos_live`` (which holds every todo that is not finished),
  not of ``todos``: a unique index of a partitioned table must hold its
  partition key. ``ON CONFLICT`` only infers a partial index when its
  ``WHERE`` matches the predicate, so the store inserts into ``todos_live``
  with :data:`TODO_ACTIVE_PREDICATE`'s text.

The link columns (``inbox.todo_id``, ``inbox.event_id``, ``events.todo_id``,
``todo_events.todo_id``) carry no foreign keys on purpose: they are written
only by the store's one transaction, which creates what they point at, and a
foreign-key check per row was a large share of the store's PostgreSQL CPU
(docs/architecture.md, "Where the time goes"). ``inbox.adapter`` keeps its
foreign key.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import BYTEA, JSONB, UUID

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

metadata = sa.MetaData(naming_convention=NAMING_CONVENTION)

# The history tables (inbox, events, todo_events) are partitioned by ranges
# of their ids, one partition per period (backhalf.housekeeping.partitions), retired whole;
# so are finished todos (``todos_done``, below). Each hands out its ids from
# its own identity but ``todos_done``, whose rows take theirs from ``todos``.
PARTITION_BY = "RANGE (id)"
PARTITIONED_TABLES = ("inbox", "events", "todo_events", "todos_done")
IDENTITY_OF = {"todos_done": "todos"}

ACK_STATES = ("pending", "acked", "none")
ACK_AFTER = ("store", "complete")
INBOX_STATUSES = ("stored", "rejected")
TODO_STATUSES = ("pending", "dispatched", "running", "done", "failed", "cancelled")
ACTIVE_TODO_STATUSES = ("pending", "dispatched", "running")
# ``todos`` is partitioned by status (decision 0007, migration 0017):
# ``todos_live`` holds the todos still to do or to look at (these and
# 'failed'), so the claim, the rescuer and the dedup read a table as small
# as the work in flight; ``todos_done`` holds finished ones ('done',
# 'cancelled'), partitioned by id range like the history, and retired
# whole. A todo that finishes moves across (an UPDATE of its status, which
# PostgreSQL carries out as a delete and an insert).
# What a worker may claim; 'dispatched' only on rows an older version (the
# dramatiq relay) left.
CLAIMABLE_TODO_STATUSES = ("pending", "dispatched")
EVENT_FAMILIES = ("queue", "push")


def _one_of(column: str, values: tuple[str, ...]) -> str:
    # Literal constants from this module only: never runtime values.
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


def _now() -> sa.sql.elements.TextClause:
    return sa.text("now()")


adapters = sa.Table(
    "adapters",
    metadata,
    sa.Column("name", sa.Text, primary_key=True),
    sa.Column("family", sa.Text, nullable=False, server_default="queue"),
    sa.Column("transport", sa.Text, nullable=False),
    sa.Column("mode", sa.Text, nullable=False),
    sa.Column("enabled", sa.Boolean, nullable=False, server_default=sa.true()),
    sa.Column("settings", JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=_now()),
    sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False, server_default=_now()),
    sa.CheckConstraint(_one_of("family", EVENT_FAMILIES), name="family"),
)

todos = sa.Table(
    "todos",
    metadata,
    sa.Column("id", sa.BigInteger, sa.Identity()),
    sa.Column("queue", sa.Text, nullable=False),
    sa.Column("idempotency_key", sa.Text, nullable=False),
    sa.Column("payload", JSONB, nullable=False),
    sa.Column("status", sa.Text, nullable=False, server_default="pending"),
    sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
    sa.Column("last_error", sa.Text),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=_now()),
    sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False, server_default=_now()),
    # When it may be claimed: its creation, or after a failed attempt the
    # end of its backoff. The workers claim due todos in this order, so a
    # retry waiting out its backoff is never read by a claim.
    sa.Column("run_after", sa.DateTime(timezone=True), nullable=False, server_default=_now()),
    # While running: until when its worker holds it, extended by the
    # worker's heartbeat while the run goes on. Past it (the worker was
    # killed) the rescuer puts the todo back to pending.
    sa.Column("lease_until", sa.DateTime(timezone=True)),
    # The run's own token, chosen by the claim: only the run holding it may
    # end the todo or extend its lease, so a run whose todo was cancelled or
    # rescued and claimed again cannot end the new run.
    sa.Column("run_token", UUID(as_uuid=True)),
    # Its message's W3C trace context ({"traceparent": ..., "tracestate":
    # ...}), so its runs join the producer's trace (DESIGN.md section 14);
    # NULL without one, or with tracing off where it was stored.
    sa.Column("trace_context", JSONB),
    sa.CheckConstraint(_one_of("status", TODO_STATUSES), name="status"),
    # A partitioned table's primary key holds its partition key; ids are
    # unique by themselves (one identity hands them all out).
    sa.PrimaryKeyConstraint("id", "status"),
    postgresql_partition_by="LIST (status)",
)

TODO_ACTIVE_PREDICATE = todos.c.status.in_(ACTIVE_TODO_STATUSES)

# ``uq_todos_queue_key_active`` (queue, idempotency_key) WHERE
# TODO_ACTIVE_PREDICATE is ``todos_live``'s own (the module docstring says
# why); migration 0017 makes it.
# A queue's todos of one status, newest first: the console's and the CLI's
# pages (``backhalf.reads.todo_views.list_todos``), the overview's failed todos and
# the loose scan that finds the queues, each reading about a page whatever
# the history holds (issue 45; migration 0014 added ``id``).
sa.Index("ix_todos_queue_status_id", todos.c.queue, todos.c.status, todos.c.id)
# The workers' claim walks due todos of a queue in (run_after, id) order:
# the only index that gives that order holds exactly the claimable rows, so
# a claim never reads a finished todo whatever the statistics say
# (docs/architecture.md, "Plans that do not depend on statistics"). The
# rescuer reads running todos by lease. Partial: each index holds only the
# rows in that state, so it stays small as todos finish. 'dispatched' rows
# are an older version's, claimable like pending ones.
sa.Index(
    "ix_todos_claimable",
    todos.c.queue,
    todos.c.run_after,
    todos.c.id,
    postgresql_where=todos.c.status.in_(CLAIMABLE_TODO_STATUSES),
)
sa.Index("ix_todos_running_lease", todos.c.lease_until, postgresql_where=todos.c.status == "running")

todo_events = sa.Table(
    "todo_events",
    metadata,
    sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
    sa.Column("todo_id", sa.BigInteger, nullable=False),
    sa.Column("from_status", sa.Text),
    sa.Column("to_status", sa.Text, nullable=False),
    sa.Column("detail", sa.Text),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=_now()),
    postgresql_partition_by=PARTITION_BY,
)
sa.Index("ix_todo_events_todo_id", todo_events.c.todo_id)

events = sa.Table(
    "events",
    metadata,
    sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
    sa.Column("family", sa.Text, nullable=False),
    sa.Column("adapter", sa.Text, nullable=False),
    sa.Column("trust_mode", sa.Text, nullable=False),
    sa.Column("verified", sa.Boolean, nullable=False),
    sa.Column("verify_detail", sa.Text),
    sa.Column("idempotency_key", sa.Text, nullable=False),
    sa.Column("source_message_id", sa.Text),
    sa.Column("payload", JSONB, nullable=False),
    sa.Column("todo_id", sa.BigInteger),
    sa.Column("received_at", sa.DateTime(timezone=True), nullable=False, server_default=_now()),
    sa.CheckConstraint(_one_of("family", EVENT_FAMILIES), name="family"),
    postgresql_partition_by=PARTITION_BY,
)
sa.Index("ix_events_adapter_idempotency_key", events.c.adapter, events.c.idempotency_key)
sa.Index("ix_events_todo_id", events.c.todo_id)

# Deliveries of messages that have not been stored yet, counted in their own
# committed transactions before each attempt: a message that crashes the
# ingester every time is rejected after ``max_deliveries`` even if the
# broker's own counter was reset (DESIGN.md section 8).
delivery_attempts = sa.Table(
    "delivery_attempts",
    metadata,
    sa.Column("adapter", sa.Text, primary_key=True),
    sa.Column("idempotency_key", sa.Text, primary_key=True),
    sa.Column("attempts", sa.Integer, nullable=False),
    sa.Column("last_attempt_at", sa.DateTime(timezone=True), nullable=False, server_default=_now()),
)

INBOX_FILLFACTOR = 50

inbox = sa.Table(
    "inbox",
    metadata,
    sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
    sa.Column("adapter", sa.Text, sa.ForeignKey(adapters.c.name), nullable=False),
    sa.Column("idempotency_key", sa.Text, nullable=False),
    sa.Column("source_message_id", sa.Text),
    sa.Column("consumer", sa.Text),
    sa.Column("body", BYTEA, nullable=False),
    # Set only when ``body`` is a prefix (a message over max_message_bytes,
    # rejected): the message's full length and sha256. NULL: body is whole.
    sa.Column("body_size", sa.BigInteger),  # escaped, a field map can pass 2 GiB
    sa.Column("body_sha256", BYTEA),
    # What the broker says of the message beyond its id, for audit: an SQS
    # FIFO queue's {"MessageGroupId": ..., "SequenceNumber": ...}. Written
    # by the first store; NULL for most transports.
    sa.Column("source_attributes", JSONB),
    # The ack intent: what the acker must tell the broker once this row is
    # committed, read only by the transport that registered ``ack_kind``
    # (ingest/adapters/<transport>): Redis streams XACK ack_key ack_group
    # ack_entry_id (the ref), lists LREM ack_key ack_copies <body>, pub/sub
    # 'none'. Kinds are the transports' words: no constraint lists them
    # (issue 23, migration 0009).
    sa.Column("ack_kind", sa.Text, nullable=False),
    sa.Column("ack_key", sa.Text),
    sa.Column("ack_group", sa.Text),
    sa.Column("ack_entry_id", sa.Text),
    sa.Column("ack_copies", sa.Integer, nullable=False, server_default="1"),
    sa.Column("ack_after", sa.Text, nullable=False, server_default="store"),
    sa.Column("ack_state", sa.Text, nullable=False),
    sa.Column("acked_at", sa.DateTime(timezone=True)),
    sa.Column("deliveries", sa.Integer, nullable=False, server_default="1"),
    sa.Column("status", sa.Text, nullable=False),
    sa.Column("error", sa.Text),
    sa.Column("todo_id", sa.BigInteger),
    sa.Column("event_id", sa.BigInteger),
    sa.Column("stored_at", sa.DateTime(timezone=True), nullable=False, server_default=_now()),
    # A stream entry's ack owed now (xack, ack_after "store"), found by the
    # acker's cursor instead of an ack_queue row (issue 16): the id of the
    # transaction that stored it, or asked for its ack again
    # (``pg_current_xact_id()``, 64 bits, never wraps). NULL: the ack, if
    # any, goes through ack_queue.
    sa.Column("ack_xid", sa.BigInteger),
    sa.CheckConstraint(_one_of("ack_after", ACK_AFTER), name="ack_after"),
    sa.CheckConstraint(_one_of("ack_state", ACK_STATES), name="ack_state"),
    sa.CheckConstraint(_one_of("status", INBOX_STATUSES), name="status"),
    sa.CheckConstraint("ack_copies >= 0", name="ack_copies"),
    # Each partition is made with fillfactor INBOX_FILLFACTOR
    # (backhalf.housekeeping.partitions): room on each page for the acker's update of
    # every row, which with no index on ack_state or acked_at (pending
    # intents are found through ack_queue) is HOT, a new row version on the
    # same page and no index entry anywhere (issue 5). A partitioned table
    # itself holds no storage, so no storage parameter.
    postgresql_partition_by=PARTITION_BY,
)

INBOX_NATIVE_PREDICATE = inbox.c.source_message_id.isnot(None)

# The native keys the inbox holds: one row per (adapter, key) of a message
# with a native id (a stream entry, a JetStream sequence, an SQS MessageId),
# naming its inbox row. A unique index of a partitioned table must contain
# its partition key, so the inbox's own could not keep a key unique across
# partitions (docs/decisions/0005-history-flat-then-partitioned.md): this
# table does, one probe per key as the index did. Written by the store in
# the transaction that writes the row, deleted with it (retention).
inbox_keys = sa.Table(
    "inbox_keys",
    metadata,
    sa.Column("adapter", sa.Text, primary_key=True),
    sa.Column("idempotency_key", sa.Text, primary_key=True),
    sa.Column("inbox_id", sa.BigInteger, nullable=False),
)
# Retention deletes the keys of the rows it deletes, by their ids.
sa.Index("ix_inbox_keys_inbox_id", inbox_keys.c.inbox_id)
# The acker's cursor walks an adapter's rows in (ack_xid, id) order. The
# acker's mark changes neither column, so it stays a HOT update.
sa.Index(
    "ix_inbox_ack_cursor",
    inbox.c.adapter,
    inbox.c.ack_xid,
    inbox.c.id,
    postgresql_where=inbox.c.ack_xid.isnot(None),
)
# Every row by key, for trace and the operators' reads (the store's dedup
# reads inbox_keys, not this). A list item's or pub/sub message's rows have
# no other way in: without it, tracing one was a scan of the whole inbox
# (issue 45).
sa.Index("ix_inbox_adapter_key", inbox.c.adapter, inbox.c.idempotency_key)
# There is no index on inbox.todo_id: the audit views join the other way,
# through the todos primary key, and every index entry costs on the hot insert.
sa.Index("ix_inbox_rejected", inbox.c.adapter, inbox.c.id, postgresql_where=inbox.c.status == "rejected")

# The pending ack intents: one row per inbox row whose broker ack is owed,
# written by the store in the same transaction as the row, deleted by the
# acker in the transaction that marks the row acked. The acker's work queue
# and list mode's pending-copy bookkeeping live here, not in indexes on
# inbox.ack_state, so that the acker's update of inbox stays HOT. Small:
# rows leave it as fast as the acker runs.
ack_queue = sa.Table(
    "ack_queue",
    metadata,
    sa.Column("inbox_id", sa.BigInteger, primary_key=True),
    sa.Column("adapter", sa.Text, nullable=False),
    sa.Column("ack_kind", sa.Text, nullable=False),
    sa.Column("ack_key", sa.Text),
    sa.Column("idempotency_key", sa.Text, nullable=False),
    # ``ack_after = "complete"``: the todo whose end this ack waits for; the
    # transaction that makes it terminal sets it NULL (``release_acks``).
    # NULL: the ack is owed now, and the acker claims it. A waiting row is
    # still pending for list mode's copy bookkeeping and the claim sweep.
    sa.Column("waiting_for", sa.BigInteger),
    # The intent names its message by its body (a row without a native id:
    # a list item), so copies of one body on one key merge into one row and
    # recovery reconciles counts against them.
    sa.Column("by_body", sa.Boolean, nullable=False, server_default=sa.false()),
)
# The acker's claim walks only acks owed now, in id order, never over the
# ones waiting for a todo (however many a backlog holds).
sa.Index("ix_ack_queue_ready", ack_queue.c.inbox_id, postgresql_where=ack_queue.c.waiting_for.is_(None))
# A todo's end finds the acks waiting for it.
sa.Index(
    "ix_ack_queue_waiting", ack_queue.c.waiting_for, postgresql_where=ack_queue.c.waiting_for.isnot(None)
)
# One pending row per body *and processing list*: copies consumed onto one
# list merge into its inbox row (ack_copies), so LREM removes exactly them.
sa.Index(
    "uq_ack_queue_body",
    ack_queue.c.adapter,
    ack_queue.c.idempotency_key,
    ack_queue.c.ack_key,
    unique=True,
    postgresql_where=ack_queue.c.by_body,
)
# List recovery locks a processing list's pending intents by ack_key.
sa.Index("ix_ack_queue_body_ack_key", ack_queue.c.ack_key, postgresql_where=ack_queue.c.by_body)

# Per adapter, how far the acker has acked rows found by ``inbox.ack_xid``:
# every row before (xid, inbox_id) in (ack_xid, id) order is acked. Only
# transactions below a snapshot's xmin are read past, and all of those have
# ended, so no row can commit behind the cursor (docs/architecture.md, "The
# ack cursor"). Locked by the acker that advances it.
ack_cursors = sa.Table(
    "ack_cursors",
    metadata,
    # No foreign key to adapters: an acker configured with an adapter no
    # ingester has registered yet still drains its queued acks.
    sa.Column("adapter", sa.Text, primary_key=True),
    sa.Column("xid", sa.BigInteger, nullable=False),
    sa.Column("inbox_id", sa.BigInteger, nullable=False),
    # The cluster's system identifier: a cursor from another cluster (a
    # restore with pg_dump, whose ids start low again) is reset.
    sa.Column("cluster", sa.Text, nullable=False),
    sa.Column("moved_at", sa.DateTime(timezone=True), nullable=False, server_default=_now()),
)

# Where each consumer group Switchboard created started, as an entry id
# (``start_id = "$"`` resolved to the stream's last id at creation), so a
# group destroyed under it is recreated at the same point: nothing after it
# lost, nothing before it resurrected. In PostgreSQL, not Redis: the record
# must outlive the group and a restore of Redis from an older snapshot. One
# row per group of one broker (the broker as ``host:port/db``, never a
# credential), written once: the first record wins, so neither a second
# ingester nor a restart moves it. ``adapter`` names who recorded it; no
# foreign key, since the start belongs to the Redis group, not to the adapter.
STREAM_ID_PATTERN = "^[0-9]+(-[0-9]+)?$"

stream_groups = sa.Table(
    "stream_groups",
    metadata,
    sa.Column("broker", sa.Text, primary_key=True),
    sa.Column("stream", sa.Text, primary_key=True),
    sa.Column("group_name", sa.Text, primary_key=True),
    sa.Column("adapter", sa.Text, nullable=False),
    sa.Column("start_id", sa.Text, nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=_now()),
    # An entry id, never "$": "$" would mean "whatever is last" at recreation.
    sa.CheckConstraint(f"start_id ~ '{STREAM_ID_PATTERN}'", name="start_id"),
)

# One row per running Switchboard process (``ingest``, ``ack``, each
# ``worker`` process), written at start and every few seconds after: what
# ``switchboard status`` reads to say which processes are alive. ``instance``
# is chosen at random per process start; a graceful stop sets ``stopped_at``.
# A row neither stopped nor seen lately is a process that died, unless a
# newer process of the same role on the same host replaced it (a restart).
PROCESS_ROLES = ("ingest", "ack", "worker", "receive", "web")

processes = sa.Table(
    "processes",
    metadata,
    sa.Column("instance", UUID(as_uuid=True), primary_key=True),
    sa.Column("role", sa.Text, nullable=False),
    sa.Column("host", sa.Text, nullable=False),
    sa.Column("pid", sa.Integer, nullable=False),
    # What it runs (adapters and consumer names, queues): no secrets.
    sa.Column("detail", JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
    sa.Column("started_at", sa.DateTime(timezone=True), nullable=False, server_default=_now()),
    sa.Column("seen_at", sa.DateTime(timezone=True), nullable=False, server_default=_now()),
    sa.Column("stopped_at", sa.DateTime(timezone=True)),
    sa.CheckConstraint(_one_of("role", PROCESS_ROLES), name="role"),
)
sa.Index("ix_processes_role_host", processes.c.role, processes.c.host)
