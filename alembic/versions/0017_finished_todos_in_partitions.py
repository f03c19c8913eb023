"""Finished todos in partitions: todos by status, todos_done by id range (issue 45)

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-06 18:30:00.000000

docs/decisions/0007-finished-todos-in-partitions.md says why. ``todos``
becomes a table partitioned by status:

* ``todos_live`` (pending, dispatched, running, failed): a plain table that
  holds the unique index of active keys, ``uq_todos_queue_key_active``;
* ``todos_done`` (done, cancelled): partitioned by ranges of ``id`` like
  the history (``backhalf.housekeeping.partitions``), with a default partition,
  ``todos_done_late``, for a todo that finishes after its period's
  partition was dropped.

The table as it was, renamed, keeps its finished rows and is attached
whole as ``todos_done``'s partition 0; its live rows (few: the work in
flight and the failed ones) are copied into ``todos_live``. Its primary key
is rebuilt on (id, status) and the attach reads it once to check its
bounds: a few seconds per million finished todos, with the table locked.
Stop the ingesters, receivers and workers for it (docs/deploying.md),
then run ``ops/roles.sql`` again.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from psycopg import sql
from sqlalchemy.dialects.postgresql import JSONB, UUID

from alembic import op
from backhalf.housekeeping import partitions

revision: str = "0017"
down_revision: str | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ident = sql.Identifier

# As applied (schema/views.py holds the current text): pointed at the new table.
VIEWS = {"audit_message_trail": "\nCREATE OR REPLACE VIEW audit_message_trail AS\nSELECT i.id AS inbox_id,\n       i.adapter,\n       i.idempotency_key,\n       i.source_message_id,\n       i.consumer,\n       i.status AS inbox_status,\n       i.error,\n       i.deliveries,\n       i.stored_at,\n       e.id AS event_id,\n       e.family,\n       e.trust_mode,\n       e.verified,\n       e.verify_detail,\n       e.received_at,\n       t.id AS todo_id,\n       t.queue,\n       t.status AS todo_status,\n       i.ack_kind,\n       i.ack_key,\n       i.ack_group,\n       i.ack_entry_id,\n       i.ack_state,\n       i.acked_at\nFROM inbox i\nLEFT JOIN events e ON e.id = i.event_id\nLEFT JOIN todos t ON t.id = i.todo_id\n"}

COLUMNS = (
    "id, queue, idempotency_key, payload, status, attempts, last_error, created_at, updated_at,"
    " run_after, lease_until, run_token, trace_context"
)
LIVE = "('pending', 'dispatched', 'running', 'failed')"
FINISHED = "('done', 'cancelled')"
ACTIVE = "status IN ('pending', 'dispatched', 'running')"
# The indexes every partition has, made on the partitioned table.
_INDEXES = {
    "ix_todos_queue_status_id": "(queue, status, id)",
    "ix_todos_claimable": "(queue, run_after, id) WHERE status IN ('pending', 'dispatched')",
    "ix_todos_running_lease": "(lease_until) WHERE status = 'running'",
}


def _run(statements: list[sql.Composable]) -> None:
    """DDL with names from this module's constants (no values: DDL takes no
    parameters), rendered by the driver's own quoting."""
    bind = op.get_bind()
    driver = bind.connection.driver_connection
    for statement in statements:
        bind.exec_driver_sql(statement.as_string(driver))


