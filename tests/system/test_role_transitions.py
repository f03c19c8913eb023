"""Least privilege, row by row (issue 32): under the shipped PostgreSQL roles
(``ops/roles.sql``), each role may make only the changes its own process
makes. Grants say which columns; the file's row-level security policies say
which rows and which changes: the todos' state changes each role writes (a
pair, status before and after), the history rows it logs, the deletes the
pruner and the store's undo make, the ack targets and acks, whose
``processes`` rows.

Each forbidden change is one case, run as the role's login user, as real SQL
against one seeded database: refused with SQLSTATE 42501 (a privilege, or a
policy's WITH CHECK: "new row violates row-level security policy"), or, where
a policy's USING hides the row from an UPDATE or DELETE, affecting no row;
either way every table is as it was. The changes the processes do make are
cases too (rolled back), and so are the operator's CLI commands, the store's
undo and the heartbeats, run as the roles that make them. The whole pipeline
under these roles is ``test_least_privilege.py``."""

from __future__ import annotations

import asyncio
import json
import subprocess
import uuid
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from psycopg import errors, sql
from sqlalchemy.ext.asyncio import create_async_engine

from backhalf import queries
from backhalf.db import libpq_url
from backhalf.housekeeping import heartbeats
from backhalf.lifecycle import todos
from backhalf.records import AckTarget, InboxRecord, Provenance, StoreBatch
from backhalf.writes.store import store
from ingest.embedded.processes import wait_for
from ingest.exit_codes import EXIT_DATABASE
from tests.support import db
from tests.support.config import stream_adapter, write_config
from tests.support.downstream import QUEUE
from tests.support.processes import switchboard
from tests.support.roles import (
    INSUFFICIENT_PRIVILEGE,
    RoleDatabase,
    migrate_and_grant,
    role_database,
    run_roles_sql,
)
from tests.support.servers import ServerUrls

pytestmark = pytest.mark.system

REFUSED = f"SQLSTATE {INSUFFICIENT_PRIVILEGE}"
NO_ROW = 0  # a policy's USING hid every row the statement named

# Every table a forbidden change could reach, as the superuser reads it.
TABLES = (
    "SELECT * FROM adapters ORDER BY name",
    "SELECT * FROM todos ORDER BY id",
    "SELECT * FROM todo_events ORDER BY id",
    "SELECT * FROM inbox ORDER BY id",
    "SELECT * FROM ack_queue ORDER BY inbox_id",
    "SELECT * FROM events ORDER BY id",
    "SELECT * FROM processes ORDER BY instance",
)


def _tables(url: str) -> list[list[tuple[Any, ...]]]:
    with psycopg.connect(libpq_url(url), autocommit=True, connect_timeout=10) as conn:
        return [conn.execute(statement).fetchall() for statement in TABLES]


# The seed: one todo in each status (and two an ack waits for), their
# creation rows, inbox rows with their ack pending, acked, queued or none, an
# event, and a heartbeat row of each process role (the console's, web,
# included) plus one silent for days.
SEED_TODOS = {
    "pending": ("k-pending", "pending"),
    "dispatched": ("k-dispatched", "dispatched"),  # left so by an older version (the dramatiq relay)
    "running": ("k-running", "running"),
    "done": ("k-done", "done"),
    "failed": ("k-failed", "failed"),
    "cancelled": ("k-cancelled", "cancelled"),
    "held": ("k-held", "running"),  # an ack waits for it (ack_after = "complete")
    "awaited": ("k-awaited", "done"),  # ended, its waiting ack not released yet
}


def _seed(url: str) -> dict[str, Any]:
    ids: dict[str, Any] = {}
    db.query(
        url,
        "INSERT INTO adapters (name, transport, mode, settings)"
        """ VALUES ('orders', 'redis', 'stream', '{"queue": "orders"}')""",
    )
    for name, (key, status) in SEED_TODOS.items():
        ids[name] = db.scalar(
            url,
            "INSERT INTO todos (queue, idempotency_key, payload, status, attempts, lease_until, run_token)"
            " VALUES ('orders', %(key)s, '{}', %(status)s, %(attempts)s,"
            " CASE WHEN %(running)s THEN now() + interval '1 day' END, %(token)s)"
            " RETURNING id",
            {
                "key": key,
                "status": status,
                "attempts": 0 if status in ("pending", "dispatched") else 1,
                "running": status == "running",
                "token": uuid.uuid4() if status == "running" else None,
            },
        )
        db.query(
            url,
            "INSERT INTO todo_events (todo_id, from_status, to_status, detail)"
            " VALUES (%(id)s, NULL, 'pending', 'created')",
            {"id": ids[name]},
        )
    inbox = (
        # name, key, ack_kind, ack_state, acked
        ("inbox_pending", "k-pending", "xack", "pending", False),
        ("inbox_awaited", "k-awaited", "xack", "pending", False),
        ("inbox_acked", "k-done", "xack", "acked", True),
        ("inbox_acked_queued", "k-failed", "xack", "acked", True),
        ("inbox_none", "k-cancelled", "none", "none", False),
        ("inbox_rejected", "k-rejected", "xack", "acked", True),
    )
    for n, (name, key, kind, state, acked) in enumerate(inbox, start=1):
        ids[name] = db.scalar(
            url,
            "INSERT INTO inbox (adapter, idempotency_key, source_message_id, body, ack_kind, ack_key,"
            " ack_group, ack_entry_id, ack_after, ack_state, acked_at, status, error, todo_id)"
            " VALUES ('orders', %(key)s, %(entry)s, '\\x7b7d', %(kind)s, 'orders', 'switchboard', %(entry)s,"
            " 'complete', %(state)s, CASE WHEN %(acked)s THEN now() END, %(status)s, %(error)s, %(todo)s)"
            " RETURNING id",
            {
                "key": key,
                "entry": f"{n}-0",
                "kind": kind,
                "state": state,
                "acked": acked,
                "status": "rejected" if name == "inbox_rejected" else "stored",
                "error": "schema: $.n: required" if name == "inbox_rejected" else None,
                "todo": None if name == "inbox_rejected" else ids[key.removeprefix("k-")],
            },
        )
    for inbox_name, waiting_for in (
        ("inbox_pending", ids["held"]),
        ("inbox_awaited", ids["awaited"]),
        ("inbox_acked_queued", None),
    ):
        db.query(
            url,
            "INSERT INTO ack_queue (inbox_id, adapter, ack_kind, ack_key, idempotency_key, waiting_for)"
            " SELECT id, adapter, ack_kind, ack_key, idempotency_key, %(waiting)s FROM inbox"
            " WHERE id = %(id)s",
            {"id": ids[inbox_name], "waiting": waiting_for},
        )
    ids["event"] = db.scalar(
        url,
        "INSERT INTO events (family, adapter, trust_mode, verified, idempotency_key, source_message_id,"
        " payload, todo_id) VALUES ('queue', 'orders', 'queue', false, 'k-pending', '1-0', '{}', %(todo)s)"
        " RETURNING id",
        {"todo": ids["pending"]},
    )
    # Two days old: past every floor retention keeps (an hour; three days
    # only for a push adapter's rows), so the pruner's cases may delete.
    for table, column in (
        ("todos", "updated_at"),
        ("todo_events", "created_at"),
        ("inbox", "stored_at"),
        ("events", "received_at"),
    ):
        db.query(url, f"UPDATE {table} SET {column} = now() - interval '2 days'")  # names, not values
    for name, role, silent_days in (
        ("ingest", "ingest", 0),
        ("ack", "ack", 0),
        ("worker", "worker", 0),
        ("web", "web", 0),
        ("stale", "worker", 2),
    ):
        ids[f"process_{name}"] = uuid.uuid4()
        db.query(
            url,
            "INSERT INTO processes (instance, role, host, pid, seen_at)"
            " VALUES (%(instance)s, %(role)s, 'h1', 1, now() - make_interval(days => %(days)s))",
            {"instance": ids[f"process_{name}"], "role": role, "days": silent_days},
        )
    return ids


