"""Least privilege (issue 15): the whole pipeline under the shipped
PostgreSQL roles (``ops/roles.sql``) and Redis ACL users
(``ops/redis-users.acl``), each process as its own role and user, and every
forbidden operation refused with a permission error.

``ops/roles.sql`` is run as written, except that its role names get a prefix
unique to the test run (roles are cluster-wide, and the suite may share a
server); the roles are dropped at the end. The database is created empty, the
file run, ``switchboard migrate`` run as the migrator, the file run again (as
the file says to), then ``ingest``, ``ack`` and ``worker`` started, each with
the database URL of its own login user and the broker user of its role.
``status`` and ``prune`` run as the acker's login user (ops/README.md)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Callable, Iterator, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import psycopg.sql
import pytest
import redis
from sqlalchemy.engine import make_url

from backhalf.db import libpq_url
from backhalf.housekeeping import partitions
from ingest.adapters.redis.lists import processing_key
from ingest.embedded.processes import wait_for, wait_ready
from ingest.embedded.servers import RedisServer
from tests.support import db, handlers
from tests.support.acl import password_for, shipped_acl_redis
from tests.support.config import stream_adapter, write_config
from tests.support.downstream import FAST_RESCUE, QUEUE, SHORT_LEASE, statuses
from tests.support.processes import Processes, assert_clean_exit, switchboard
from tests.support.roles import (
    INSUFFICIENT_PRIVILEGE,
    RoleDatabase,
    migrate_and_grant,
    role_database,
    roles_sql,
    run_roles_sql,
    sqlstate,
)
from tests.support.servers import ServerUrls
from tests.support.streams import produce, xpending

pytestmark = pytest.mark.system

N = 20


@pytest.fixture
def roles_db(servers: ServerUrls) -> Iterator[RoleDatabase]:
    with role_database(servers.database) as rdb:
        yield rdb


@pytest.fixture
def acl_redis() -> Iterator[RedisServer]:
    with shipped_acl_redis() as server:
        yield server


def _redis_as(server: RedisServer, user: str | None, db_number: int = 0) -> str:
    """The server's URL as ``user`` (None: the default user, the file's admin)."""
    credentials = f"{user or 'default'}:{password_for(user or 'default')}@"
    return f"redis://{credentials}127.0.0.1:{server.port}/{db_number}"


# The adapters' broker credentials come from these variables (username_env,
# password_env), which each process gets from its environment.
USER_VARIABLE, PASSWORD_VARIABLE = "SB_TEST_BROKER_USER", "SB_TEST_BROKER_PASSWORD"


def _broker_env(role: str) -> dict[str, str]:
    user = "switchboard-ingester" if role == "ingester" else "switchboard-acker"
    return {USER_VARIABLE: user, PASSWORD_VARIABLE: password_for(user)}


def _config(path: Path, rdb: RoleDatabase, role: str, server: RedisServer) -> Path:
    """One process role's config: its database login, its broker user for the
    adapters (from the environment: ``_broker_env``). The workers reach no
    Redis at all (their broker is PostgreSQL): their config names no
    credentials."""
    broker = _redis_as(server, None)
    credentials = (
        {"username_env": USER_VARIABLE, "password_env": PASSWORD_VARIABLE} if role != "worker" else {}
    )
    adapters: list[Mapping[str, Any]] = [
        stream_adapter(
            "orders", ack_after="complete", batch_size=50, url=broker, retain_acked_days=1, **credentials
        ),
        {
            "name": "jobs",
            "mode": "list",
            "source": "jobs",
            "queue": "jobs",
            "batch_size": 50,
            "block_ms": 200,
            "url": broker,
            "retain_acked_days": 1,
            **credentials,
        },
    ]
    return write_config(
        path,
        database_url=rdb.url(role),
        redis_url=broker,
        adapters=adapters,
        # retain_done_days: the pruner's todo walk, under the acker's policies.
        queues={"orders": {**QUEUE, "retain_done_days": 1}, "jobs": {**QUEUE, "retain_done_days": 1}},
    )


def test_the_pipeline_runs_under_the_shipped_roles_and_users(
    tmp_path: Path, roles_db: RoleDatabase, acl_redis: RedisServer, procs: Processes
) -> None:
    migrated = switchboard("migrate", env={"SWITCHBOARD_DATABASE_URL": roles_db.url("migrator")})
    assert migrated.returncode == 0, migrated.stdout + migrated.stderr
    assert db.scalar(roles_db.admin_url, "SELECT tableowner FROM pg_tables WHERE tablename = 'inbox'") == (
        roles_db.role("migrator")
    )
    run_roles_sql(roles_db.admin_url, roles_db.prefix)  # after migrate: the grants
    run_roles_sql(roles_db.admin_url, roles_db.prefix)  # and again: it is idempotent
    handlers.create_runs_table(libpq_url(roles_db.admin_url))
    configs = {
        role: _config(tmp_path / f"{role}.toml", roles_db, role, acl_redis)
        for role in ("ingester", "acker", "worker")
    }

    with redis.Redis.from_url(acl_redis.url, socket_timeout=10) as producer:  # the default user
        produce(acl_redis.url, "orders", N)
        producer.lpush("jobs", *(json.dumps({"job": i}) for i in range(N)))
    handler_env = {handlers.DB_VARIABLE: libpq_url(roles_db.admin_url)}
    ingester = procs.start("ingest", configs["ingester"], name="ingester-1", env=_broker_env("ingester"))
    acker = procs.start("ack", configs["acker"], name="acker-1", env=_broker_env("acker"))
    worker = procs.start("worker", configs["worker"], name="worker-1", env=handler_env)
    for proc in (ingester, acker, worker):
        wait_ready(proc)
    admin = roles_db.admin_url
    wait_for(lambda: statuses(admin) == {"done": 2 * N}, timeout_s=60, what=f"{2 * N} todos done")
    wait_for(
        lambda: db.scalar(admin, "SELECT count(*) FROM inbox WHERE ack_state = 'acked'") == 2 * N,
        timeout_s=30,
        what="every message acked",
    )
    assert db.scalar(admin, "SELECT count(*) FROM handler_runs WHERE outcome = 'done'") == 2 * N
    # ack_after = "complete": no ack before its todo ended (release_acks ran as the worker).
    early = db.scalar(
        admin,
        "SELECT count(*) FROM inbox i JOIN todos t ON t.id = i.todo_id"
        " WHERE i.adapter = 'orders' AND NOT i.acked_at >= t.updated_at",
    )
    assert early == 0
    assert xpending(acl_redis.url, "orders") == 0
    with redis.Redis.from_url(acl_redis.url, socket_timeout=10) as r:
        assert r.llen("jobs") == 0
        assert r.llen(processing_key("jobs", "ingester-1")) == 0
    users = db.query(admin, "SELECT DISTINCT verify_detail FROM events ORDER BY 1")
    assert users == [("redis acl: switchboard-ingester",)]
    heartbeats = db.query(admin, "SELECT DISTINCT role FROM processes ORDER BY 1")
    assert {r for (r,) in heartbeats} >= {"ingest", "ack", "worker"}

    status = switchboard("--config", str(configs["acker"]), "status", env=_broker_env("acker"))
    assert status.returncode == 0, status.stdout + status.stderr
    for name in ("orders", "jobs"):
        assert name in status.stdout
    prune = switchboard("--config", str(configs["acker"]), "prune", env=_broker_env("acker"))
    assert prune.returncode == 0, prune.stdout + prune.stderr
    # The read-only operator commands work as the acker too (ops/README.md).
    key = db.scalar(admin, "SELECT idempotency_key FROM inbox WHERE adapter = 'orders' LIMIT 1")
    for command in (("trace", key), ("inbox", "list")):  # trace reads every table of a message
        done = switchboard("--config", str(configs["acker"]), *command, env=_broker_env("acker"))
        assert done.returncode == 0, done.stdout + done.stderr
    # Retention under the acker's row policies: everything here is acked and
    # done, so once older than its retention it all goes, with its events and
    # todo_events (the policies let the pruner take exactly that).
    # Every row with the rows written beside it (the pruner takes a row only
    # with its event, a todo only with its history, each past its floor).
    db.query(admin, "UPDATE inbox SET stored_at = stored_at - interval '2 days'")
    db.query(admin, "UPDATE events SET received_at = received_at - interval '2 days'")
    db.query(
        admin,
        "UPDATE todos SET created_at = created_at - interval '2 days',"
        " updated_at = updated_at - interval '2 days'",
    )
    db.query(admin, "UPDATE todo_events SET created_at = created_at - interval '2 days'")
    aged = switchboard("--config", str(configs["acker"]), "prune", env=_broker_env("acker"))
    assert aged.returncode == 0, aged.stdout + aged.stderr
    left = db.query(
        admin,
        "SELECT (SELECT count(*) FROM inbox), (SELECT count(*) FROM events), (SELECT count(*) FROM todos),"
        " (SELECT count(*) FROM todo_events)",
    )
    assert left == [(0, 0, 0, 0)]  # inbox, events, todos, todo_events

    for proc in (ingester, acker):
        assert_clean_exit(proc, proc.stop())
    assert worker.terminate() == 0, worker.raw_log()[-3000:]
    with redis.Redis.from_url(acl_redis.url, socket_timeout=10) as r:
        # Valkey logs every command or key an ACL refused, swallowed or not.
        assert r.acl_log() == []
    logs = procs.logs_text() + "".join(c.stdout + c.stderr for c in (status, prune, aged))
    for user in ("switchboard-ingester", "switchboard-acker"):  # from the environment only
        assert password_for(user) not in logs
        assert all(password_for(user) not in path.read_text() for path in configs.values())
    assert "NOPERM" not in logs
    assert "permission denied" not in logs
    assert "InsufficientPrivilege" not in logs
    assert "row-level security" not in logs


def test_the_todo_lifecycle_runs_under_the_shipped_roles(
    tmp_path: Path, roles_db: RoleDatabase, servers: ServerUrls, procs: Processes
) -> None:
    """Workers on PostgreSQL (issue 42), each step as the role that takes it:
    the worker's claims, lease extensions, retries and ends as the worker's
    login; the rescue of a claim whose worker was killed -9 as the acker's;
    `todos cancel` of a running todo (its late end discarded) and `todos
    retry` of a failed one as the operator's. Every change lands, and none
    was refused on the way."""
    migrate_and_grant(roles_db)
    admin = roles_db.admin_url
    handlers.create_runs_table(libpq_url(admin))
    extra: dict[str, dict[str, Mapping[str, int]]] = {
        "acker": {"acker": FAST_RESCUE},
        "worker": {"worker": SHORT_LEASE},  # a killed worker's claims lapse within the bounded wait
        "operator": {},
    }
    configs = {
        role: write_config(
            tmp_path / f"{role}.toml",
            database_url=roles_db.url(role),
            redis_url=servers.redis,  # no adapter: nothing here reads a broker
            adapters=[],
            queues={"orders": QUEUE},
            **extra[role],
        )
        for role in extra
    }
    max_attempts = QUEUE["max_attempts"]
    assert isinstance(max_attempts, int)
    payloads = {
        "killed": {"n": 0, "sleep_s": 30},  # its worker is killed -9 mid-run
        "failing": {"n": 1, "fail_times": max_attempts},  # fails every attempt
        "cancelled": {"n": 2, "sleep_s": 6},  # cancelled while it runs
        "quick": {"n": 3},
    }
    todo = {
        name: db.scalar(
            admin,
            "WITH t AS (INSERT INTO todos (queue, idempotency_key, payload)"
            " VALUES ('orders', %(k)s, %(p)s) RETURNING id),"
            " logged AS (INSERT INTO todo_events (todo_id, from_status, to_status, detail)"
            " SELECT id, NULL, 'pending', 'created' FROM t)"
            " SELECT id FROM t",
            {"k": f"k-{name}", "p": json.dumps(payload)},
        )
        for name, payload in payloads.items()
    }
    handler_env = {handlers.DB_VARIABLE: libpq_url(admin)}
    acker = procs.start("ack", configs["acker"], name="acker-1")
    worker = procs.start("worker", configs["worker"], name="worker-1", env=handler_env,
                         args=["--processes", "1", "--threads", "4"])  # fmt: skip

    def status_of(name: str) -> str:
        return str(db.scalar(admin, "SELECT status FROM todos WHERE id = %(t)s", {"t": todo[name]}))

    def started(name: str) -> bool:
        runs = "SELECT count(*) FROM handler_runs WHERE todo_id = %(t)s AND outcome = 'started'"
        return bool(db.scalar(admin, runs, {"t": todo[name]}))

    wait_for(
        lambda: (status_of("failing"), status_of("quick")) == ("failed", "done")
        and started("killed") and started("cancelled"),
        timeout_s=60,
        what="the failing todo failed, the quick one done, the two long ones running",
    )  # fmt: skip

    def operator(*args: str) -> subprocess.CompletedProcess[str]:
        done = switchboard("--config", str(configs["operator"]), "todos", *args)
        assert done.returncode == 0, done.stdout + done.stderr
        return done

    cancelled = operator("cancel", str(todo["cancelled"])).stdout
    assert cancelled.startswith(f"todo {todo['cancelled']}: cancelled (was running")
    # Its run goes on to its end, which is discarded: the todo stays cancelled.
    wait_for(
        lambda: any(e.get("todo_id") == todo["cancelled"] for e in worker.events("todo_result_discarded")),
        timeout_s=30,
        what="the cancelled todo's late end discarded",
    )
    assert status_of("cancelled") == "cancelled"

    # The rescued run and the retried todo must succeed.
    db.query(admin, "UPDATE todos SET payload = payload - 'sleep_s' - 'fail_times'")
    (pid,) = db.query(admin, "SELECT pid FROM handler_runs WHERE todo_id = %(t)s", {"t": todo["killed"]})[0]
    os.kill(pid, signal.SIGKILL)
    worker.wait(30)  # dramatiq's main process ends when one of its worker processes dies
    wait_for(lambda: status_of("killed") == "pending", timeout_s=30, what="the killed run's claim rescued")
    operator("retry", str(todo["failing"]))
    second = procs.start("worker", configs["worker"], name="worker-2", env=handler_env)
    wait_for(lambda: statuses(admin) == {"done": 3, "cancelled": 1}, timeout_s=60, what="the rest done")
    assert second.terminate() == 0, second.raw_log()[-3000:]
    assert_clean_exit(acker, acker.terminate())

    def trail(name: str) -> list[tuple[Any, ...]]:
        return db.query(
            admin,
            "SELECT from_status, to_status, detail FROM todo_events WHERE todo_id = %(t)s ORDER BY id",
            {"t": todo[name]},
        )

    assert [(f, t) for f, t, _ in trail("killed")] == [
        (None, "pending"), ("pending", "running"), ("running", "pending"), ("pending", "running"),
        ("running", "done"),
    ]  # fmt: skip
    assert trail("killed")[2][2] == "rescued: its lease expired"  # by the acker's login
    retries = [("pending", "running"), ("running", "pending")] * (max_attempts - 1)
    assert [(f, t) for f, t, _ in trail("failing")] == [
        (None, "pending"), *retries, ("pending", "running"), ("running", "failed"),
        ("failed", "pending"), ("pending", "running"), ("running", "done"),
    ]  # fmt: skip
    assert [(f, t) for f, t, _ in trail("cancelled")] == [
        (None, "pending"), ("pending", "running"), ("running", "cancelled"),
    ]  # fmt: skip
    assert db.scalar(admin, "SELECT attempts FROM todos WHERE id = %(t)s", {"t": todo["failing"]}) == 1
    logs = procs.logs_text()
    for refused in ("permission denied", "InsufficientPrivilege", "row-level security", "todo_state_refused",
                    "todo_ends_not_written", "todo_leases_not_extended", "todo_claim_failed"):  # fmt: skip
        assert refused not in logs, refused


def test_each_role_is_refused_what_it_is_not_granted(roles_db: RoleDatabase) -> None:
    migrated = switchboard("migrate", env={"SWITCHBOARD_DATABASE_URL": roles_db.url("migrator")})
    assert migrated.returncode == 0, migrated.stdout + migrated.stderr
    run_roles_sql(roles_db.admin_url, roles_db.prefix)
    admin = roles_db.admin_url
    # One stored message, its ack queued and waiting: what each role might tamper with.
    db.query(
        admin,
        "INSERT INTO adapters (name, transport, mode) VALUES ('orders', 'redis', 'stream')",
    )
    todo_id = db.scalar(
        admin,
        "INSERT INTO todos (queue, idempotency_key, payload) VALUES ('orders', 'k1', '{}') RETURNING id",
    )
    inbox_id = db.scalar(
        admin,
        "INSERT INTO inbox (adapter, idempotency_key, source_message_id, body, ack_kind, ack_key, ack_group,"
        " ack_entry_id, ack_after, ack_state, status, todo_id)"
        " VALUES ('orders', 'k1', '1-0', '\\x7b7d', 'xack', 'orders', 'switchboard', '1-0', 'complete',"
        " 'pending', 'stored', %(todo)s) RETURNING id",
        {"todo": todo_id},
    )
    db.query(
        admin,
        "INSERT INTO ack_queue (inbox_id, adapter, ack_kind, ack_key, idempotency_key, waiting_for)"
        " VALUES (%(inbox)s, 'orders', 'xack', 'orders', 'k1', %(todo)s)",
        {"inbox": inbox_id, "todo": todo_id},
    )
    # A push adapter of the receiver's, on a queue of its own.
    db.query(
        admin,
        "INSERT INTO adapters (name, family, transport, mode, settings)"
        """ VALUES ('billing', 'push', 'webhook', 'standard-webhooks', '{"queue": "billing"}')""",
    )
    db.query(admin, """UPDATE adapters SET settings = '{"queue": "orders"}' WHERE name = 'orders'""")
    ids = {"inbox": inbox_id, "todo": todo_id}
    ingester, receiver, acker, worker, auditor = (
        roles_db.url(r) for r in ("ingester", "receiver", "acker", "worker", "auditor")
    )
    push_row = (
        "INSERT INTO inbox (adapter, idempotency_key, source_message_id, body, ack_kind, ack_key, ack_group,"
        " ack_entry_id, ack_state, status) VALUES ({adapter}, 'webhook:billing:d1', 'd1', '\\x7b7d', {kind},"
        " {key}, {group}, {entry}, {state}, 'stored')"
    )
    refused = {
        # No role but the ingester sets an ack target, and the ingester only on
        # a row it is storing again (which takes this transaction's ack_xid):
        # never repointed to another group or entry in place.
        "ingester UPDATE inbox ack_group": (
            ingester,
            "UPDATE inbox SET ack_group = 'someone-elses-group' WHERE id = %(inbox)s",
        ),
        "ingester UPDATE inbox ack_entry_id": (
            ingester,
            "UPDATE inbox SET ack_entry_id = '9-0' WHERE id = %(inbox)s",
        ),
        "ingester INSERT a verified event": (
            ingester,
            "INSERT INTO events (family, adapter, trust_mode, verified, verify_detail, idempotency_key,"
            " payload) VALUES ('push', 'billing', 'hmac-sha256', true, 'standard-webhooks', 'forged', '{}')",
        ),
        "ingester INSERT todos on a queue of none of its adapters": (
            ingester,
            "INSERT INTO todos (queue, idempotency_key, payload) VALUES ('payments', 'k7', '{}')",
        ),
        "ingester INSERT inbox of a push adapter": (
            ingester,
            push_row.format(
                adapter="'billing'", kind="'none'", key="NULL", group="NULL", entry="NULL", state="'none'"
            ),
        ),
        "ingester heartbeat as the receiver": (
            ingester,
            "INSERT INTO processes (instance, role, host, pid, started_at, seen_at)"
            " VALUES (gen_random_uuid(), 'receive', 'h', 1, now(), now())",
        ),
        # The receiver: its push adapters' rows, with no ack target, nothing more.
        "receiver INSERT inbox with an ack target": (
            receiver,
            push_row.format(
                adapter="'billing'",
                kind="'xack'",
                key="'orders'",
                group="'switchboard'",
                entry="'1-0'",
                state="'pending'",
            ),
        ),
        "receiver INSERT inbox of a pull adapter": (
            receiver,
            push_row.format(
                adapter="'orders'", kind="'none'", key="NULL", group="NULL", entry="NULL", state="'none'"
            ),
        ),
        "receiver INSERT a pull event": (
            receiver,
            "INSERT INTO events (family, adapter, trust_mode, verified, verify_detail, idempotency_key,"
            " payload) VALUES ('queue', 'orders', 'queue', false, 'redis acl: x', 'forged', '{}')",
        ),
        "receiver INSERT todos on a pull adapter's queue": (
            receiver,
            "INSERT INTO todos (queue, idempotency_key, payload) VALUES ('orders', 'k8', '{}')",
        ),
        "receiver INSERT ack_queue": (
            receiver,
            "INSERT INTO ack_queue (inbox_id, adapter, ack_kind, ack_key, idempotency_key)"
            " VALUES (%(inbox)s, 'orders', 'xack', 'orders', 'k1')",
        ),
        "receiver DELETE inbox": (receiver, "DELETE FROM inbox WHERE id = %(inbox)s"),
        "receiver UPDATE todos.status": (receiver, "UPDATE todos SET status = 'done' WHERE id = %(todo)s"),
        "receiver UPDATE adapters.enabled": (receiver, "UPDATE adapters SET enabled = false"),
        "receiver heartbeat as the ingester": (
            receiver,
            "INSERT INTO processes (instance, role, host, pid, started_at, seen_at)"
            " VALUES (gen_random_uuid(), 'ingest', 'h', 1, now(), now())",
        ),
        # The acker marks acks and moves todos, but creates none, and no inbox row.
        "acker INSERT todos": (
            acker,
            "INSERT INTO todos (queue, idempotency_key, payload) VALUES ('orders', 'k2', '{}')",
        ),
        "acker UPDATE todos.payload": (acker, "UPDATE todos SET payload = '{}' WHERE id = %(todo)s"),
        "acker INSERT inbox": (
            acker,
            "INSERT INTO inbox (adapter, idempotency_key, body, ack_kind, ack_state, status)"
            " VALUES ('orders', 'k3', '\\x00', 'none', 'none', 'stored')",
        ),
        "acker UPDATE adapters.enabled": (acker, "UPDATE adapters SET enabled = false"),
        # The ingester cannot mark an ack (row-level policy), drop a queued
        # one, release a waiting one, or flip the operator's flag.
        "ingester UPDATE inbox ack_state acked": (
            ingester,
            "UPDATE inbox SET ack_state = 'acked' WHERE id = %(inbox)s",
        ),
        "ingester UPDATE inbox acked_at": (
            ingester,
            "UPDATE inbox SET acked_at = now() WHERE id = %(inbox)s",
        ),
        "ingester INSERT acked inbox row": (
            ingester,
            "INSERT INTO inbox (adapter, idempotency_key, body, ack_kind, ack_state, status)"
            " VALUES ('orders', 'k4', '\\x00', 'xack', 'acked', 'stored')",
        ),
        "ingester DELETE ack_queue": (ingester, "DELETE FROM ack_queue WHERE inbox_id = %(inbox)s"),
        "ingester UPDATE ack_queue": (
            ingester,
            "UPDATE ack_queue SET waiting_for = NULL WHERE inbox_id = %(inbox)s",
        ),
        # ... or move an adapter's ack cursor past acks owed, or a row behind it.
        "ingester UPDATE inbox ack_xid behind the cursor": (
            ingester,
            "UPDATE inbox SET ack_xid = 1 WHERE id = %(inbox)s",
        ),
        "ingester UPDATE ack_cursors": (ingester, "UPDATE ack_cursors SET xid = xid + 1000"),
        "ingester INSERT ack_cursors": (
            ingester,
            "INSERT INTO ack_cursors (adapter, xid, inbox_id) VALUES ('orders', 9223372036854775807, 0)",
        ),
        "ingester UPDATE adapters.enabled": (ingester, "UPDATE adapters SET enabled = false"),
        "ingester UPDATE todos.status": (ingester, "UPDATE todos SET status = 'done' WHERE id = %(todo)s"),
        # The worker touches no inbox row and creates no todo.
        "worker SELECT inbox": (worker, "SELECT count(*) FROM inbox"),
        "worker INSERT inbox": (
            worker,
            "INSERT INTO inbox (adapter, idempotency_key, body, ack_kind, ack_state, status)"
            " VALUES ('orders', 'k5', '\\x00', 'none', 'none', 'stored')",
        ),
        "worker INSERT todos": (
            worker,
            "INSERT INTO todos (queue, idempotency_key, payload) VALUES ('orders', 'k6', '{}')",
        ),
        "worker DELETE ack_queue": (worker, "DELETE FROM ack_queue WHERE inbox_id = %(inbox)s"),
        "worker UPDATE ack_queue (not a release)": (
            worker,
            "UPDATE ack_queue SET waiting_for = waiting_for + 1 WHERE inbox_id = %(inbox)s",
        ),
        "worker UPDATE ack_cursors": (worker, "UPDATE ack_cursors SET xid = xid + 1000"),
        # The auditor reads the audit views and nothing else.
        "auditor SELECT inbox": (auditor, "SELECT count(*) FROM inbox"),
        "auditor SELECT todos": (auditor, "SELECT count(*) FROM todos"),
        "auditor SELECT events": (auditor, "SELECT count(*) FROM events"),
        "auditor UPDATE adapters": (auditor, "UPDATE adapters SET enabled = false"),
        # No process role may change the schema.
        "ingester CREATE TABLE": (ingester, "CREATE TABLE sneaky (id int)"),
        "acker DROP TABLE": (acker, "DROP TABLE todos"),
    }
    got = {what: sqlstate(url, statement, ids) for what, (url, statement) in refused.items()}
    assert got == dict.fromkeys(refused, INSUFFICIENT_PRIVILEGE)
    # Rows a role's policies do not let it change are not there for its
    # UPDATE at all: no error, and no row changed (asserted below).
    unseen = {
        "receiver UPDATE inbox ack_state acked": (
            receiver,
            "UPDATE inbox SET ack_state = 'acked', acked_at = now() WHERE id = %(inbox)s",
        ),
        "receiver UPDATE inbox ack_group": (
            receiver,
            "UPDATE inbox SET ack_group = 'someone-elses-group' WHERE id = %(inbox)s",
        ),
        "ingester UPDATE a push adapter": (
            ingester,
            "UPDATE adapters SET settings = '{}' WHERE name = 'billing'",
        ),
        "receiver UPDATE a pull adapter": (
            receiver,
            "UPDATE adapters SET settings = '{}' WHERE name = 'orders'",
        ),
    }
    for what, (url, statement) in unseen.items():
        assert sqlstate(url, statement, ids) is None, what
    assert db.query(admin, "SELECT name, settings FROM adapters ORDER BY name") == [
        ("billing", {"queue": "billing"}),
        ("orders", {"queue": "orders"}),
    ]
    # Nothing reached the tables.
    assert db.query(admin, "SELECT ack_state, acked_at, ack_group, ack_entry_id FROM inbox") == [
        ("pending", None, "switchboard", "1-0")
    ]
    assert db.scalar(admin, "SELECT count(*) FROM events") == 0
    assert db.scalar(admin, "SELECT count(*) FROM processes") == 0
    assert db.query(admin, "SELECT waiting_for FROM ack_queue") == [(todo_id,)]
    assert db.scalar(admin, "SELECT count(*) FROM todos") == 1
    assert db.scalar(admin, "SELECT bool_and(enabled) FROM adapters") is True

    # What each is granted works: the auditor's views, the ingester's
    # re-request of an ack, the worker's release, the acker's mark.
    assert sqlstate(auditor, "SELECT * FROM audit_unacked") is None
    assert db.query(auditor, "SELECT adapter FROM audit_unacked") == [("orders",)]
    assert (
        sqlstate(
            ingester, "UPDATE inbox SET ack_state = 'pending', acked_at = NULL WHERE id = %(inbox)s", ids
        )
        is None
    )
    db.query(admin, "UPDATE todos SET status = 'done' WHERE id = %(todo)s", ids)
    assert (
        sqlstate(worker, "UPDATE ack_queue SET waiting_for = NULL WHERE waiting_for = %(todo)s", ids) is None
    )
    assert db.query(admin, "SELECT waiting_for FROM ack_queue") == [(None,)]
    marked = "UPDATE inbox SET ack_state = 'acked', acked_at = now() WHERE id = %(inbox)s"
    assert sqlstate(acker, marked, ids) is None
    assert db.query(admin, "SELECT ack_state FROM inbox") == [("acked",)]
    # A redelivery of the entry asks for its ack again, as store_again_cte
    # does (an update of the row its native key names), and may not mark it
    # acked that way.
    redelivery = (
        "UPDATE inbox SET deliveries = inbox.deliveries + 1, ack_state = {state}, acked_at = NULL"
        " WHERE adapter = 'orders' AND idempotency_key = 'k1' AND source_message_id IS NOT NULL"
    )
    assert sqlstate(ingester, redelivery.format(state="'acked'")) == INSUFFICIENT_PRIVILEGE
    assert sqlstate(ingester, redelivery.format(state="'pending'")) is None
    assert db.query(admin, "SELECT ack_state, acked_at, deliveries FROM inbox") == [("pending", None, 2)]
    # Storing it again (a delivery counted) takes the newest delivery's ref
    # (a JetStream reply subject), with or without an ack_xid (ack_after =
    # "complete" queues the ack instead); in place, without a delivery
    # counted, it may not, even under this transaction's ack_xid.
    in_place = (
        "UPDATE inbox SET ack_entry_id = '1-2', ack_xid = pg_current_xact_id()::text::int8"
        " WHERE id = %(inbox)s"
    )
    assert sqlstate(ingester, in_place, ids) == INSUFFICIENT_PRIVILEGE
    again = redelivery.format(state="'pending'").replace(
        "acked_at = NULL", "acked_at = NULL, ack_entry_id = '1-1'"
    )
    assert sqlstate(ingester, again) is None
    assert db.query(admin, "SELECT ack_entry_id FROM inbox") == [("1-1",)]
    # The receiver stores a push delivery, and its resend.
    push = push_row.format(
        adapter="'billing'", kind="'none'", key="NULL", group="NULL", entry="NULL", state="'none'"
    )
    resend = "UPDATE inbox SET deliveries = inbox.deliveries + 1 WHERE adapter = 'billing'"
    assert sqlstate(receiver, push) is None
    assert sqlstate(receiver, resend) is None
    assert db.query(admin, "SELECT deliveries FROM inbox WHERE adapter = 'billing'") == [(2,)]
    # An AMQP adapter's ingester marks the acks it sent on its own channel,
    # and only those (every other kind is the acker's, refused above).
    db.query(admin, "INSERT INTO adapters (name, transport, mode) VALUES ('rabbit', 'amqp', 'queue')")
    amqp_id = db.scalar(
        admin,
        "INSERT INTO inbox (adapter, idempotency_key, source_message_id, body, ack_kind, ack_key,"
        " ack_entry_id, ack_state, status, ack_xid) VALUES ('rabbit', 'amqp:q:m1', 'm1', '\\x7b7d', 'amqp',"
        " 'q', 's1:1', 'pending', 'stored', 1) RETURNING id",
    )
    own = "UPDATE inbox SET ack_state = 'acked', acked_at = now(), ack_xid = NULL{also} WHERE id = %(id)s"
    assert sqlstate(ingester, own.format(also=", ack_entry_id = 's2:1'"), {"id": amqp_id}) == (
        INSUFFICIENT_PRIVILEGE
    )
    assert sqlstate(ingester, own.format(also=""), {"id": amqp_id}) is None
    assert db.query(admin, "SELECT ack_state FROM inbox WHERE id = %(id)s", {"id": amqp_id}) == [("acked",)]


def test_only_switchboards_roles_connect_to_its_database(roles_db: RoleDatabase) -> None:
    """CONNECT is taken from PUBLIC: a login of the cluster with no grant
    cannot connect, so cannot hold a transaction open here (which would
    hold back the acker's cursor and every stream ack)."""
    stranger = f"{roles_db.prefix}_stranger"
    with psycopg.connect(libpq_url(roles_db.admin_url), autocommit=True, connect_timeout=10) as conn:
        conn.execute(
            psycopg.sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(
                psycopg.sql.Identifier(stranger), psycopg.sql.Literal("stranger-pw")
            )
        )
    try:
        url = make_url(roles_db.admin_url).set(username=stranger, password="stranger-pw")
        with pytest.raises(psycopg.OperationalError, match="permission denied for database"):
            psycopg.connect(libpq_url(url.render_as_string(hide_password=False)), connect_timeout=10).close()
        for role in ("ingester", "receiver", "acker", "worker", "operator", "viewer", "auditor", "migrator"):
            assert sqlstate(roles_db.url(role), "SELECT 1") is None, role
    finally:
        with psycopg.connect(libpq_url(roles_db.admin_url), autocommit=True, connect_timeout=10) as conn:
            conn.execute(psycopg.sql.SQL("DROP ROLE {}").format(psycopg.sql.Identifier(stranger)))


def _client(server: RedisServer, user: str) -> redis.Redis:
    return redis.Redis.from_url(_redis_as(server, user), socket_timeout=10)


def test_each_broker_user_is_refused_what_it_is_not_granted(acl_redis: RedisServer) -> None:
    with redis.Redis.from_url(acl_redis.url, socket_timeout=10) as producer:
        producer.xadd("orders", {"body": "{}"}, id="1-1")
        producer.xgroup_create("orders", "switchboard", id="0")
        producer.rpush(processing_key("jobs", "c1"), "x")
    ingester, acker = (_client(acl_redis, f"switchboard-{role}") for role in ("ingester", "acker"))
    # The acker's own script command (its list acks), declaring a key of its
    # own and reaching for another inside.
    script = "return redis.call('lrem', 'other', 1, 'x')"
    refused: dict[str, Callable[[], object]] = {
        # The ingester reads and claims, and never acks: XACK and LREM are the acker's.
        "ingester XACK": lambda: ingester.xack("orders", "switchboard", "1-1"),
        "ingester LREM": lambda: ingester.lrem(processing_key("jobs", "c1"), 1, "x"),
        "ingester EVAL": lambda: ingester.eval("return 1", 0),
        "ingester XADD": lambda: ingester.xadd("orders", {"body": "{}"}),
        "ingester a key off its patterns": lambda: ingester.get("other:key"),
        # The acker acks and observes, and never reads a message.
        "acker XREADGROUP": lambda: acker.xreadgroup("switchboard", "c1", {"orders": ">"}, count=1),
        "acker XCLAIM": lambda: acker.xclaim("orders", "switchboard", "c1", 0, ["1-1"]),
        "acker XGROUP CREATE": lambda: acker.xgroup_create("orders", "other", id="0"),
        "acker BLMOVE": lambda: acker.blmove("jobs", processing_key("jobs", "c1"), 1),
        "acker LMOVE": lambda: acker.lmove(processing_key("jobs", "c1"), "jobs"),
        "acker SUBSCRIBE": lambda: acker.execute_command("SUBSCRIBE", "notifications"),  # type: ignore[no-untyped-call]
        "acker a key off its patterns": lambda: acker.llen("other:key"),
        "acker script off its keys": lambda: acker.eval(script, 1, "jobs"),
        "acker FLUSHALL": lambda: acker.flushall(),
    }
    outcome: dict[str, str] = {}
    try:
        for what, call in refused.items():
            try:
                call()
                outcome[what] = "allowed"
            except redis.exceptions.NoPermissionError:  # redis-py's class for the NOPERM reply
                outcome[what] = "NOPERM"
            except redis.exceptions.ResponseError as exc:
                outcome[what] = f"{type(exc).__name__}: {exc}"
        # A command a script calls is refused with ERR, not NOPERM: the reply
        # is the script's error, which names the ACL.
        in_script = (
            "ResponseError: ACL failure in script: No permissions to access a key script: on @user_script:1."
        )
        assert outcome == {**dict.fromkeys(refused, "NOPERM"), "acker script off its keys": in_script}
    finally:
        for client in (ingester, acker):
            client.close()
    with redis.Redis.from_url(acl_redis.url, socket_timeout=10) as producer:
        # Nothing refused changed anything.
        assert producer.xpending("orders", "switchboard")["pending"] == 0
        assert producer.lrange(processing_key("jobs", "c1"), 0, -1) == [b"x"]
        assert producer.llen("jobs") == 0
        assert {e["username"] for e in producer.acl_log(count=128)} == {
            "switchboard-ingester", "switchboard-acker",
        }  # fmt: skip


def test_the_file_run_after_a_migrate_as_another_role_hands_the_tables_over(roles_db: RoleDatabase) -> None:
    """Issue 24: "Running it" migrated as the database's owner, then the file
    was run. Its tables are handed to the migrator (a notice says so), so
    `switchboard migrate` as the migrator works after it and the grants and
    policies bind every role as they would have."""
    first = switchboard("migrate", env={"SWITCHBOARD_DATABASE_URL": roles_db.admin_url})
    assert first.returncode == 0, first.stdout + first.stderr
    with psycopg.connect(libpq_url(roles_db.admin_url), autocommit=True, connect_timeout=10) as conn:
        notices: list[str] = []
        conn.add_notice_handler(lambda notice: notices.append(str(notice.message_primary)))
        conn.execute(roles_sql(roles_db.prefix))
    assert any("todos was owned by" in n for n in notices), notices
    owners = db.query(
        roles_db.admin_url,
        "SELECT DISTINCT pg_get_userbyid(relowner) FROM pg_class c"
        " JOIN pg_namespace n ON n.oid = c.relnamespace"
        " WHERE n.nspname = 'public' AND c.relkind IN ('r', 'v', 'S')",
    )
    assert owners == [(roles_db.role("migrator"),)]
    again = switchboard("migrate", env={"SWITCHBOARD_DATABASE_URL": roles_db.url("migrator")})
    assert again.returncode == 0, again.stdout + again.stderr
    # The policies bind the process roles: the acker still cannot finish work.
    db.query(
        roles_db.admin_url, "INSERT INTO todos (queue, idempotency_key, payload) VALUES ('q', 'k', '{}')"
    )
    refused = sqlstate(roles_db.url("acker"), "UPDATE todos SET status = 'done'")
    assert refused == INSUFFICIENT_PRIVILEGE
    assert db.scalar(roles_db.admin_url, "SELECT status FROM todos") == "pending"


def test_every_query_of_ops_audit_sql_runs_as_the_auditor(roles_db: RoleDatabase) -> None:
    """Issue 24: the auditor role reads the audit views only, and ops/audit.sql
    is documented for it: every statement runs under it (a base table read
    would be refused, 42501)."""
    migrate_and_grant(roles_db)
    text = (Path(__file__).parents[2] / "ops" / "audit.sql").read_text()
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("--"))
    statements = [s.strip() for s in code.split(";") if s.strip()]
    assert len(statements) >= 10
    for statement in statements:
        assert sqlstate(roles_db.url("auditor"), statement) is None, statement
    assert sqlstate(roles_db.url("auditor"), "SELECT 1 FROM todos") == INSUFFICIENT_PRIVILEGE


