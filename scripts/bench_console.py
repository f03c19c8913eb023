"""``make bench``'s console part (issue 31): the pages of ``switchboard web``
on a big inbox, beside a whole-table ``count(*)`` of the same inbox in the
same run.

A database is filled server-side (``generate_series``) with ``rows`` inbox
rows over the last 24 hours (about 1/24 of them in the last hour, 1% of
them rejected) and as many todos (1% failed); then the real ``switchboard
web`` serves it, and each page is fetched ``REPEATS`` times over loopback:
its median time is printed, and its ratio to one ``SELECT count(*) FROM
inbox`` (the baseline: what a page that counted the table would pay at
least) and to ``audit_adapter_counts`` (what ``switchboard status`` reads).
A ratio well under 1 says the page does not walk the table.
"""

from __future__ import annotations

import http.client
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from backhalf.db import libpq_url  # noqa: E402
from ingest.embedded import config  # noqa: E402
from ingest.embedded.processes import SwitchboardProcess, wait_for  # noqa: E402
from ingest.embedded.servers import PostgresServer, free_port  # noqa: E402

REPEATS = 7
ADAPTER = "orders"
# Server-side, no value from outside: the row count is an integer parameter.
FILL = [
    "INSERT INTO adapters (name, transport, mode, settings)"
    " VALUES ('orders', 'redis', 'stream', '{\"source\": \"orders\", \"queue\": \"orders\"}')",
    "INSERT INTO todos (queue, idempotency_key, payload, status, created_at, updated_at)"
    " SELECT 'orders', 'redis:orders:' || g || '-0', '{}'::jsonb,"
    " CASE WHEN g %% 100 = 0 THEN 'failed' ELSE 'done' END,"
    " now() - make_interval(secs => (%(n)s - g) * 86400.0 / %(n)s),"
    " now() - make_interval(secs => (%(n)s - g) * 86400.0 / %(n)s)"
    " FROM generate_series(1, %(n)s) g",
    "INSERT INTO inbox (adapter, idempotency_key, source_message_id, body, ack_kind, ack_state, acked_at,"
    " status, error, todo_id, stored_at)"
    " SELECT 'orders', 'redis:orders:' || g || '-0', g || '-0', '{\"n\": 1}'::bytea, 'xack',"
    " 'acked', now() - make_interval(secs => (%(n)s - g) * 86400.0 / %(n)s - 0.05),"
    " CASE WHEN g %% 100 = 0 THEN 'rejected' ELSE 'stored' END,"
    " CASE WHEN g %% 100 = 0 THEN 'invalid_json: bench' END, CASE WHEN g %% 100 <> 0 THEN g END,"
    " now() - make_interval(secs => (%(n)s - g) * 86400.0 / %(n)s)"
    " FROM generate_series(1, %(n)s) g",
    "ANALYZE",
]
PAGES = (
    "/",
    "/fragments/overview",
    "/charts",
    "/inbox?status=rejected",
    "/inbox?status=rejected&adapter=orders&since=1h",
    "/todos",
    "/todos?status=failed",
    "/trace?key=redis:orders:5-0",
    "/processes",
)


def _fill(url: str, rows: int) -> float:
    import psycopg

    started = time.perf_counter()
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        for statement in FILL:
            conn.execute(statement, {"n": rows} if "%(n)s" in statement else None)
        conn.execute("CHECKPOINT")
    return time.perf_counter() - started


def _baseline(url: str, statement: str) -> float:
    import psycopg

    times = []
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        for _ in range(REPEATS):
            started = time.perf_counter()
            conn.execute(statement).fetchall()
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def _page(port: int, path: str) -> tuple[float, int]:
    times = []
    status = 0
    for _ in range(REPEATS):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        started = time.perf_counter()
        conn.request("GET", path)
        answer = conn.getresponse()
        answer.read()
        times.append(time.perf_counter() - started)
        status = answer.status
        conn.close()
        time.sleep(1.6)  # past the overview's cache: each fetch reads the database
    return statistics.median(times), status


def compare(base: Path, pg: PostgresServer, redis_url: str, *, quick: bool = False) -> None:
    from backhalf.housekeeping import migrate

    rows = 100_000 if quick else 1_000_000
    url = pg.create_database("console")
    migrate.upgrade(url)
    print(f"\nconsole (issue 31): {rows:,} inbox rows and {rows:,} todos over 24 h; pages over loopback,")
    print(f"  median of {REPEATS} fetches, beside one whole-table count of the same inbox")
    print(f"  filled in {_fill(url, rows):.1f} s")
    count_s = _baseline(url, "SELECT count(*) FROM inbox")
    status_s = _baseline(url, "SELECT * FROM audit_adapter_counts")
    print(f"  baseline: the inbox's count(*) {count_s * 1000:.1f} ms;"
          f" audit_adapter_counts (status's read) {status_s * 1000:.1f} ms")  # fmt: skip
    port = free_port()
    path = config.write_config(
        base / "console.toml",
        database_url=url,
        redis_url=redis_url,  # the overview asks the adapter's stream for its figures
        adapters=[{"name": ADAPTER, "mode": "stream", "source": ADAPTER, "group": "sb", "queue": ADAPTER}],
    )
    web = SwitchboardProcess("web", path, base / "console-web.log", args=["--listen", f"127.0.0.1:{port}"])
    try:
        wait_for(lambda: web.events("web_listening") or not web.alive(), timeout_s=60, what="the console")
        if not web.alive():
            raise RuntimeError(web.raw_log()[-2000:])
        print(f"  {'page':<50} {'ms':>8} {'÷ count(*)':>11} {'÷ status':>9}")
        for page in PAGES:
            seconds, status = _page(port, page)
            mark = "" if status == 200 else f"  (HTTP {status})"
            print(f"  {page:<50} {seconds * 1000:8.1f} {seconds / count_s:11.2f}"
                  f" {seconds / status_s:9.2f}{mark}")  # fmt: skip
    finally:
        web.stop()