@pytest.fixture(scope="module")
def seeded(servers: ServerUrls) -> Iterator[tuple[RoleDatabase, dict[str, Any]]]:
    with role_database(servers.database) as rdb:
        migrate_and_grant(rdb)
        yield rdb, _seed(rdb.admin_url)


@dataclass(frozen=True)
class Sql:
    """A statement and the values it binds beside the seeded ids."""

    text: str
    values: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Case:
    name: str
    role: str
    statement: Sql | str
    expect: str | int  # REFUSED, or the rows affected
    before: tuple[Sql | str, ...] = ()  # run first, in the same transaction

    def __str__(self) -> str:
        return self.name


def _execute(cur: psycopg.Cursor[Any], statement: Sql | str, ids: Mapping[str, Any]) -> None:
    sql_ = statement if isinstance(statement, Sql) else Sql(statement)
    cur.execute(sql_.text, {**ids, **sql_.values})


def _attempt(url: str, case: Case, ids: dict[str, Any]) -> str | int:
    """Run the case in a transaction of its own: "SQLSTATE ..." if refused,
    else the rows its statement affected. Committed only if it changed no
    row (so "unchanged" is read after a commit), rolled back otherwise."""
    with psycopg.connect(libpq_url(url), connect_timeout=10) as conn:
        try:
            with conn.cursor() as cur:
                for statement in case.before:
                    _execute(cur, statement, ids)
                _execute(cur, case.statement, ids)
                rows = cur.rowcount
        except errors.Error as exc:
            conn.rollback()
            return f"SQLSTATE {exc.sqlstate}"
        if rows == 0:
            conn.commit()
        else:
            conn.rollback()
        return rows


# ``todo`` names a seeded id (a parameter of its own); statuses are bound.
def _set_status(status: str, todo: str) -> Sql:
    return Sql(
        f"UPDATE todos SET status = %(to_status)s, updated_at = now() WHERE id = %({todo})s",
        {"to_status": status},
    )


def _log(from_status: str | None, to_status: str, todo: str) -> Sql:
    return Sql(
        "INSERT INTO todo_events (todo_id, from_status, to_status, detail)"
        f" VALUES (%({todo})s, %(from_status)s, %(to_status)s, 'forged')",
        {"from_status": from_status, "to_status": to_status},
    )


def _redelivery(ack_key: str, ack_group: str, entry: str = "1-0", key: str = "k-pending") -> Sql:
    """store_again_cte's update of a stream entry stored already (the row
    its key names in inbox_keys; here found by its key directly)."""
    return Sql(
        "UPDATE inbox SET deliveries = inbox.deliveries + 1, ack_key = %(ack_key)s,"
        " ack_group = %(ack_group)s, ack_entry_id = %(entry)s, ack_state = 'pending', acked_at = NULL,"
        " ack_xid = NULL"
        " WHERE adapter = 'orders' AND idempotency_key = %(key)s AND source_message_id IS NOT NULL",
        {"key": key, "entry": entry, "ack_key": ack_key, "ack_group": ack_group},
    )


# The ingester's dedup: the no-op update of the active todo with its key,
# in todos_live, as todos_create_cte writes it (decision 0007).
DEDUP = (
    "INSERT INTO todos_live (queue, idempotency_key, payload) VALUES ('orders', 'k-pending', '{}')"
    " ON CONFLICT (queue, idempotency_key) WHERE status IN ('pending', 'dispatched', 'running')"
    " DO UPDATE SET updated_at = todos_live.updated_at"
)
# todos_create_cte: a todo and its creation row, in one statement.
CREATE = (
    "WITH t AS (INSERT INTO todos_live (queue, idempotency_key, payload) VALUES ('orders', 'k-new', '{}')"
    " RETURNING id) INSERT INTO todo_events (todo_id, from_status, to_status, detail)"
    " SELECT id, NULL, 'pending', 'created' FROM t"
)
EVENT = (
    "INSERT INTO events (family, adapter, trust_mode, verified, idempotency_key, payload)"
    " VALUES ('queue', 'orders', 'queue', false, 'k-new', '{}')"
)


def _beat(instance: str, role: str) -> Sql:
    """A heartbeat (backhalf.housekeeping.heartbeats.beat_statement), as ``role``, onto
    the row of the seeded ``instance``."""
    return Sql(
        "INSERT INTO processes (instance, role, host, pid)"
        f" VALUES (%({instance})s, %(process_role)s, 'h1', 1)"
        " ON CONFLICT (instance) DO UPDATE SET seen_at = now(), detail = excluded.detail",
        {"process_role": role},
    )


# The console (`switchboard web`, role 'web') runs as the operator or the viewer.
PROCESS_ROLES = {"ingester": "ingest", "acker": "ack", "worker": "worker", "operator": "web", "viewer": "web"}

