"""History in partitions: inbox, events and todo_events by id range; inbox_keys (issue 45)

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-06 12:00:00.000000

docs/decisions/0005-history-flat-then-partitioned.md says why. Each of the
three tables becomes a table partitioned by ranges of ``id``
(``backhalf.housekeeping.partitions``): the table as it was, renamed, is attached whole
as partition 0 (every id so far), and partition 1 is made empty, ahead.
The native keys move from the inbox's unique index to ``inbox_keys``, filled
from the rows that have one. The audit views are pointed at the new tables.

It reads every inbox row (the keys) and checks each one's adapter (the
foreign key, cloned onto partition 0): about a second per million rows on
the team's machine, with the tables locked. Stop the ingesters and the
receivers for it (docs/deploying.md), then run ``ops/roles.sql`` again: the
new tables need its grants and policies.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from psycopg import sql
from sqlalchemy.dialects.postgresql import BYTEA, JSONB

from alembic import op
from backhalf.housekeeping import partitions

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Audit views, frozen as applied (schema/views.py holds the current text):
# the same text as before, pointed at the partitioned tables.
VIEWS = {
    "audit_message_trail": "\nCREATE OR REPLACE VIEW audit_message_trail AS\nSELECT i.id AS inbox_id,\n       i.adapter,\n       i.idempotency_key,\n       i.source_message_id,\n       i.consumer,\n       i.status AS inbox_status,\n       i.error,\n       i.deliveries,\n       i.stored_at,\n       e.id AS event_id,\n       e.family,\n       e.trust_mode,\n       e.verified,\n       e.verify_detail,\n       e.received_at,\n       t.id AS todo_id,\n       t.queue,\n       t.status AS todo_status,\n       i.ack_kind,\n       i.ack_key,\n       i.ack_group,\n       i.ack_entry_id,\n       i.ack_state,\n       i.acked_at\nFROM inbox i\nLEFT JOIN events e ON e.id = i.event_id\nLEFT JOIN todos t ON t.id = i.todo_id\n",
    "audit_unacked": "\nCREATE OR REPLACE VIEW audit_unacked AS\nSELECT i.id AS inbox_id,\n       i.adapter,\n       i.idempotency_key,\n       i.source_message_id,\n       i.ack_kind,\n       i.ack_key,\n       i.ack_entry_id,\n       i.status AS inbox_status,\n       i.stored_at,\n       now() - i.stored_at AS age\nFROM inbox i\nWHERE i.ack_state = 'pending'\n",
    "audit_rejected": "\nCREATE OR REPLACE VIEW audit_rejected AS\nSELECT i.id AS inbox_id,\n       i.adapter,\n       i.idempotency_key,\n       i.source_message_id,\n       i.error,\n       i.deliveries,\n       i.ack_state,\n       i.stored_at\nFROM inbox i\nWHERE i.status = 'rejected'\n",
    "audit_adapter_counts": "\nCREATE OR REPLACE VIEW audit_adapter_counts AS\nSELECT a.name AS adapter,\n       a.enabled,\n       count(i.id) FILTER (WHERE i.status = 'stored') AS stored,\n       count(i.id) FILTER (WHERE i.status = 'rejected') AS rejected,\n       count(i.id) FILTER (WHERE i.ack_state = 'pending') AS pending_acks,\n       count(i.id) FILTER (WHERE i.ack_state = 'acked') AS acked,\n       now() - min(i.stored_at) FILTER (WHERE i.ack_state = 'pending') AS oldest_unacked_age\nFROM adapters a\nLEFT JOIN inbox i ON i.adapter = a.name\nGROUP BY a.name, a.enabled\n",
    "audit_redeliveries": "\nCREATE OR REPLACE VIEW audit_redeliveries AS\nSELECT i.adapter,\n       count(*) AS inbox_rows,\n       count(*) FILTER (WHERE i.deliveries > 1) AS redelivered_rows,\n       sum(i.deliveries - 1) AS redeliveries,\n       max(i.deliveries) AS max_deliveries\nFROM inbox i\nGROUP BY i.adapter\n",
    "audit_delivery_counts": "\nCREATE OR REPLACE VIEW audit_delivery_counts AS\nSELECT i.adapter,\n       i.deliveries,\n       count(*) AS inbox_rows\nFROM inbox i\nGROUP BY i.adapter, i.deliveries\n",
    "audit_adapter_minutes": "\nCREATE OR REPLACE VIEW audit_adapter_minutes AS\nSELECT m.adapter,\n       m.minute,\n       count(*) FILTER (WHERE m.stored) AS consumed,\n       coalesce(sum(m.redeliveries), 0) AS deduplicated_inbox,\n       count(*) FILTER (WHERE m.todo_dedup) AS deduplicated_todo,\n       count(*) FILTER (WHERE m.rejected) AS rejected,\n       count(*) FILTER (WHERE NOT m.stored) AS acked,\n       percentile_cont(0.5) WITHIN GROUP (ORDER BY m.ack_latency_s) AS ack_latency_p50_s,\n       percentile_cont(0.95) WITHIN GROUP (ORDER BY m.ack_latency_s) AS ack_latency_p95_s,\n       percentile_cont(0.99) WITHIN GROUP (ORDER BY m.ack_latency_s) AS ack_latency_p99_s\nFROM (\n    SELECT i.adapter,\n           date_trunc('minute', i.stored_at) AS minute,\n           true AS stored,\n           i.deliveries - 1 AS redeliveries,\n           i.status = 'rejected' AS rejected,\n           EXISTS (SELECT 1 FROM events e WHERE e.todo_id = i.todo_id AND e.id < i.event_id) AS todo_dedup,\n           NULL::double precision AS ack_latency_s\n    FROM inbox i\n    UNION ALL\n    SELECT i.adapter,\n           date_trunc('minute', i.acked_at),\n           false,\n           NULL,\n           false,\n           false,\n           extract(epoch FROM i.acked_at - i.stored_at)::double precision\n    FROM inbox i\n    WHERE i.acked_at IS NOT NULL\n) m\nGROUP BY m.adapter, m.minute\n",
}

# Each table's indexes as they were, renamed to partition 0's names so the
# partitioned table can take the old ones (an index name is the schema's).
_INDEXES = {
    "todo_events": ["ix_todo_events_todo_id"],
    "events": ["ix_events_adapter_idempotency_key", "ix_events_todo_id"],
    "inbox": ["uq_inbox_native_key", "ix_inbox_ack_cursor", "ix_inbox_rejected", "ix_inbox_body_key"],
}


def _run(statements: list[sql.Composed]) -> None:
    """DDL with names from this module's constants (no values: DDL takes no
    parameters), rendered by the driver's own quoting."""
    bind = op.get_bind()
    driver = bind.connection.driver_connection
    for statement in statements:
        bind.exec_driver_sql(statement.as_string(driver))


