"""``switchboard demo``: the whole pipeline on embedded servers, no set-up.

Starts PostgreSQL and Valkey from the wheels (``ingest.embedded.servers``), migrates,
produces sample orders into a stream while a real ingester and acker run as
separate processes, SIGKILLs the ingester once mid-stream, restarts it, waits
until everything is acked, and prints what happened, straight from SQL and Redis.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import psycopg
import redis

from backhalf import migrate
from backhalf.db import libpq_url
from ingest.embedded.config import write_config
from ingest.embedded.processes import Processes, wait_for
from ingest.embedded.servers import embedded_servers
from ingest.exit_codes import EXIT_FAILURE, EXIT_OK

STREAM = "orders"
WAIT_TIMEOUT_S = 120.0
PROCESS_STOP_TIMEOUT_S = 20.0

SUMMARY_SQL = """
SELECT (SELECT count(*) FROM todos) AS todos,
       (SELECT count(DISTINCT (queue, idempotency_key)) FROM todos) AS distinct_todos,
       (SELECT count(*) FROM inbox) AS inbox_rows,
       (SELECT count(*) FROM inbox WHERE ack_state = 'acked') AS acked,
       (SELECT coalesce(sum(deliveries - 1), 0) FROM inbox) AS redeliveries,
       (SELECT count(*) FROM events) AS events
"""
ACKED_SQL = "SELECT count(*) FROM inbox WHERE ack_state = 'acked'"
TODOS_SQL = "SELECT count(*) FROM todos"
TRAIL_KEY_SQL = "SELECT idempotency_key FROM inbox ORDER BY deliveries DESC, id LIMIT 1"
TRAIL_SQL = """
SELECT inbox_id, idempotency_key, source_message_id, consumer, deliveries, stored_at,
       event_id, trust_mode, verified, verify_detail, todo_id, queue, todo_status,
       ack_kind, ack_state, acked_at
FROM audit_message_trail WHERE idempotency_key = %(key)s
"""


def _scalar(db: psycopg.Connection[Any], query: str) -> int:
    row = db.execute(query).fetchone()
    return int(row[0]) if row else 0


def _write_config(path: Path, db_url: str, redis_url: str) -> None:
    adapter = {
        "name": "orders",
        "transport": "redis",
        "mode": "stream",
        "source": STREAM,
        "group": "switchboard",
        "queue": "orders",
        "ack_after": "store",
        "batch_size": 200,
        "block_ms": 200,
    }
    write_config(path, database_url=db_url, redis_url=redis_url, adapters=[adapter])


def run(messages: int = 5000) -> int:
    logging.getLogger("alembic").setLevel(logging.WARNING)  # the demo prints its own story
    with embedded_servers("switchboard-demo-") as servers:
        base, pg, rs = servers.base, servers.postgres, servers.redis
        print(f"demo: working in {base}")
        # Without the caller's SWITCHBOARD_* variables: an exported production
        # SWITCHBOARD_DATABASE_URL would override the demo's own config.
        processes = Processes(base)
        try:
            db_url = pg.create_database("switchboard")
            print(f"demo: PostgreSQL on 127.0.0.1:{pg.port}, Valkey on 127.0.0.1:{rs.port}")
            migrate.upgrade(db_url)
            print("demo: migrated")
            config = base / "switchboard.toml"
            _write_config(config, db_url, rs.url)
            return _drive(config, db_url, rs.url, messages, processes)
        finally:
            processes.stop_all(PROCESS_STOP_TIMEOUT_S)


def _drive(config: Path, db_url: str, redis_url: str, messages: int, processes: Processes) -> int:
    r = redis.Redis.from_url(redis_url, socket_timeout=10)
    with psycopg.connect(libpq_url(db_url), autocommit=True, connect_timeout=10) as db:
        acker = processes.start("ack", config, name="acker")
        ingester = processes.start("ingest", config, name="ingester-1")
        killed = False
        chunk = 100
        for start in range(0, messages, chunk):
            pipe = r.pipeline(transaction=False)
            for i in range(start, min(start + chunk, messages)):
                body = {"order_id": i, "sku": f"SKU-{i % 17}", "qty": 1 + i % 5}
                pipe.xadd(STREAM, {"body": json.dumps(body)})
            pipe.execute()
            time.sleep(0.02)
            if not killed and start >= messages // 3:
                wait_for(lambda: _scalar(db, TODOS_SQL) > 0, timeout_s=WAIT_TIMEOUT_S, what="the first todos")
                ingester.kill()
                killed = True
                pending = r.xpending(STREAM, "switchboard")["pending"]
                print(
                    f"demo: SIGKILLed the ingester mid-stream: {_scalar(db, TODOS_SQL)} todos committed, "
                    f"{pending} entries pending in Redis"
                )
                ingester = processes.start("ingest", config, name="ingester-1")
                print("demo: restarted the ingester (same consumer name: it re-reads its own PEL)")
        print(f"demo: produced {messages} messages to stream {STREAM!r}")
        wait_for(
            lambda: _scalar(db, ACKED_SQL) >= messages, timeout_s=WAIT_TIMEOUT_S, what="every message acked"
        )
        wait_for(
            lambda: r.xpending(STREAM, "switchboard")["pending"] == 0,
            timeout_s=WAIT_TIMEOUT_S,
            what="an empty PEL",
        )
        codes = {
            "ingester-1": ingester.stop(PROCESS_STOP_TIMEOUT_S),
            "acker": acker.stop(PROCESS_STOP_TIMEOUT_S),
        }
        row = db.execute(SUMMARY_SQL).fetchone()
        assert row is not None
        todos, distinct, inbox_rows, acked, redeliveries, events = row
        pending = r.xpending(STREAM, "switchboard")["pending"]
        print()
        print(f"  messages produced       {messages}")
        print(f"  todos created           {todos}")
        print(f"  duplicates              {todos - distinct}")
        print(f"  events recorded         {events}")
        print(f"  inbox rows              {inbox_rows}")
        print(f"  acked (XACK)            {acked}")
        print(f"  redeliveries deduped    {redeliveries}")
        print(f"  pending in Redis (PEL)  {pending}")
        print(f"  exit codes on SIGTERM   {codes}")
        key_row = db.execute(TRAIL_KEY_SQL).fetchone()
        if key_row:
            print(f"\n  audit trail of {key_row[0]} (audit_message_trail):")
            cur = db.execute(TRAIL_SQL, {"key": key_row[0]})
            names = [c.name for c in cur.description or ()]
            for trail in cur.fetchall():
                for name, value in zip(names, trail, strict=True):
                    print(f"    {name:<18} {value}")
        ok = todos == messages == distinct and acked == inbox_rows and pending == 0
        ok = ok and all(c == 0 for c in codes.values())
        print(f"\ndemo: {'OK: no loss, no duplicate' if ok else 'FAILED'}")
        return EXIT_OK if ok else EXIT_FAILURE
