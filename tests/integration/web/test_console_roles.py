"""The console (``switchboard web``) under the shipped PostgreSQL roles
(``ops/roles.sql``): as ``switchboard_viewer_login`` it sees every row its
pages read, exactly as the schema's owner does (a row-level policy missing
would hide rows, not fail), may not act (``may_write`` is False, so it
starts read-only), and writes its own heartbeat (role ``web``) and no
other process's; as ``switchboard_operator_login`` it may act and beats too.
The login is the console's only gate on actions in the database: these
are the grants and policies that gate is read from."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy.exc import ProgrammingError
from sqlalchemy.ext.asyncio import AsyncEngine

from backhalf.db import DatabaseSettings, create_engine
from backhalf.housekeeping import heartbeats
from backhalf.reads import console_views, inbox_views, todo_views, trace
from ingest.config import Settings, from_mapping
from ingest.web.figures import read_overview
from ingest.web.server import WRITES, may_write
from tests.support import db
from tests.support.roles import RoleDatabase, migrate_and_grant, role_database
from tests.support.servers import ServerUrls

DEADLINE_MS = 10_000
ENTRY = "1-0"
KEY = f"redis:orders:{ENTRY}"


@pytest.fixture(scope="module")
def granted(servers: ServerUrls) -> Iterator[RoleDatabase]:
    """A database migrated as the migrator, with the file's grants and policies."""
    with role_database(servers.database) as rdb:
        migrate_and_grant(rdb)
        yield rdb


@pytest.fixture(scope="module")
def seeded(granted: RoleDatabase) -> dict[str, int]:
    """What each page shows, written as the superuser: an adapter, a stored
    entry with its event and todo (and its history), a rejected entry, an
    ack queued, and an ingester's heartbeat."""
    admin = granted.admin_url
    db.query(
        admin,
        "INSERT INTO adapters (name, family, transport, mode, settings)"
        " VALUES ('orders', 'queue', 'redis', 'stream', %(s)s::jsonb)",
        {"s": json.dumps({"source": "orders", "key_prefix": "redis", "queue": "orders"})},
    )
    todo = db.scalar(
        admin,
        "INSERT INTO todos (queue, idempotency_key, payload) VALUES ('orders', %(k)s, %(p)s) RETURNING id",
        {"k": KEY, "p": json.dumps({"n": 1})},
    )
    db.query(
        admin,
        "INSERT INTO todo_events (todo_id, from_status, to_status, detail)"
        " VALUES (%(t)s, NULL, 'pending', 'created')",
        {"t": todo},
    )
    event = db.scalar(
        admin,
        "INSERT INTO events (family, adapter, trust_mode, verified, idempotency_key, source_message_id,"
        " payload, todo_id) VALUES ('queue', 'orders', 'queue', false, %(k)s, %(e)s, '{}', %(t)s)"
        " RETURNING id",
        {"k": KEY, "e": ENTRY, "t": todo},
    )
    stored = db.scalar(
        admin,
        "INSERT INTO inbox (adapter, idempotency_key, source_message_id, body, ack_kind, ack_key, ack_group,"
        " ack_entry_id, ack_state, status, todo_id, event_id) VALUES ('orders', %(k)s, %(e)s, '\\x7b7d',"
        " 'xack', 'orders', 'switchboard', %(e)s, 'pending', 'stored', %(t)s, %(ev)s) RETURNING id",
        {"k": KEY, "e": ENTRY, "t": todo, "ev": event},
    )
    db.query(
        admin,
        "INSERT INTO ack_queue (inbox_id, adapter, ack_kind, ack_key, idempotency_key)"
        " VALUES (%(i)s, 'orders', 'xack', 'orders', %(k)s)",
        {"i": stored, "k": KEY},
    )
    rejected = db.scalar(
        admin,
        "INSERT INTO inbox (adapter, idempotency_key, source_message_id, body, ack_kind, ack_state, acked_at,"
        " status, error) VALUES ('orders', 'redis:orders:2-0', '2-0', 'not json', 'xack', 'acked', now(),"
        " 'rejected', 'invalid_json: expecting value') RETURNING id",
    )
    db.query(
        admin,
        "INSERT INTO processes (instance, role, host, pid) VALUES (%(i)s, 'ingest', 'h1', 1)",
        {"i": uuid.uuid4()},
    )
    return {"todo": todo, "event": event, "stored": stored, "rejected": rejected}