def _set_aside(table: str) -> str:
    """Rename ``table`` (and its indexes) to partition 0's names; its id
    column loses its identity (the partitioned table's takes over)."""
    old = partitions.partition_name(table, 0)
    op.rename_table(table, old)
    renames = [
        sql.SQL("ALTER TABLE {} RENAME CONSTRAINT {} TO {}").format(
            sql.Identifier(old), sql.Identifier(f"pk_{table}"), sql.Identifier(f"{old}_pkey")
        )
    ]
    renames += [
        sql.SQL("ALTER INDEX {} RENAME TO {}").format(
            sql.Identifier(index), sql.Identifier(f"{old}_{index[3:]}")
        )
        for index in _INDEXES[table]
    ]
    renames.append(sql.SQL("ALTER TABLE {} ALTER COLUMN id DROP IDENTITY").format(sql.Identifier(old)))
    _run(renames)
    return old


def _take_over(table: str, old: str) -> None:
    """Attach ``old`` as partition 0, move the identity past its ids, make
    partition 1 ahead."""
    _run(partitions.attach_existing(table, old))
    _run(
        [
            sql.SQL(
                "SELECT setval(pg_get_serial_sequence({}, 'id'), coalesce((SELECT max(id) FROM {}), 0) + 1, false)"
            ).format(sql.Literal(table), sql.Identifier(old))
        ]
    )
    _run(partitions.create(table, 1))