FORBIDDEN = [
    # The acker (its rescuer) moves running todos back to pending or to
    # failed only: nothing it does claims, finishes, cancels or revives work.
    Case("acker sets a pending todo done", "acker", _set_status("done", "pending"), REFUSED),
    Case("acker sets a running todo done", "acker", _set_status("done", "running"), REFUSED),
    Case("acker cancels a running todo", "acker", _set_status("cancelled", "running"), REFUSED),
    Case("acker sets a done todo back to pending", "acker", _set_status("pending", "done"), REFUSED),
    Case("acker revives a cancelled todo", "acker", _set_status("pending", "cancelled"), REFUSED),
    Case("acker revives a failed todo", "acker", _set_status("pending", "failed"), REFUSED),
    Case("acker claims a pending todo", "acker", _set_status("running", "pending"), REFUSED),
    Case("acker fails a pending todo", "acker", _set_status("failed", "pending"), REFUSED),
    Case("acker deletes an active todo", "acker", "DELETE FROM todos WHERE id = %(pending)s", NO_ROW),
    Case("acker deletes a running todo", "acker", "DELETE FROM todos WHERE id = %(running)s", NO_ROW),
    Case(
        "acker deletes a todo an ack waits for", "acker", "DELETE FROM todos WHERE id = %(awaited)s", NO_ROW
    ),
    # The worker claims (to running) and ends (from running) runs.
    Case("worker sets a pending todo done", "worker", _set_status("done", "pending"), REFUSED),
    Case("worker fails a pending todo", "worker", _set_status("failed", "pending"), REFUSED),
    Case("worker cancels a running todo", "worker", _set_status("cancelled", "running"), REFUSED),
    Case("worker sets a done todo back to pending", "worker", _set_status("pending", "done"), REFUSED),
    Case("worker starts a done todo again", "worker", _set_status("running", "done"), REFUSED),
    Case("worker starts a cancelled todo", "worker", _set_status("running", "cancelled"), REFUSED),
    Case("worker revives a failed todo", "worker", _set_status("pending", "failed"), REFUSED),
    Case("worker revives a cancelled todo", "worker", _set_status("pending", "cancelled"), REFUSED),
    Case("worker deletes a todo", "worker", "DELETE FROM todos WHERE id = %(done)s", REFUSED),
    # The ingester creates todos and dedups to active ones; it deletes only
    # the todos its own transaction created (the store's undo).
    Case(
        "ingester touches a done todo",
        "ingester",
        "UPDATE todos SET updated_at = now() WHERE id = %(done)s",
        NO_ROW,
    ),
    Case(
        "ingester deletes a todo it did not create",
        "ingester",
        "DELETE FROM todos WHERE id = %(pending)s",
        NO_ROW,
    ),
    Case("ingester deletes a done todo", "ingester", "DELETE FROM todos WHERE id = %(done)s", NO_ROW),
    # An id it chose could sit beside another todo's (the key is (id,
    # status)) or in a partition's range to come (decision 0007).
    Case(
        "ingester chooses a todo's id",
        "ingester",
        "INSERT INTO todos_live (id, queue, idempotency_key, payload)"
        " VALUES (%(done)s, 'orders', 'k-id', '{}')",
        REFUSED,
    ),
    Case(
        "ingester dedups to a todo, then deletes it",
        "ingester",
        "DELETE FROM todos WHERE id = %(pending)s",
        NO_ROW,
        before=(DEDUP,),
    ),
    # The operator cancels active todos and retries failed or cancelled ones.
    Case("operator sets a done todo back to pending", "operator", _set_status("pending", "done"), REFUSED),
    Case("operator cancels a done todo", "operator", _set_status("cancelled", "done"), REFUSED),
    Case("operator sets a pending todo done", "operator", _set_status("done", "pending"), REFUSED),
    Case("operator claims a todo", "operator", _set_status("running", "pending"), REFUSED),
    Case("operator deletes a todo", "operator", "DELETE FROM todos WHERE id = %(done)s", REFUSED),
    # todo_events: each role logs its own changes only, of a todo in the
    # status the row says it left; nobody rewrites history.
    Case("ingester forges an end", "ingester", _log("running", "done", "running"), REFUSED),
    Case("ingester logs a creation of an existing todo", "ingester", _log(None, "pending", "done"), REFUSED),
    Case("acker forges an end", "acker", _log("running", "done", "running"), REFUSED),
    Case("acker forges a revival", "acker", _log("done", "pending", "done"), REFUSED),
    Case("acker logs a rescue of a todo not running", "acker", _log("running", "failed", "pending"), REFUSED),
    Case("acker logs a creation", "acker", _log(None, "pending", "pending"), REFUSED),
    Case("acker logs a put-back of a done todo", "acker", _log("running", "pending", "done"), REFUSED),
    Case("acker logs a claim", "acker", _log("pending", "running", "pending"), REFUSED),
    Case("worker forges a skipped run", "worker", _log("pending", "done", "pending"), REFUSED),
    Case("worker logs an end of a todo not running", "worker", _log("running", "done", "pending"), REFUSED),
    Case("worker forges a cancel", "worker", _log("running", "cancelled", "running"), REFUSED),
    Case("worker logs a start of a done todo", "worker", _log("pending", "running", "done"), REFUSED),
    Case("operator forges an end", "operator", _log("running", "done", "running"), REFUSED),
    Case("operator logs a retry of a done todo", "operator", _log("done", "pending", "done"), REFUSED),
    Case("operator logs a cancel of a done todo", "operator", _log("pending", "cancelled", "done"), REFUSED),
    Case(
        "ingester deletes a todo's history",
        "ingester",
        "DELETE FROM todo_events WHERE todo_id = %(pending)s",
        NO_ROW,
    ),
    Case(
        "acker deletes an active todo's history",
        "acker",
        "DELETE FROM todo_events WHERE todo_id = %(running)s",
        NO_ROW,
    ),
    Case("worker deletes history", "worker", "DELETE FROM todo_events WHERE todo_id = %(done)s", REFUSED),
    Case("acker rewrites history", "acker", "UPDATE todo_events SET to_status = 'done'", REFUSED),
    # The ingester's inbox writes: a pending row keeps its ack target, and
    # only what nothing acks is 'none'.
    Case(
        "ingester repoints a pending ack's stream",
        "ingester",
        "UPDATE inbox SET ack_key = 'elsewhere' WHERE id = %(inbox_pending)s",
        REFUSED,
    ),
    Case(
        "ingester repoints a pending ack by a redelivery",
        "ingester",
        _redelivery("elsewhere", "switchboard"),
        REFUSED,
    ),
    # An acked row asked for its ack again, pointed elsewhere in the same
    # statement (review of issue 32): the old row was not pending.
    Case(
        "ingester repoints an acked row as it asks for its ack again",
        "ingester",
        "UPDATE inbox SET ack_state = 'pending', acked_at = NULL, ack_key = 'jobs',"
        " ack_xid = pg_current_xact_id()::text::int8 WHERE id = %(inbox_acked)s",
        REFUSED,
    ),
    Case(
        "ingester drops a pending ack (ack_state none)",
        "ingester",
        "UPDATE inbox SET ack_state = 'none' WHERE id = %(inbox_pending)s",
        REFUSED,
    ),
    Case(
        "ingester drops an acked row's ack (ack_state none)",
        "ingester",
        "UPDATE inbox SET ack_state = 'none', acked_at = NULL WHERE id = %(inbox_acked)s",
        REFUSED,
    ),
    Case(
        "ingester stores a stream entry that is never acked",
        "ingester",
        "INSERT INTO inbox (adapter, idempotency_key, source_message_id, body, ack_kind, ack_key, ack_group,"
        " ack_entry_id, ack_state, status) VALUES ('orders', 'k-new', '9-0', '\\x7b7d', 'xack', 'orders',"
        " 'switchboard', '9-0', 'none', 'stored')",
        REFUSED,
    ),
    # The acker marks acks; it deletes only rows whose ack is done.
    Case(
        "acker deletes a row whose ack is pending",
        "acker",
        "DELETE FROM inbox WHERE id = %(inbox_pending)s",
        NO_ROW,
    ),
    Case(
        "acker deletes a row whose ack is still queued",
        "acker",
        "DELETE FROM inbox WHERE id = %(inbox_acked_queued)s",
        NO_ROW,
    ),
    Case(
        "acker marks a pending ack as never owed",
        "acker",
        "UPDATE inbox SET ack_state = 'none' WHERE id = %(inbox_pending)s",
        REFUSED,
    ),
    Case(
        "acker marks an ack without its time",
        "acker",
        "UPDATE inbox SET ack_state = 'acked' WHERE id = %(inbox_pending)s",
        REFUSED,
    ),
    # The operator's replay turns a rejected row into a stored one, no other.
    Case(
        "operator relinks a stored row",
        "operator",
        "UPDATE inbox SET todo_id = %(done)s, event_id = %(event)s, status = 'stored', error = NULL"
        " WHERE id = %(inbox_pending)s",
        REFUSED,
    ),
    Case(
        "operator stores a rejected row without a todo",
        "operator",
        "UPDATE inbox SET status = 'stored', error = NULL WHERE id = %(inbox_rejected)s",
        REFUSED,
    ),
    Case(
        "operator marks an ack",
        "operator",
        "UPDATE inbox SET ack_state = 'acked' WHERE id = %(inbox_pending)s",
        REFUSED,
    ),
    Case(
        "operator deletes an inbox row", "operator", "DELETE FROM inbox WHERE id = %(inbox_acked)s", REFUSED
    ),
    # Acks waiting for a todo are released when it ends, not before; the
    # acker deletes only the acks it claims (owed now).
    *(
        Case(
            f"{role} releases an ack whose todo is running",
            role,
            "UPDATE ack_queue SET waiting_for = NULL WHERE waiting_for = %(held)s",
            NO_ROW,
        )
        for role in ("worker", "acker", "operator")
    ),
    Case(
        "acker deletes an ack that waits for its todo",
        "acker",
        "DELETE FROM ack_queue WHERE inbox_id = %(inbox_pending)s",
        NO_ROW,
    ),
    Case(
        "acker makes an owed ack wait",
        "acker",
        "UPDATE ack_queue SET waiting_for = %(held)s WHERE inbox_id = %(inbox_acked_queued)s",
        REFUSED,
    ),
    Case(
        "worker makes an ack wait for another todo",
        "worker",
        "UPDATE ack_queue SET waiting_for = %(held)s WHERE inbox_id = %(inbox_awaited)s",
        REFUSED,
    ),
    Case(
        "operator deletes an ack",
        "operator",
        "DELETE FROM ack_queue WHERE inbox_id = %(inbox_awaited)s",
        REFUSED,
    ),
    # events: the ingester deletes only its own transaction's (the store's
    # undo); a replay's event is never verified.
    Case("ingester deletes an event", "ingester", "DELETE FROM events WHERE id = %(event)s", NO_ROW),
    Case(
        "operator vouches for an event",
        "operator",
        "INSERT INTO events (family, adapter, trust_mode, verified, idempotency_key, payload)"
        " VALUES ('queue', 'orders', 'queue', true, 'k-forged', '{}')",
        REFUSED,
    ),
    Case("worker deletes an event", "worker", "DELETE FROM events WHERE id = %(event)s", REFUSED),
    # processes: each process role its own rows; only day-silent ones go.
    *(
        case
        for role, own in PROCESS_ROLES.items()
        for other in sorted(set(PROCESS_ROLES.values()) - {own})
        for case in (
            Case(
                f"{role} edits a heartbeat of {other}",
                role,
                "UPDATE processes SET seen_at = now(), stopped_at = now()"
                f" WHERE instance = %(process_{other})s",
                NO_ROW,
            ),
            Case(
                f"{role} deletes a live heartbeat of {other}",
                role,
                f"DELETE FROM processes WHERE instance = %(process_{other})s",
                NO_ROW,
            ),
            Case(
                f"{role} writes a heartbeat as {other}",
                role,
                Sql(
                    "INSERT INTO processes (instance, role, host, pid)"
                    " VALUES (gen_random_uuid(), %(process_role)s, 'h1', 1)",
                    {"process_role": other},
                ),
                REFUSED,
            ),
            Case(
                f"{role} beats onto a row of {other}",
                role,
                _beat(f"process_{other}", own),
                REFUSED,
            ),
        )
    ),
    Case(
        "ingester deletes its own live heartbeat",
        "ingester",
        "DELETE FROM processes WHERE instance = %(process_ingest)s",
        NO_ROW,
    ),
    # The viewer (the read-only console) reads and beats, and writes nothing
    # else: none of the operator's actions, no ack, no delete, no audit view.
    Case("viewer disables an adapter", "viewer", "UPDATE adapters SET enabled = false", REFUSED),
    Case("viewer cancels a todo", "viewer", _set_status("cancelled", "pending"), REFUSED),
    Case("viewer retries a failed todo", "viewer", _set_status("pending", "failed"), REFUSED),
    Case("viewer logs a cancel", "viewer", _log("pending", "cancelled", "pending"), REFUSED),
    Case("viewer creates a todo (replay)", "viewer", CREATE, REFUSED),
    Case("viewer records an event", "viewer", EVENT, REFUSED),
    Case(
        "viewer stores a rejected row (replay)",
        "viewer",
        "UPDATE inbox SET status = 'stored', error = NULL, todo_id = %(pending)s, event_id = %(event)s"
        " WHERE id = %(inbox_rejected)s",
        REFUSED,
    ),
    Case(
        "viewer releases an ack",
        "viewer",
        "UPDATE ack_queue SET waiting_for = NULL WHERE inbox_id = %(inbox_awaited)s",
        REFUSED,
    ),
    Case("viewer deletes an inbox row", "viewer", "DELETE FROM inbox WHERE id = %(inbox_acked)s", REFUSED),
    Case("viewer deletes a todo", "viewer", "DELETE FROM todos WHERE id = %(done)s", REFUSED),
    Case("viewer reads delivery attempts", "viewer", "SELECT * FROM delivery_attempts", REFUSED),
    Case("viewer reads an audit view", "viewer", "SELECT * FROM audit_unacked", REFUSED),
]


