"""The FastStream peer of ``make bench`` writes Switchboard's own rows with
statements of its own (scripts/bench_peer_sql.py). Run here against the
schema as it is: when the schema moved on (todos partitioned, migration
0017), the peer's todo insert stopped matching any unique index, every
batch failed, and ``make bench`` waited out its timeout with nothing
measured."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

import psycopg

from tests.support.db import libpq, query, scalar

SCRIPTS = Path(__file__).resolve().parents[3] / "scripts"


def peer_sql() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_peer_sql", SCRIPTS / "bench_peer_sql.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def batch(first: int, count: int) -> dict[str, Any]:
    ids = [f"1700000000000-{i}" for i in range(first, first + count)]
    bodies = [f'{{"n": {i}}}'.encode() for i in range(first, first + count)]
    return {
        "keys": [f"redis:bench:{m}" for m in ids],
        "ids": ids,
        "bodies": bodies,
        "payloads": [b.decode() for b in bodies],
        "consumer": "peer-0",
        "stream": "bench",
        "group": "switchboard",
    }


def store(db_url: str, statement: str, params: dict[str, Any]) -> list[int] | None:
    with psycopg.connect(libpq(db_url), connect_timeout=10) as conn, conn.transaction():
        row = conn.execute(statement, params).fetchone()
    assert row is not None
    return row[0]  # type: ignore[no-any-return]


def counts(db_url: str) -> dict[str, int]:
    tables = ("inbox", "todos", "events", "todo_events")
    return {t: scalar(db_url, f"SELECT count(*) FROM {t}") for t in tables}


def test_the_peers_statements_store_dedup_and_mark_on_the_current_schema(db_url: str) -> None:
    sql = peer_sql()
    query(
        db_url,
        "INSERT INTO adapters (name, transport, mode, enabled) VALUES ('bench', 'redis', 'stream', false)",
    )
    with_bookkeeping = sql.STORE_SQL.format(logged=sql.LOGGED)

    stored = store(db_url, with_bookkeeping, batch(0, 3))
    assert stored is not None
    assert len(stored) == 3
    assert counts(db_url) == {"inbox": 3, "todos": 3, "events": 3, "todo_events": 3}
    # A redelivered batch is deduplicated by the inbox's key, as the store's.
    assert store(db_url, with_bookkeeping, batch(0, 3)) is None
    assert counts(db_url) == {"inbox": 3, "todos": 3, "events": 3, "todo_events": 3}

    # Without the bookkeeping: no todo_events row.
    assert store(db_url, sql.STORE_SQL.format(logged=""), batch(3, 2)) is not None
    assert counts(db_url) == {"inbox": 5, "todos": 5, "events": 5, "todo_events": 3}
    assert query(db_url, "SELECT DISTINCT status FROM todos") == [("pending",)]

    with psycopg.connect(libpq(db_url), autocommit=True, connect_timeout=10) as conn:
        conn.execute(sql.MARK_SQL, {"ids": stored})
    assert (
        scalar(db_url, "SELECT count(*) FROM inbox WHERE ack_state = 'acked' AND acked_at IS NOT NULL") == 3
    )