def _settings(rdb: RoleDatabase, login: str, redis_url: str) -> Settings:
    adapters = [{"name": "orders", "mode": "stream", "source": "orders", "url": redis_url}]
    return from_mapping({"database": {"url": rdb.url(login)}, "adapters": adapters}, {})


@pytest.fixture
async def engines(granted: RoleDatabase) -> AsyncIterator[dict[str, AsyncEngine]]:
    """An engine per login, made as the console makes its own."""
    urls = {"admin": granted.admin_url, "viewer": granted.url("viewer"), "operator": granted.url("operator")}
    made = {name: create_engine(DatabaseSettings(url=url)) for name, url in urls.items()}
    yield made
    for engine in made.values():
        await engine.dispose()


def _trail(t: trace.Trail) -> tuple[Any, ...]:
    history = [(e.from_status, e.to_status) for e in t.todo_events]
    return t.inbox.id, t.transport, t.event and t.event.id, t.todo and t.todo.id, history


def _adapter(report: Mapping[str, Any]) -> tuple[Any, ...]:
    counts = {k: v for k, v in report.items() if k.endswith(("acks", "stored"))}
    return report["adapter"], report["defined_in"], counts


async def _page_reads(engine: AsyncEngine, settings: Settings, ids: dict[str, int]) -> dict[str, Any]:
    """What each page reads (ingest.web.pages and figures), reduced to values to compare."""
    overview = await read_overview(engine, settings)
    async with engine.connect() as conn:
        by_key = await trace.trails(conn, await trace.inbox_ids_by_key(conn, KEY))
        row = await inbox_views.get_row(conn, ids["rejected"])
        todo = await todo_views.get_todo(conn, ids["todo"])
        return {
            "overview": [_adapter(r) for r in overview.report],
            "overview minutes": {a: sum(m.consumed for m in ms) for a, ms in overview.minutes.items()},
            "overview processes": sorted(p.role for p in overview.processes),
            # What needs attention (ingest.web.attention), but the kinds that
            # change with time alone (a process's silence, a todo's wait).
            "overview attention": {
                a.kind: a.count for a in overview.attention if a.kind in ("failed-todos", "rejected-inbox")
            },
            "processes": sorted(p.role for p in await heartbeats.list_processes(conn)),
            "trail": [_trail(t) for t in by_key],
            "trail by todo": await trace.inbox_ids_by_todo(conn, ids["todo"]),
            "trail by entry id": await trace.inbox_ids_by_entry_id(conn, ENTRY),
            "rejected": [
                r.id for r in await inbox_views.replay_candidates(conn, inbox_views.ReplayFilter(), limit=51)
            ],
            "inbox row": row and (row.body, row.error),
            "todos": [t.id for t in await todo_views.list_todos(conn, todo_views.TodoQuery(limit=51))],
            "todo": todo and (todo.status, todo.payload),
            "history": [(e.from_status, e.to_status) for e in await todo_views.history(conn, ids["todo"])],
            "charts": [(m.adapter, m.consumed, m.rejected) for m in await console_views.recent_minutes(conn)],
        }


async def test_the_viewer_reads_every_page_as_the_owner_does_and_may_not_act(
    granted: RoleDatabase, seeded: dict[str, int], engines: dict[str, AsyncEngine], servers: ServerUrls
) -> None:
    as_owner = await _page_reads(engines["admin"], _settings(granted, "viewer", servers.redis), seeded)
    as_viewer = await _page_reads(engines["viewer"], _settings(granted, "viewer", servers.redis), seeded)
    assert as_viewer == as_owner
    # Every read found what the seed wrote: equal, and not equally empty.
    assert as_viewer["trail"] == [
        (seeded["stored"], "redis", seeded["event"], seeded["todo"], [(None, "pending")])
    ]
    assert as_viewer["rejected"] == [seeded["rejected"]]
    assert as_viewer["overview attention"] == {"rejected-inbox": 1}
    assert as_viewer["inbox row"] == (b"not json", "invalid_json: expecting value")
    assert as_viewer["todos"] == [seeded["todo"]]
    assert as_viewer["history"] == [(None, "pending")]
    assert as_viewer["trail by todo"] == as_viewer["trail by entry id"] == [seeded["stored"]]
    assert as_viewer["overview minutes"] == {"orders": 2}
    assert as_viewer["overview"] == [("orders", "config", {"pending_acks": 1, "stored": 1})]
    assert "ingest" in as_viewer["processes"]
    # It may not act: each privilege the actions need is refused, so the
    # console starts read-only; the operator holds every one.
    assert not await may_write(engines["viewer"], DEADLINE_MS)
    assert await may_write(engines["operator"], DEADLINE_MS)
    for name, expected in (("viewer", False), ("operator", True)):
        async with engines[name].connect() as conn:
            for table, column, kind in WRITES:
                held = await conn.scalar(sa.select(sa.func.has_column_privilege(table, column, kind)))
                assert held is expected, (name, table, column, kind)