@pytest.mark.parametrize("case", FORBIDDEN, ids=str)
def test_each_forbidden_change_is_refused(seeded: tuple[RoleDatabase, dict[str, Any]], case: Case) -> None:
    rdb, ids = seeded
    before = _tables(rdb.admin_url)
    assert _attempt(rdb.url(case.role), case, ids) == case.expect
    assert _tables(rdb.admin_url) == before  # nothing reached a table


def _claim(from_status: str, todo: str) -> Sql:
    """claim_todos' change, as one statement: the todo running, leased, logged."""
    return Sql(
        "WITH logged AS (INSERT INTO todo_events (todo_id, from_status, to_status, detail)"
        f" VALUES (%({todo})s, %(from_status)s, 'running', 'claimed'))"
        " UPDATE todos SET status = 'running', attempts = attempts + 1,"
        " lease_until = now() + interval '30 seconds', run_token = gen_random_uuid(), updated_at = now()"
        f" WHERE id = %({todo})s",
        {"from_status": from_status},
    )


def _back_to_pending(todo: str, detail: str, columns: str) -> Sql:
    """end_runs' or rescue_todos' put-back of a running todo, with the
    columns it writes beside the status, logged."""
    return Sql(
        "WITH logged AS (INSERT INTO todo_events (todo_id, from_status, to_status, detail)"
        f" VALUES (%({todo})s, 'running', 'pending', %(detail)s))"
        f" UPDATE todos SET status = 'pending', lease_until = NULL, run_token = NULL, {columns},"
        f" updated_at = now() WHERE id = %({todo})s",
        {"detail": detail},
    )


def _change(from_status: str, to_status: str, todo: str) -> Sql:
    """A change and its todo_events row, in one statement, as the processes write them."""
    log, change = _log(from_status, to_status, todo), _set_status(to_status, todo)
    return Sql(f"WITH logged AS ({log.text}) {change.text}", {**log.values, **change.values})