def _columns() -> list[sa.Column]:  # type: ignore[type-arg]
    return [
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("queue", sa.Text(), nullable=False),
        sa.Column("idempotency_key", sa.Text(), nullable=False),
        sa.Column("payload", JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("status", sa.Text(), server_default="pending", nullable=False),
        sa.Column("attempts", sa.Integer(), server_default="0", nullable=False),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("run_after", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("lease_until", sa.DateTime(timezone=True), nullable=True),
        sa.Column("run_token", UUID(as_uuid=True), nullable=True),
        sa.Column("trace_context", JSONB(astext_type=sa.Text()), nullable=True),
        sa.CheckConstraint(
            "status IN ('pending', 'dispatched', 'running', 'done', 'failed', 'cancelled')",
            name=op.f("ck_todos_status"),
        ),
    ]


def _sequence() -> str:
    """todos' identity's sequence, by name (a default holds its oid)."""
    return str(op.get_bind().exec_driver_sql("SELECT pg_get_serial_sequence('todos', 'id')").scalar_one())


def upgrade() -> None:
    op.execute("SET LOCAL statement_timeout = '1h'")
    old = partitions.partition_name("todos_done", 0)
    # Where the identity stood: ids past the newest row were handed out too
    # (a store's undo, a pruned todo), and rows elsewhere may name them.
    handed_out = op.get_bind().exec_driver_sql(
        "SELECT last_value FROM todos_id_seq"
    ).scalar_one()
    # Set aside: the table keeps its rows, its indexes take partition 0's
    # names, its id loses its identity (the partitioned table's takes over).
    op.rename_table("todos", old)
    _run(
        [
            sql.SQL("ALTER TABLE {} DROP CONSTRAINT {}").format(ident(old), ident("pk_todos")),
            sql.SQL("DROP INDEX {}").format(ident("uq_todos_queue_key_active")),
            sql.SQL("ALTER TABLE {} ALTER COLUMN id DROP IDENTITY").format(ident(old)),
        ]
        + [
            sql.SQL("ALTER INDEX {} RENAME TO {}").format(ident(index), ident(f"{old}_{index[9:]}"))
            for index in _INDEXES
        ]
    )
    op.create_table(
        "todos",
        *_columns(),
        sa.PrimaryKeyConstraint("id", "status", name=op.f("pk_todos")),
        postgresql_partition_by="LIST (status)",
    )
    _run(
        [
            sql.SQL("CREATE TABLE todos_live PARTITION OF todos FOR VALUES IN {}").format(sql.SQL(LIVE)),
            # Named, as the claim's plan shows them; the partitioned table's
            # indexes below take these on.
            *(
                sql.SQL("CREATE INDEX {} ON todos_live {}").format(
                    ident(f"ix_todos_live_{name[9:]}"), sql.SQL(definition)
                )
                for name, definition in _INDEXES.items()
            ),
            sql.SQL("CREATE UNIQUE INDEX uq_todos_queue_key_active ON todos_live (queue, idempotency_key)"
                    " WHERE {}").format(sql.SQL(ACTIVE)),
            sql.SQL("CREATE TABLE todos_done PARTITION OF todos FOR VALUES IN {} PARTITION BY RANGE (id)").format(
                sql.SQL(FINISHED)
            ),
            sql.SQL("CREATE TABLE todos_done_late PARTITION OF todos_done DEFAULT"),
        ]
        + [
            sql.SQL("CREATE INDEX {} ON todos {}").format(ident(name), sql.SQL(definition))
            for name, definition in _INDEXES.items()
        ]
        + [
            # The work in flight and the failed todos: few, copied.
            sql.SQL("INSERT INTO todos_live ({}) SELECT {} FROM {} WHERE status IN {}").format(
                sql.SQL(COLUMNS), sql.SQL(COLUMNS), ident(old), sql.SQL(LIVE)
            ),
            sql.SQL("DELETE FROM {} WHERE status IN {}").format(ident(old), sql.SQL(LIVE)),
            # The finished ones stay where they are: partition 0, from the lowest id.
            sql.SQL("ALTER TABLE {} ADD CONSTRAINT {} PRIMARY KEY (id, status)").format(
                ident(old), ident(f"{old}_pkey")
            ),
        ]
        + partitions.attach_existing("todos_done", old)
        + [
            sql.SQL(
                "SELECT setval(pg_get_serial_sequence('todos', 'id'),"
                " greatest(coalesce((SELECT max(id) FROM todos), 0), {}) + 1, false)"
            ).format(sql.Literal(int(handed_out))),
            # The store inserts into todos_live itself, where the id comes
            # from this default (a partition has no identity of its own):
            # no role names an id.
            sql.SQL("ALTER TABLE todos_live ALTER COLUMN id SET DEFAULT nextval({}::regclass)").format(
                sql.Literal(_sequence())
            ),
        ]
        + partitions.create("todos_done", 1)
    )
    op.execute(VIEWS["audit_message_trail"])


def downgrade() -> None:
    # One plain table again, holding every row of every partition; run
    # ops/roles.sql again after.
    op.execute("SET LOCAL statement_timeout = '1h'")
    op.execute("DROP VIEW IF EXISTS audit_message_trail")
    op.create_table("todos_flat", *_columns(), sa.PrimaryKeyConstraint("id", name="todos_flat_pkey"))
    _run(
        [
            sql.SQL("INSERT INTO todos_flat ({}) SELECT {} FROM todos").format(sql.SQL(COLUMNS), sql.SQL(COLUMNS)),
            sql.SQL("DROP TABLE todos"),
            sql.SQL("ALTER TABLE todos_flat RENAME TO todos"),
            sql.SQL("ALTER TABLE todos RENAME CONSTRAINT todos_flat_pkey TO pk_todos"),
            # Named as before (roles.sql grants it by name).
            sql.SQL("ALTER SEQUENCE todos_flat_id_seq RENAME TO todos_id_seq"),
            sql.SQL(
                "SELECT setval(pg_get_serial_sequence('todos', 'id'),"
                " coalesce((SELECT max(id) FROM todos), 0) + 1, false)"
            ),
            sql.SQL("CREATE UNIQUE INDEX uq_todos_queue_key_active ON todos (queue, idempotency_key) WHERE {}").format(
                sql.SQL(ACTIVE)
            ),
        ]
        + [
            sql.SQL("CREATE INDEX {} ON todos {}").format(ident(name), sql.SQL(definition))
            for name, definition in _INDEXES.items()
        ]
    )
    op.execute(VIEWS["audit_message_trail"])

