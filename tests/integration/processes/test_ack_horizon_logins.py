"""The ack cursor's horizon against logins of this database (issue 43): a
login with no grant here that holds a transaction open (it needs no
privilege to take an id: ``pg_current_xact_id()``) holds no stream ack
back; a login that may write the inbox in any way (through a role it may
``SET ROLE`` to without inheriting it, or by granting itself one) does, and
``status`` names it. Real PostgreSQL and Redis; the roles are made per test
(they are the cluster's) and dropped after."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import LiteralString

import psycopg
import pytest
import redis
from psycopg import conninfo, sql
from sqlalchemy.ext.asyncio import AsyncEngine

from backhalf.reads import audit
from ingest.adapters.redis.streams import StreamAcknowledger
from ingest.processes.ack.acker import drain_once
from tests.integration.processes.test_acker import GROUP, STREAM, consume_and_commit, settings
from tests.support.db import libpq, scalar

PASSWORD = "horizon-test-pw"


class Logins:
    """Login roles made by a test (and the groups they join), dropped after."""

    def __init__(self, db_url: str) -> None:
        self._admin = libpq(db_url)
        self._made: list[str] = []

    def make(self, attributes: LiteralString, *, member_of: str | None = None) -> str:
        name = f"h_{uuid.uuid4().hex[:10]}"
        statement = sql.SQL("CREATE ROLE {} " + attributes).format(sql.Identifier(name))
        if member_of is not None:
            statement += sql.SQL(" IN ROLE {}").format(sql.Identifier(member_of))
        with psycopg.connect(self._admin, autocommit=True) as conn:
            conn.execute(statement)
            conn.execute(
                sql.SQL("ALTER ROLE {} PASSWORD {}").format(sql.Identifier(name), sql.Literal(PASSWORD))
            )
        self._made.append(name)
        return name

    def grant(self, statement: LiteralString, role: str) -> None:
        with psycopg.connect(self._admin, autocommit=True) as conn:
            conn.execute(sql.SQL(statement).format(sql.Identifier(role)))

    def connect(self, role: str) -> psycopg.Connection[tuple[object, ...]]:
        return psycopg.connect(conninfo.make_conninfo(self._admin, user=role, password=PASSWORD))

    def drop(self) -> None:
        with psycopg.connect(self._admin, autocommit=True) as conn:
            for role in reversed(self._made):
                conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
                conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


@pytest.fixture
def logins(db_url: str) -> Iterator[Logins]:
    made = Logins(db_url)
    yield made
    made.drop()


def holding(conn: psycopg.Connection[tuple[object, ...]]) -> int:
    """A transaction id taken and held (the connection is left in its transaction)."""
    row = conn.execute("SELECT pg_current_xact_id()").fetchone()
    assert row is not None
    return int(str(row[0]))


async def test_a_login_with_no_grant_holding_a_transaction_holds_no_ack_back(
    engine: AsyncEngine, db_url: str, redis_url: str, logins: Logins
) -> None:
    stranger = logins.make("LOGIN")  # CONNECT through PUBLIC, no grant on any table
    s = settings(db_url, redis_url)
    r = redis.Redis.from_url(redis_url, socket_timeout=10)
    r.xadd(STREAM, {"body": "{}"})
    acknowledgers = {"orders": StreamAcknowledger(s.adapters[0])}
    idle = logins.connect(stranger)
    try:
        assert idle.execute("SELECT has_table_privilege('inbox', 'INSERT')").fetchone() == (False,)
        holding(idle)  # an id below the store's, held open
        await consume_and_commit(engine, s, 1)
        assert await drain_once(engine, acknowledgers, 100) == 1
        assert r.xpending(STREAM, GROUP)["pending"] == 0
        assert scalar(db_url, "SELECT ack_state FROM inbox") == "acked"
        # `status` names no holder either: the same rule.
        async with engine.connect() as conn:
            assert await audit.ack_horizon_holder(conn) is None
    finally:
        idle.close()
        for a in acknowledgers.values():
            await a.close()


@pytest.mark.parametrize("how", ["noinherit_member_of_a_writer", "createrole"])
async def test_a_login_that_may_write_the_inbox_holds_acks_back_until_it_ends(
    engine: AsyncEngine, db_url: str, redis_url: str, logins: Logins, how: str
) -> None:
    """Not by the table's grants alone: a NOINHERIT member of a role with
    INSERT on inbox has no right of its own, yet may SET ROLE to it within
    its transaction; a CREATEROLE login could grant itself a writer's role
    (before PostgreSQL 16). Both are writers, so both bound the horizon."""
    if how == "createrole":
        login = logins.make("LOGIN CREATEROLE")
    else:
        group = logins.make("NOLOGIN")
        logins.grant("GRANT INSERT ON inbox TO {}", group)
        login = logins.make("LOGIN NOINHERIT", member_of=group)
    s = settings(db_url, redis_url)
    r = redis.Redis.from_url(redis_url, socket_timeout=10)
    r.xadd(STREAM, {"body": "{}"})
    acknowledgers = {"orders": StreamAcknowledger(s.adapters[0])}
    writer = logins.connect(login)
    try:
        assert writer.execute("SELECT has_table_privilege('inbox', 'INSERT')").fetchone() == (False,)
        holding(writer)
        pid = writer.info.backend_pid
        await consume_and_commit(engine, s, 1)
        assert await drain_once(engine, acknowledgers, 100) == 0
        assert r.xpending(STREAM, GROUP)["pending"] == 1
        async with engine.connect() as conn:
            holder = await audit.ack_horizon_holder(conn)
        assert holder is not None
        assert (holder.kind, holder.name, holder.user) == ("session", str(pid), login)
        writer.commit()
        assert await drain_once(engine, acknowledgers, 100) == 1
        assert r.xpending(STREAM, GROUP)["pending"] == 0
        assert scalar(db_url, "SELECT ack_state FROM inbox") == "acked"
    finally:
        writer.close()
        for a in acknowledgers.values():
            await a.close()