ALLOWED = [
    # What the processes do, each as its own statement (rolled back): the
    # policies above leave them room.
    Case("worker claims a pending todo", "worker", _claim("pending", "pending"), 1),
    Case(
        "worker claims a todo an older version left dispatched",
        "worker",
        _claim("dispatched", "dispatched"),
        1,
    ),
    Case(
        "worker extends a lease",
        "worker",
        "UPDATE todos SET lease_until = now() + interval '30 seconds' WHERE id = %(running)s",
        1,
    ),
    *(
        Case(f"worker ends a run: {status}", "worker", _change("running", status, "running"), 1)
        for status in ("done", "failed")
    ),
    Case(
        "worker ends a run: a retry after its backoff",
        "worker",
        _back_to_pending(
            "running",
            "attempt 1 of 3 failed",
            "last_error = 'planned', run_after = now() + interval '1 second'",
        ),
        1,
    ),
    Case(
        "worker gives back a claim it never ran",
        "worker",
        _back_to_pending("running", "given back unrun", "attempts = attempts - 1, run_after = now()"),
        1,
    ),
    Case(
        "worker locks a todo that ended under its run",
        "worker",
        "SELECT 1 FROM todos WHERE id = %(done)s FOR UPDATE",
        1,
    ),
    Case(
        "acker rescues a running todo",
        "acker",
        _back_to_pending(
            "running", "rescued: its lease expired", "last_error = 'lease expired', run_after = now()"
        ),
        1,
    ),
    Case("acker fails a running todo out of attempts", "acker", _change("running", "failed", "running"), 1),
    Case("acker prunes a done todo", "acker", "DELETE FROM todos WHERE id = %(done)s", 1),
    Case(
        "acker prunes a done todo's history", "acker", "DELETE FROM todo_events WHERE todo_id = %(done)s", 1
    ),
    Case("acker prunes an acked row", "acker", "DELETE FROM inbox WHERE id = %(inbox_acked)s", 1),
    Case("acker prunes a row that needs no ack", "acker", "DELETE FROM inbox WHERE id = %(inbox_none)s", 1),
    Case("acker prunes an event", "acker", "DELETE FROM events WHERE id = %(event)s", 1),
    Case(
        "acker marks an ack",
        "acker",
        "UPDATE inbox SET ack_state = 'acked', acked_at = statement_timestamp() WHERE id = %(inbox_pending)s",
        1,
    ),
    Case(
        "acker claims an owed ack",
        "acker",
        "DELETE FROM ack_queue WHERE inbox_id IN (SELECT inbox_id FROM ack_queue WHERE waiting_for IS NULL"
        " FOR UPDATE SKIP LOCKED)",
        1,
    ),
    *(
        Case(
            f"{role} releases an ack whose todo ended",
            role,
            "UPDATE ack_queue SET waiting_for = NULL WHERE waiting_for = %(awaited)s",
            1,
        )
        for role in ("worker", "acker", "operator")
    ),
    Case("operator cancels a running todo", "operator", _change("running", "cancelled", "running"), 1),
    Case(
        "operator cancels a todo an older version left dispatched",
        "operator",
        _change("dispatched", "cancelled", "dispatched"),
        1,
    ),
    Case("operator retries a failed todo", "operator", _change("failed", "pending", "failed"), 1),
    Case("operator retries a cancelled todo", "operator", _change("cancelled", "pending", "cancelled"), 1),
    Case("ingester dedups to an active todo", "ingester", DEDUP, 1),
    Case("ingester creates a todo with its creation row", "ingester", CREATE, 1),
    Case(
        "ingester undoes the todo it created",
        "ingester",
        "DELETE FROM todos WHERE idempotency_key = 'k-new'",
        1,
        before=(CREATE,),
    ),
    Case(
        "ingester undoes the creation row it wrote",
        "ingester",
        "DELETE FROM todo_events WHERE todo_id = (SELECT id FROM todos WHERE idempotency_key = 'k-new')",
        1,
        before=(CREATE,),
    ),
    Case("ingester stores an event", "ingester", EVENT, 1),
    Case(
        "ingester undoes the event it stored",
        "ingester",
        "DELETE FROM events WHERE idempotency_key = 'k-new'",
        1,
        before=(EVENT,),
    ),
    Case(
        "ingester queues an ack",
        "ingester",
        "INSERT INTO ack_queue (inbox_id, adapter, ack_kind, ack_key, idempotency_key)"
        " VALUES (%(inbox_acked)s, 'orders', 'xack', 'orders', 'k-done')",
        1,
    ),
    Case("ingester locks the queued acks", "ingester", "SELECT 1 FROM ack_queue FOR UPDATE", 3),
    Case("operator creates a todo with its creation row (replay)", "operator", CREATE, 1),
    Case("operator records a replay's event", "operator", EVENT, 1),
    Case(
        "operator stores a rejected row (replay)",
        "operator",
        "UPDATE inbox SET status = 'stored', error = NULL, todo_id = %(pending)s, event_id = %(event)s"
        " WHERE id = %(inbox_rejected)s",
        1,
    ),
    Case(
        "ingester takes a redelivery of a pending entry", "ingester", _redelivery("orders", "switchboard"), 1
    ),
    # The same entry through a group renamed in the config: acked in the
    # group that holds it now (the entry is the stored one either way).
    Case(
        "ingester takes a pending entry's redelivery through a renamed group",
        "ingester",
        _redelivery("orders", "renamed"),
        1,
    ),
    Case(
        "ingester asks for an acked entry's ack again",
        "ingester",
        _redelivery("orders", "switchboard", entry="3-0", key="k-done"),
        1,
    ),
    *(
        Case(
            f"{role} forgets a heartbeat silent for days",
            role,
            "DELETE FROM processes WHERE instance = %(process_stale)s",
            1,
        )
        for role in PROCESS_ROLES
    ),
    *(
        Case(
            f"{role} beats",
            role,
            _beat(f"process_{own}", own),
            1,
        )
        for role, own in PROCESS_ROLES.items()
    ),
]


@pytest.mark.parametrize("case", ALLOWED, ids=str)
def test_each_change_a_process_makes_is_allowed(
    seeded: tuple[RoleDatabase, dict[str, Any]], case: Case
) -> None:
    rdb, ids = seeded
    before = _tables(rdb.admin_url)
    assert _attempt(rdb.url(case.role), case, ids) == case.expect
    assert _tables(rdb.admin_url) == before  # rolled back


@pytest.fixture
def granted(servers: ServerUrls) -> Iterator[RoleDatabase]:
    with role_database(servers.database) as rdb:
        migrate_and_grant(rdb)
        yield rdb


def _entry(entry_id: str) -> InboxRecord:
    return InboxRecord(f"redis:orders:{entry_id}", entry_id, b'{"n": 1}', '{"n": 1}', ack_ref=entry_id)