async def test_the_acker_role_begins_the_todos_periods_and_the_migrator_drops_them(
    roles_db: RoleDatabase,
) -> None:
    """Issue 45, decision 0007: the shipped acker may not make or drop
    partitions, finished todos' included: its pass says so and still begins
    a period (todos' identity moved); the migrator's pass drops the old one."""
    migrate_and_grant(roles_db)
    db.query(
        roles_db.admin_url,
        "INSERT INTO todos (queue, idempotency_key, payload, status, created_at, updated_at)"
        " VALUES ('q', 'k', '{}', 'done', now() - interval '10 days', now() - interval '10 days')",
    )
    hour, keep, keep_done = timedelta(hours=1), timedelta(days=30), timedelta(days=7)
    async with await psycopg.AsyncConnection.connect(libpq_url(roles_db.url("acker")), autocommit=True) as pg:
        by_acker = await partitions.upkeep(pg, period=hour, keep=keep, keep_done=keep_done)
    assert by_acker.refused == ["inbox", "events", "todo_events", "todos_done"]
    assert by_acker.begun == {"todos_done": 1}
    assert by_acker.dropped == {}
    async with await psycopg.AsyncConnection.connect(
        libpq_url(roles_db.url("migrator")), autocommit=True
    ) as pg:
        by_migrator = await partitions.upkeep(pg, period=hour, keep=keep, keep_done=keep_done)
    assert by_migrator.refused == []
    assert by_migrator.dropped == {"todos_done": [0]}
    assert db.scalar(roles_db.admin_url, "SELECT count(*) FROM todos") == 0
