"""``switchboard demo``: the whole pipeline on embedded servers, no set-up.

Starts PostgreSQL and Valkey from the wheels (``ingest.embedded.servers``), migrates,
produces sample orders into a stream while a real ingester and acker run as
separate processes, SIGKILLs the ingester once mid-stream, restarts it, waits
until everything is acked, and prints what happened, straight from SQL and Redis.
"""

from __future__ import annotations

import json
import logging
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, TextIO

import psycopg
import redis

from backhalf import migrate
from ingest.embedded.servers import PostgresServer, RedisServer
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


def _libpq(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


def _scalar(db: psycopg.Connection[Any], query: str) -> int:
    row = db.execute(query).fetchone()
    return int(row[0]) if row else 0


class _Process:
    """A switchboard subprocess with its log file, always waited for."""

    def __init__(self, verb: str, config: Path, log_dir: Path, name: str) -> None:
        self.name = name
        self._log: TextIO = (log_dir / f"{name}.log").open("a")
        self.proc = subprocess.Popen(  # noqa: S603 - our own interpreter and module
            [sys.executable, "-m", "ingest", "--config", str(config), verb, "--consumer", name]
            if verb == "ingest"
            else [sys.executable, "-m", "ingest", "--config", str(config), verb],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=PROCESS_STOP_TIMEOUT_S)
        self._log.close()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=PROCESS_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait(timeout=PROCESS_STOP_TIMEOUT_S)
        self._log.close()
        return code


def _wait_until(what: str, predicate: Any, timeout_s: float = WAIT_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"demo: timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.05)


def _write_config(path: Path, db_url: str, redis_url: str) -> None:
    path.write_text(
        f"""[database]
url = "{db_url}"

[redis]
url = "{redis_url}"

[[adapters]]
name = "orders"
transport = "redis"
mode = "stream"
source = "{STREAM}"
group = "switchboard"
queue = "orders"
ack_after = "store"
batch_size = 200
block_ms = 200
"""
    )


def run(messages: int = 5000) -> int:
    logging.getLogger("alembic").setLevel(logging.WARNING)  # the demo prints its own story
    base = Path(tempfile.mkdtemp(prefix="switchboard-demo-"))
    base.chmod(0o755)  # PostgreSQL runs as an unprivileged user when we are root
    print(f"demo: working in {base}")
    pg = PostgresServer.create(base / "pg")
    rs = RedisServer.create(base / "redis")
    processes: list[_Process] = []
    try:
        pg.start()
        rs.start()
        db_url = pg.create_database("switchboard")
        print(f"demo: PostgreSQL on 127.0.0.1:{pg.port}, Valkey on 127.0.0.1:{rs.port}")
        migrate.upgrade(db_url)
        print("demo: migrated")
        config = base / "switchboard.toml"
        _write_config(config, db_url, rs.url)
        return _drive(config, db_url, rs.url, base, messages, processes)
    finally:
        for p in processes:
            if p.proc.poll() is None:
                p.stop()
        pg.cleanup()
        rs.cleanup()
        shutil.rmtree(base, ignore_errors=True)


def _drive(
    config: Path, db_url: str, redis_url: str, base: Path, messages: int, processes: list[_Process]
) -> int:
    r = redis.Redis.from_url(redis_url, socket_timeout=10)
    with psycopg.connect(_libpq(db_url), autocommit=True, connect_timeout=10) as db:
        acker = _Process("ack", config, base, "acker")
        ingester = _Process("ingest", config, base, "ingester-1")
        processes += [acker, ingester]
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
                _wait_until("the first todos", lambda: _scalar(db, TODOS_SQL) > 0)
                ingester.kill()
                killed = True
                pending = r.xpending(STREAM, "switchboard")["pending"]
                print(
                    f"demo: SIGKILLed the ingester mid-stream: {_scalar(db, TODOS_SQL)} todos committed, "
                    f"{pending} entries pending in Redis"
                )
                ingester = _Process("ingest", config, base, "ingester-1")
                processes.append(ingester)
                print("demo: restarted the ingester (same consumer name: it re-reads its own PEL)")
        print(f"demo: produced {messages} messages to stream {STREAM!r}")
        _wait_until("every message acked", lambda: _scalar(db, ACKED_SQL) >= messages)
        _wait_until("an empty PEL", lambda: r.xpending(STREAM, "switchboard")["pending"] == 0)
        codes = {p.name: p.stop() for p in (ingester, acker)}
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