async def test_the_store_undoes_its_own_rows_as_the_ingester(granted: RoleDatabase) -> None:
    """A stored entry delivered again after its todo finished: the store's
    upsert makes a new todo (and event, and history row) before its inbox
    insert meets the stored row, then deletes them (delete_todos,
    delete_events): its own transaction's rows, which the policies allow."""
    admin = granted.admin_url
    db.query(
        admin,
        "INSERT INTO adapters (name, transport, mode, settings)"
        """ VALUES ('orders', 'redis', 'stream', '{"queue": "orders"}')""",
    )
    batch = StoreBatch(
        adapter="orders",
        queue="orders",
        consumer="c1",
        ack_after="store",
        ack=AckTarget("xack", "orders", "switchboard", by_cursor=True),
        provenance=Provenance("queue", "queue", False, "redis acl: switchboard-ingester"),
        records=[_entry("1-0")],
    )
    engine = create_async_engine(granted.url("ingester"))
    try:
        async with engine.begin() as conn:
            first = await store(conn, batch)
        db.query(admin, "UPDATE todos SET status = 'done'")
        async with engine.begin() as conn:
            again = await store(conn, batch)
    finally:
        await engine.dispose()
    assert (first.new, first.todos_created, again.new, again.redelivered, again.todos_created) == (
        1,
        1,
        0,
        1,
        0,
    )
    # The undo took effect: one todo, one event, one history row, as before.
    counts = (
        "SELECT (SELECT count(*) FROM todos), (SELECT count(*) FROM events),"
        " (SELECT count(*) FROM todo_events), (SELECT deliveries FROM inbox)"
    )
    assert db.query(admin, counts) == [(1, 1, 1, 2)]


def test_the_pruner_deletes_nothing_younger_than_retentions_floors(granted: RoleDatabase) -> None:
    """Whatever retention a config sets, the acker's login deletes no row
    younger than the floors (an hour; three days for a push adapter's
    inbox rows and events, the senders' retry span): a just-finished
    delivery keeps the row its resend dedups against."""
    admin = granted.admin_url
    db.query(
        admin,
        "INSERT INTO adapters (name, family, transport, mode, settings) VALUES"
        """ ('orders', 'queue', 'redis', 'stream', '{"queue": "orders"}'),"""
        """ ('billing', 'push', 'webhook', 'github', '{"queue": "billing"}')""",
    )
    todo = db.scalar(
        admin,
        "INSERT INTO todos (queue, idempotency_key, payload, status, attempts)"
        " VALUES ('orders', 'k-young', '{}', 'done', 1) RETURNING id",
    )
    db.query(
        admin,
        "INSERT INTO todo_events (todo_id, from_status, to_status) VALUES (%(id)s, NULL, 'pending')",
        {"id": todo},
    )
    for adapter, age in (("orders", "10 minutes"), ("billing", "2 days")):
        db.query(
            admin,
            "INSERT INTO inbox (adapter, idempotency_key, source_message_id, body, ack_kind, ack_state,"
            " status, stored_at) VALUES (%(adapter)s, %(adapter)s || ':1', '1', '\\x7b7d', 'none', 'none',"
            " 'stored', now() - %(age)s::interval)",
            {"adapter": adapter, "age": age},
        )
        db.query(
            admin,
            "INSERT INTO events (family, adapter, trust_mode, verified, idempotency_key, payload,"
            " received_at) VALUES ('queue', %(adapter)s, 'queue', false, %(adapter)s || ':1', '{}',"
            " now() - %(age)s::interval)",
            {"adapter": adapter, "age": age},
        )
    db.query(
        admin, "INSERT INTO delivery_attempts (adapter, idempotency_key, attempts) VALUES ('orders', 'k', 1)"
    )
    before = _tables(admin)
    acker = granted.url("acker")
    with psycopg.connect(libpq_url(acker), autocommit=True, connect_timeout=10) as conn:
        deleted = {
            table: conn.execute(f"DELETE FROM {table}").rowcount  # names, not values
            for table in ("inbox", "events", "todo_events", "todos", "delivery_attempts")
        }
    assert deleted == dict.fromkeys(deleted, 0)
    assert _tables(admin) == before
    assert db.scalar(admin, "SELECT count(*) FROM delivery_attempts") == 1


def test_heartbeats_run_as_each_process_role(granted: RoleDatabase) -> None:
    """backhalf.housekeeping.heartbeats' own statements: each role beats, stops and reads
    its rows, and forgets anyone's row a day silent, and no other."""
    admin = granted.admin_url
    stale = uuid.uuid4()
    db.query(
        admin,
        "INSERT INTO processes (instance, role, host, pid, seen_at)"
        " VALUES (%(i)s, 'ack', 'h1', 1, now() - interval '2 days')",
        {"i": stale},
    )
    for role, process_role in PROCESS_ROLES.items():
        instance = uuid.uuid4()
        engine = sa.create_engine(granted.url(role))
        try:
            with engine.begin() as conn:
                conn.execute(heartbeats.beat_statement(instance, process_role, "h1", 1, {"slot": role}))
                conn.execute(heartbeats.beat_statement(instance, process_role, "h1", 1, {"slot": role}))
                conn.execute(heartbeats.stopped_statement(instance))
                forgotten = conn.execute(heartbeats.forget_statement()).rowcount
                seen = conn.execute(sa.select(sa.func.count()).select_from(sa.table("processes"))).scalar()
        finally:
            engine.dispose()
        assert forgotten == (1 if role == "ingester" else 0), role  # the stale row goes once
        assert seen == list(PROCESS_ROLES).index(role) + 1  # every row: status reads them all
    assert db.query(admin, "SELECT role, stopped_at IS NOT NULL FROM processes ORDER BY role") == [
        ("ack", True),
        ("ingest", True),
        ("web", True),  # the operator's console
        ("web", True),  # the viewer's
        ("worker", True),
    ]