def _beat_and_forget(engine: sa.Engine, role: str) -> tuple[int, list[tuple[str, bool]]]:
    """The heartbeat loop's statements, as ``ingest.observe.heartbeat`` runs
    them: the first beat with the day-silent clean-up, a beat again (the
    ON CONFLICT update), the stop. Returns the rows forgotten, and the rows
    of this instance as the login reads them."""
    instance = uuid.uuid4()
    with engine.begin() as conn:
        conn.execute(heartbeats.beat_statement(instance, role, "h1", 1, {"listen": "127.0.0.1:8089"}))
        forgotten = conn.execute(heartbeats.forget_statement()).rowcount
    with engine.begin() as conn:
        conn.execute(heartbeats.beat_statement(instance, role, "h1", 1, {"listen": "127.0.0.1:8089"}))
        conn.execute(heartbeats.stopped_statement(instance))
        rows = conn.execute(
            sa.text("SELECT role, stopped_at IS NOT NULL FROM processes WHERE instance = :i"), {"i": instance}
        ).all()
    return forgotten, [(str(r), bool(s)) for r, s in rows]


def _silent_for_days(admin: str) -> uuid.UUID:
    """The one row a day silent (another test's left none behind)."""
    db.query(admin, "DELETE FROM processes WHERE seen_at < now() - interval '1 day'")
    instance = uuid.uuid4()
    db.query(
        admin,
        "INSERT INTO processes (instance, role, host, pid, seen_at)"
        " VALUES (%(i)s, 'ack', 'h2', 2, now() - interval '2 days')",
        {"i": instance},
    )
    return instance


@pytest.mark.parametrize("login", ["viewer", "operator"])
def test_the_console_beats_as_the_viewer_or_the_operator(granted: RoleDatabase, login: str) -> None:
    admin = granted.admin_url
    stale = _silent_for_days(admin)
    engine = sa.create_engine(granted.url(login))
    try:
        forgotten, mine = _beat_and_forget(engine, "web")
    finally:
        engine.dispose()
    assert mine == [("web", True)]
    assert forgotten == 1  # the day-silent row, another role's
    assert db.scalar(admin, "SELECT count(*) FROM processes WHERE instance = %(i)s", {"i": stale}) == 0


def _refusal(url: str, statement: sa.Executable) -> BaseException:
    engine = sa.create_engine(url)
    try:
        with pytest.raises(ProgrammingError) as refused, engine.begin() as conn:
            conn.execute(statement)
    finally:
        engine.dispose()
    return refused.value.orig if refused.value.orig is not None else refused.value


@pytest.mark.parametrize("login", ["viewer", "operator"])
def test_the_console_writes_no_other_process_heartbeat(
    granted: RoleDatabase, seeded: dict[str, int], login: str
) -> None:
    """A heartbeat as another role is refused by the policy (42501), a new
    row or one over a live row of that role; and a live row of another role
    is not the console's to edit or delete (hidden: no row changed)."""
    admin = granted.admin_url
    before = db.query(admin, "SELECT * FROM processes ORDER BY instance")
    ingest_row = db.scalar(admin, "SELECT instance FROM processes WHERE role = 'ingest'")
    url = granted.url(login)
    for statement in (
        heartbeats.beat_statement(uuid.uuid4(), "ingest", "h1", 1, {}),
        heartbeats.beat_statement(ingest_row, "web", "h1", 1, {}),
    ):
        refused = _refusal(url, statement)
        assert isinstance(refused, psycopg.errors.InsufficientPrivilege), refused
        assert "row-level security policy" in str(refused)
    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:
            stopped = conn.execute(heartbeats.stopped_statement(ingest_row)).rowcount
            deleted = conn.execute(
                sa.text("DELETE FROM processes WHERE instance = :i"), {"i": ingest_row}
            ).rowcount
    finally:
        engine.dispose()
    assert (stopped, deleted) == (0, 0)
    assert db.query(admin, "SELECT * FROM processes ORDER BY instance") == before