def upgrade() -> None:
    op.execute("SET LOCAL statement_timeout = '1h'")
    old = _set_aside("todo_events")
    op.create_table(
        "todo_events",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("todo_id", sa.BigInteger(), nullable=False),
        sa.Column("from_status", sa.Text(), nullable=True),
        sa.Column("to_status", sa.Text(), nullable=False),
        sa.Column("detail", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_todo_events")),
        postgresql_partition_by="RANGE (id)",
    )
    _take_over("todo_events", old)
    op.create_index("ix_todo_events_todo_id", "todo_events", ["todo_id"], unique=False)

    old = _set_aside("events")
    op.create_table(
        "events",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("family", sa.Text(), nullable=False),
        sa.Column("adapter", sa.Text(), nullable=False),
        sa.Column("trust_mode", sa.Text(), nullable=False),
        sa.Column("verified", sa.Boolean(), nullable=False),
        sa.Column("verify_detail", sa.Text(), nullable=True),
        sa.Column("idempotency_key", sa.Text(), nullable=False),
        sa.Column("source_message_id", sa.Text(), nullable=True),
        sa.Column("payload", JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("todo_id", sa.BigInteger(), nullable=True),
        sa.Column("received_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.CheckConstraint("family IN ('queue', 'push')", name=op.f("ck_events_family")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_events")),
        postgresql_partition_by="RANGE (id)",
    )
    _take_over("events", old)
    op.create_index(
        "ix_events_adapter_idempotency_key", "events", ["adapter", "idempotency_key"], unique=False
    )
    op.create_index("ix_events_todo_id", "events", ["todo_id"], unique=False)

    old = _set_aside("inbox")
    # The foreign key comes back from the partitioned table, cloned onto
    # partition 0 on attach; two equal ones would both be checked.
    op.drop_constraint("fk_inbox_adapter_adapters", old, type_="foreignkey")
    op.create_table(
        "inbox",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("adapter", sa.Text(), nullable=False),
        sa.Column("idempotency_key", sa.Text(), nullable=False),
        sa.Column("source_message_id", sa.Text(), nullable=True),
        sa.Column("consumer", sa.Text(), nullable=True),
        sa.Column("body", BYTEA(), nullable=False),
        sa.Column("body_size", sa.BigInteger(), nullable=True),
        sa.Column("body_sha256", BYTEA(), nullable=True),
        sa.Column("source_attributes", JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column("ack_kind", sa.Text(), nullable=False),
        sa.Column("ack_key", sa.Text(), nullable=True),
        sa.Column("ack_group", sa.Text(), nullable=True),
        sa.Column("ack_entry_id", sa.Text(), nullable=True),
        sa.Column("ack_copies", sa.Integer(), server_default="1", nullable=False),
        sa.Column("ack_after", sa.Text(), server_default="store", nullable=False),
        sa.Column("ack_state", sa.Text(), nullable=False),
        sa.Column("acked_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("deliveries", sa.Integer(), server_default="1", nullable=False),
        sa.Column("status", sa.Text(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("todo_id", sa.BigInteger(), nullable=True),
        sa.Column("event_id", sa.BigInteger(), nullable=True),
        sa.Column("stored_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("ack_xid", sa.BigInteger(), nullable=True),
        sa.CheckConstraint("ack_after IN ('store', 'complete')", name=op.f("ck_inbox_ack_after")),
        sa.CheckConstraint("ack_state IN ('pending', 'acked', 'none')", name=op.f("ck_inbox_ack_state")),
        sa.CheckConstraint("status IN ('stored', 'rejected')", name=op.f("ck_inbox_status")),
        sa.CheckConstraint("ack_copies >= 0", name=op.f("ck_inbox_ack_copies")),
        sa.ForeignKeyConstraint(["adapter"], ["adapters.name"], name=op.f("fk_inbox_adapter_adapters")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_inbox")),
        postgresql_partition_by="RANGE (id)",
    )
    _take_over("inbox", old)
    op.create_index(
        "ix_inbox_ack_cursor",
        "inbox",
        ["adapter", "ack_xid", "id"],
        unique=False,
        postgresql_where=sa.text("ack_xid IS NOT NULL"),
    )
    op.create_index(
        "ix_inbox_rejected",
        "inbox",
        ["adapter", "id"],
        unique=False,
        postgresql_where=sa.text("status = 'rejected'"),
    )
    # Every row by key (trace); it takes the place of the two that held the
    # rows with and without a native id.
    op.create_index("ix_inbox_adapter_key", "inbox", ["adapter", "idempotency_key"], unique=False)
    op.create_table(
        "inbox_keys",
        sa.Column("adapter", sa.Text(), nullable=False),
        sa.Column("idempotency_key", sa.Text(), nullable=False),
        sa.Column("inbox_id", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("adapter", "idempotency_key", name=op.f("pk_inbox_keys")),
    )
    _run(
        [
            sql.SQL(
                "INSERT INTO inbox_keys (adapter, idempotency_key, inbox_id)"
                " SELECT adapter, idempotency_key, id FROM {} WHERE source_message_id IS NOT NULL"
            ).format(sql.Identifier(old))
        ]
    )
    op.create_index("ix_inbox_keys_inbox_id", "inbox_keys", ["inbox_id"], unique=False)
    # Partition 0's own unique index held the keys until now; inbox_keys does.
    _run([sql.SQL("DROP INDEX {}").format(sql.Identifier(f"{old}_{index}")) for index in ("inbox_native_key", "inbox_body_key")])
    for ddl in VIEWS.values():
        op.execute(ddl)


def _flatten(table: str) -> None:
    """Partition 0 becomes ``table`` again, holding every row of every partition."""
    old = partitions.partition_name(table, 0)
    ident = sql.Identifier
    # By name: partition 0 has its columns in the order they were added.
    columns = sql.SQL(", ").join(ident(c["name"]) for c in sa.inspect(op.get_bind()).get_columns(table))
    _run(
        [
            sql.SQL("ALTER TABLE {} DETACH PARTITION {}").format(ident(table), ident(old)),
            sql.SQL("INSERT INTO {} ({}) SELECT {} FROM {}").format(ident(old), columns, columns, ident(table)),
            sql.SQL("DROP TABLE {}").format(ident(table)),
            # Named as before (roles.sql grants it by name): the partitioned
            # table's sequence went with it.
            sql.SQL("ALTER TABLE {} ALTER COLUMN id ADD GENERATED BY DEFAULT AS IDENTITY (SEQUENCE NAME {})").format(
                ident(old), ident(f"{table}_id_seq")
            ),
            sql.SQL(
                "SELECT setval(pg_get_serial_sequence({}, 'id'), coalesce((SELECT max(id) FROM {}), 0) + 1, false)"
            ).format(sql.Literal(old), ident(old)),
            sql.SQL("ALTER TABLE {} RENAME TO {}").format(ident(old), ident(table)),
            sql.SQL("ALTER TABLE {} RENAME CONSTRAINT {} TO {}").format(
                ident(table), ident(f"{old}_pkey"), ident(f"pk_{table}")
            ),
        ]
        + [
            sql.SQL("ALTER INDEX {} RENAME TO {}").format(ident(f"{old}_{index[3:]}"), ident(index))
            for index in _INDEXES[table]
            if index not in ("uq_inbox_native_key", "ix_inbox_body_key")
        ]
    )


def downgrade() -> None:
    # Partition 0 must still be there (retention drops it once it is past
    # the history); run ops/roles.sql again after (the views are made anew).
    op.execute("SET LOCAL statement_timeout = '1h'")
    # The views depend on the partitioned tables, which go.
    _run([sql.SQL("DROP VIEW IF EXISTS {} CASCADE").format(sql.Identifier(name)) for name in reversed(VIEWS)])
    # Dropped on the partitioned table, it goes from every partition.
    op.drop_index("ix_inbox_adapter_key", table_name="inbox")
    for table in ("inbox", "events", "todo_events"):
        _flatten(table)
    op.create_index(
        "uq_inbox_native_key",
        "inbox",
        ["adapter", "idempotency_key"],
        unique=True,
        postgresql_where=sa.text("source_message_id IS NOT NULL"),
    )
    op.create_index(
        "ix_inbox_body_key",
        "inbox",
        ["adapter", "idempotency_key"],
        unique=False,
        postgresql_where=sa.text("source_message_id IS NULL"),
    )
    # Partition 0 kept the partitioned table's foreign key when detached.
    op.execute("ALTER TABLE inbox DROP CONSTRAINT IF EXISTS fk_inbox_adapter_adapters")
    op.create_foreign_key(op.f("fk_inbox_adapter_adapters"), "inbox", "adapters", ["adapter"], ["name"])
    op.drop_table("inbox_keys")
    for ddl in VIEWS.values():
        op.execute(ddl)