def test_the_operator_commands_run_as_the_operator(
    tmp_path: Path, granted: RoleDatabase, servers: ServerUrls
) -> None:
    """The CLI's operator actions (adapters enable/disable, todos retry and
    cancel, inbox replay) and reads, as the operator's login user, not the
    schema's owner; a refusal still says why."""
    admin = granted.admin_url
    db.query(admin, "INSERT INTO adapters (name, transport, mode) VALUES ('orders', 'redis', 'stream')")
    todo = {
        status: db.scalar(
            admin,
            "INSERT INTO todos (queue, idempotency_key, payload, status)"
            " VALUES ('orders', %(k)s, '{}', %(s)s) RETURNING id",
            {"k": f"k-{status}", "s": status},
        )
        for status in ("pending", "failed", "done")
    }
    waiting = db.scalar(
        admin,
        "INSERT INTO inbox (adapter, idempotency_key, source_message_id, body, ack_kind, ack_key,"
        " ack_group, ack_entry_id, ack_after, ack_state, status, todo_id) VALUES ('orders', 'k-pending',"
        " '1-0', '\\x7b7d', 'xack', 'orders', 'switchboard', '1-0', 'complete', 'pending', 'stored', %(t)s)"
        " RETURNING id",
        {"t": todo["pending"]},
    )
    db.query(
        admin,
        "INSERT INTO ack_queue (inbox_id, adapter, ack_kind, ack_key, idempotency_key, waiting_for)"
        " VALUES (%(i)s, 'orders', 'xack', 'orders', 'k-pending', %(t)s)",
        {"i": waiting, "t": todo["pending"]},
    )
    rejected = {
        key: db.scalar(
            admin,
            "INSERT INTO inbox (adapter, idempotency_key, source_message_id, body, ack_kind, ack_key,"
            " ack_group, ack_entry_id, ack_state, acked_at, status, error) VALUES ('orders', %(k)s, %(m)s,"
            " %(b)s, 'xack', 'orders', 'switchboard', %(m)s, 'acked', now(), 'rejected',"
            " 'schema: $.n: required') RETURNING id",
            {"k": key, "m": entry, "b": json.dumps({"n": 2}).encode()},
        )
        for key, entry in (("k-rejected", "5-0"), ("k-failed-again", "6-0"))
    }
    # A rejected row whose key has an active todo: the replay dedups to it.
    dedup_to = db.scalar(
        admin,
        "INSERT INTO todos (queue, idempotency_key, payload) VALUES ('orders', 'k-failed-again', '{}')"
        " RETURNING id",
    )
    config = write_config(
        tmp_path / "operator.toml",
        database_url=granted.url("operator"),
        redis_url=servers.redis,
        adapters=[stream_adapter("orders", url=servers.redis)],
        queues={"orders": QUEUE},
    )

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return switchboard("--config", str(config), *args)

    for flag in ("disable", "enable"):
        done = run("adapters", flag, "orders")
        assert done.returncode == 0, done.stdout + done.stderr
        assert db.scalar(admin, "SELECT enabled FROM adapters") is (flag == "enable")
    actions: list[list[str]] = [
        ["todos", "retry", str(todo["failed"])],
        ["todos", "cancel", str(todo["pending"])],
        ["inbox", "replay", str(rejected["k-rejected"]), str(rejected["k-failed-again"])],
    ]
    for action in actions:
        done = run(*action)
        assert done.returncode == 0, done.stdout + done.stderr
    statuses = dict(db.query(admin, "SELECT id, status FROM todos"))
    assert (statuses[todo["failed"]], statuses[todo["pending"]], statuses[todo["done"]]) == (
        "pending",
        "cancelled",
        "done",
    )
    # The cancel released the ack that waited for its todo.
    assert db.query(admin, "SELECT waiting_for FROM ack_queue") == [(None,)]
    replayed = db.query(
        admin,
        "SELECT i.idempotency_key, i.status, i.error, t.status, e.verified"
        " FROM inbox i JOIN todos t ON t.id = i.todo_id JOIN events e ON e.id = i.event_id"
        " WHERE i.id = ANY(%(ids)s) ORDER BY i.id",
        {"ids": list(rejected.values())},
    )
    assert replayed == [
        ("k-rejected", "stored", None, "pending", False),
        ("k-failed-again", "stored", None, "pending", False),
    ]
    deduped = db.scalar(
        admin, "SELECT todo_id FROM inbox WHERE id = %(i)s", {"i": rejected["k-failed-again"]}
    )
    assert deduped == dedup_to
    history = db.query(
        admin,
        "SELECT todo_id, from_status, to_status, detail FROM todo_events ORDER BY id",
    )
    assert history == [
        (todo["failed"], "failed", "pending", "retried by an operator"),
        (todo["pending"], "pending", "cancelled", "cancelled by an operator"),
        (
            db.scalar(admin, "SELECT id FROM todos WHERE idempotency_key = 'k-rejected'"),
            None,
            "pending",
            "created by replay",
        ),
    ]
    # A done todo is neither retried nor cancelled, and the refusal says why
    # (the operator's lock reads a todo in any status).
    for verb, reason in (("retry", "is done, not failed or cancelled"), ("cancel", "already finished")):
        refused = run("todos", verb, str(todo["done"]))
        assert refused.returncode == 1, refused.stdout + refused.stderr
        assert reason in refused.stderr
    # The reads.
    reads: list[list[str]] = [
        ["adapters", "list"],
        ["todos", "list"],
        ["todos", "show", str(todo["done"])],
        ["inbox", "list"],
        ["inbox", "show", str(rejected["k-rejected"])],
        ["trace", "k-rejected"],
        ["status"],
    ]
    for command in reads:
        done = run(*command)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "permission denied" not in done.stderr
    # The acker's login, where the operator's is needed: the line names the
    # role that runs the command, not `switchboard migrate` (issue 24).
    as_acker = write_config(
        tmp_path / "acker.toml", database_url=granted.url("acker"), redis_url=servers.redis, adapters=[]
    )
    refused = switchboard("--config", str(as_acker), "adapters", "disable", "orders")
    assert refused.returncode == EXIT_DATABASE, refused.stdout + refused.stderr
    assert "`switchboard adapters disable` runs as the operator's login" in refused.stderr
    assert "migrate" not in refused.stderr


def test_the_rescuer_and_the_workers_own_statements_run_under_their_roles(
    granted: RoleDatabase,
) -> None:
    """backhalf.lifecycle.todos' own functions, as the roles that call them: a worker's
    claim, lease extensions and ends (done, failed, a retry after its
    backoff, a claim given back unrun) as the worker, including those of a
    run whose todo was cancelled under it, which its lock must still see
    (answered lost and not held, not "busy"); the rescuer's (rescue,
    release_orphaned_acks) as the acker."""
    admin = granted.admin_url
    lapsed = datetime.now(UTC) - timedelta(minutes=1)
    todo = {
        name: db.scalar(
            admin,
            "INSERT INTO todos (queue, idempotency_key, payload, status, attempts, lease_until)"
            " VALUES ('orders', %(k)s, '{}', %(s)s, %(a)s, %(lease)s) RETURNING id",
            {"k": f"k-{name}", "s": status, "a": attempts, "lease": lease},
        )
        for name, status, attempts, lease in (
            ("out_of_attempts", "running", 3, lapsed),
            ("lease_expired", "running", 1, lapsed),
            ("to_fail", "pending", 0, None),
            ("to_retry", "dispatched", 0, None),  # as an older version left it
            ("to_give_back", "pending", 0, None),
            ("to_finish", "pending", 0, None),
            ("cancelled_under", "pending", 0, None),
            ("done", "done", 1, None),
            ("cancelled", "cancelled", 1, None),
        )
    }
    for inbox_id, waiting_for in ((1, todo["out_of_attempts"]), (2, todo["done"])):
        db.query(
            admin,
            "INSERT INTO ack_queue (inbox_id, adapter, ack_kind, ack_key, idempotency_key, waiting_for)"
            " VALUES (%(i)s, 'orders', 'xack', 'orders', %(k)s, %(t)s)",
            {"i": inbox_id, "k": f"k-{inbox_id}", "t": waiting_for},
        )

    with psycopg.connect(libpq_url(granted.url("worker")), autocommit=True) as pg:
        claimed = {c.todo.id: c for c in todos.claim(pg, ["orders"], 10, 60.0)}
        claimable = ("to_fail", "to_retry", "to_give_back", "to_finish", "cancelled_under")
        assert sorted(claimed) == sorted(todo[n] for n in claimable)
        db.query(  # an operator's cancel, as cancel_todos writes it
            admin,
            "WITH logged AS (INSERT INTO todo_events (todo_id, from_status, to_status, detail)"
            " VALUES (%(t)s, 'running', 'cancelled', 'cancelled by an operator'))"
            " UPDATE todos SET status = 'cancelled', lease_until = NULL WHERE id = %(t)s",
            {"t": todo["cancelled_under"]},
        )
        extended = todos.extend_leases(
            pg, [claimed[todo["to_finish"]], claimed[todo["cancelled_under"]]], 60.0
        )
        assert extended == {
            (todo["to_finish"], claimed[todo["to_finish"]].token): True,
            (todo["cancelled_under"], claimed[todo["cancelled_under"]].token): False,
        }
        endings = [
            todos.Ending(claimed[todo["to_fail"]], "failed", "Planned: planned", "attempt 1 of 1 failed"),
            todos.Ending(claimed[todo["to_retry"]], "pending", "Planned: planned", "retried", delay_s=30.0),
            todos.Ending(claimed[todo["to_give_back"]], "pending", None, todos.GIVEN_BACK, unrun=True),
            todos.Ending(claimed[todo["to_finish"]], "done", None, "done"),
            todos.Ending(claimed[todo["cancelled_under"]], "done", None, "done"),
        ]
        held, busy = todos.end_runs(pg, endings)
    assert held == {todo[n] for n in ("to_fail", "to_retry", "to_give_back", "to_finish")}
    assert busy == set()

    moved, orphans = asyncio.run(_rescue_as(granted.url("acker")))
    assert sorted((i, s) for i, _, s in moved) == sorted(
        [(todo["out_of_attempts"], "failed"), (todo["lease_expired"], "pending")]
    )
    assert orphans == 1  # the done todo's; the failed one's was released by the rescue
    assert db.query(admin, "SELECT waiting_for FROM ack_queue") == [(None,), (None,)]

    rows = db.query(
        admin, "SELECT idempotency_key, status, attempts, run_after > now() FROM todos WHERE status <> 'done'"
    )
    assert {k: (s, a, later) for k, s, a, later in rows} == {
        "k-out_of_attempts": ("failed", 3, False),
        "k-lease_expired": ("pending", 1, False),  # due at once
        "k-to_fail": ("failed", 1, False),
        "k-to_retry": ("pending", 1, True),  # due after its backoff
        "k-to_give_back": ("pending", 0, False),  # its attempt uncounted
        "k-cancelled_under": ("cancelled", 1, False),  # the late end discarded
        "k-cancelled": ("cancelled", 1, False),
    }
    history = db.query(admin, "SELECT todo_id, from_status, to_status FROM todo_events ORDER BY todo_id, id")
    assert history == [
        (todo["out_of_attempts"], "running", "failed"),
        (todo["lease_expired"], "running", "pending"),
        (todo["to_fail"], "pending", "running"),
        (todo["to_fail"], "running", "failed"),
        (todo["to_retry"], "dispatched", "running"),
        (todo["to_retry"], "running", "pending"),
        (todo["to_give_back"], "pending", "running"),
        (todo["to_give_back"], "running", "pending"),
        (todo["to_finish"], "pending", "running"),
        (todo["to_finish"], "running", "done"),
        (todo["cancelled_under"], "pending", "running"),
        (todo["cancelled_under"], "running", "cancelled"),
    ]


async def _rescue_as(url: str) -> tuple[list[tuple[int, str, str]], int]:
    """One pass of the rescuer (backhalf.lifecycle.rescue), as ``url``'s user."""
    async with await psycopg.AsyncConnection.connect(libpq_url(url)) as conn:
        async with conn.cursor() as cur:
            moved = await todos.rescue(cur, [("orders", 3)], 100)
            orphans = await todos.release_orphaned_acks(cur, 100)
        await conn.commit()
    return moved, orphans


def test_a_run_leaves_exactly_the_files_policies(granted: RoleDatabase) -> None:
    """A policy an earlier version of the file made, and this one no longer
    does (a permissive one would widen every rule above), is dropped by the
    next run; a policy of another name (an operator's own) is left alone."""
    admin = granted.admin_url
    names = "SELECT tablename, policyname FROM pg_policies WHERE schemaname = 'public'"
    made = set(db.query(admin, names))
    with psycopg.connect(libpq_url(admin), autocommit=True) as conn:
        for name in (granted.role("acker_delete_everything"), "site_auditor_read"):
            conn.execute(
                sql.SQL("CREATE POLICY {} ON inbox FOR DELETE TO {} USING (true)").format(
                    sql.Identifier(name), sql.Identifier(granted.role("acker"))
                )
            )
    run_roles_sql(admin, granted.prefix)
    assert set(db.query(admin, names)) == made | {("inbox", "site_auditor_read")}


# Held uncommitted under an operator's cancel of the same todo: the
# rescuer's put-back of a lapsed claim, and a worker's claim.
OVERTAKING = {
    "rescue": (
        "acker",
        "running",
        queries.RESCUE_TODOS,
        {"queues": ["orders"], "max_attempts": [3], "limit": 10, "lease_error": todos.LEASE_EXPIRED_ERROR,
         "lease_detail": todos.RESCUED_LEASE},
        ("running", "pending"),
    ),
    "claim": (
        "worker",
        "pending",
        queries.CLAIM_TODOS,
        {"queues": ["orders"], "limits": [10], "limit": 10, "lease_s": 60.0, "detail": todos.CLAIMED},
        ("pending", "running"),
    ),
}  # fmt: skip


@pytest.mark.parametrize("overtaking", sorted(OVERTAKING))
def test_a_cancel_another_roles_commit_overtakes_is_allowed(granted: RoleDatabase, overtaking: str) -> None:
    """The policies read a todo's status before a change in the statement's
    snapshot; an operator's cancel (cancel_todos) logs the status it locked.
    When the rescuer's put-back or a worker's claim of the same todo commits
    between the two (the cancel waits for its row lock), the cancel is one
    of the operator's pairs either way and is allowed."""
    role, status, statement, params, change = OVERTAKING[overtaking]
    admin = granted.admin_url
    todo_id = db.scalar(
        admin,
        "INSERT INTO todos (queue, idempotency_key, payload, status, attempts, lease_until)"
        " VALUES ('orders', 'k1', '{}', %(s)s, %(a)s, now() - interval '1 minute') RETURNING id",
        {"s": status, "a": 1 if status == "running" else 0},
    )
    with psycopg.connect(libpq_url(granted.url(role))) as first:
        assert [int(r[0]) for r in first.execute(statement, params).fetchall()] == [todo_id]
        with (
            psycopg.connect(libpq_url(granted.url("operator")), autocommit=True) as operator,
            ThreadPoolExecutor(1) as pool,
        ):
            cancel = pool.submit(
                lambda: operator.execute(
                    queries.CANCEL_TODOS, {"ids": [todo_id], "detail": "cancelled by an operator"}
                ).fetchall()
            )
            wait_for(
                lambda: (
                    db.scalar(
                        admin,
                        "SELECT count(*) FROM pg_stat_activity"
                        " WHERE usename = %(u)s AND wait_event_type = 'Lock'",
                        {"u": granted.login("operator")},
                    )
                    == 1
                ),
                timeout_s=10,
                what=f"the operator's cancel waiting for the {role}'s row lock",
            )
            first.commit()
            assert cancel.result(timeout=10) == [(todo_id,)]
    assert db.query(admin, "SELECT from_status, to_status FROM todo_events ORDER BY id") == [
        change,
        (change[1], "cancelled"),
    ]
    assert db.scalar(admin, "SELECT status FROM todos") == "cancelled"
