"""What ``make bench``'s parts share (``scripts/bench.py`` and the
``bench_*`` modules it runs): the servers' and the pipeline's set-up, the
pre-loaded stream, the baselines (raw, naive, the FastStream peer) and the
clocks (CPU seconds of a process tree). Imports no part: the parts import
it, and ``bench.py`` imports the parts, so no import circle."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import psycopg
import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from backhalf import queries  # noqa: E402
from backhalf.db import libpq_url  # noqa: E402
from backhalf.housekeeping import migrate  # noqa: E402
from ingest.children import reap  # noqa: E402
from ingest.embedded import config  # noqa: E402
from ingest.embedded.processes import SwitchboardProcess, wait_for, wait_ready  # noqa: E402
from ingest.embedded.servers import PostgresServer, free_port  # noqa: E402

SCRAPE_INTERVAL_S = 5.0  # Prometheus is usually set to 15 s or more

# [ingest] settings from the command line (--commits-in-flight), for every
# part's runs: one dict, changed in place by bench.py, never rebound.
INGEST_OVERRIDES: dict[str, int] = {}


@dataclass(frozen=True)
class Rig:
    """Where one measured run of a Redis stream works: its folder, its
    database, the Redis holding the pre-loaded stream, and the servers'
    pids (their CPU counted with the pipeline's)."""

    workdir: Path
    url: str
    r: redis.Redis
    redis_url: str
    servers: dict[str, int]


class Scraper:
    """Scrapes each port's /metrics every SCRAPE_INTERVAL_S while a run
    lasts, as Prometheus would (more often than it usually is): the cost
    of metrics on includes being read."""

    def __init__(self, ports: list[int]) -> None:
        self._ports = ports
        self._stop = threading.Event()
        self.scrapes = 0
        self._thread = threading.Thread(target=self._run, name="scraper")
        if ports:
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(SCRAPE_INTERVAL_S):
            for port in self._ports:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
                        reply.read()
                    self.scrapes += 1
                except OSError:
                    pass  # not listening yet

    def close(self) -> None:
        self._stop.set()
        if self._ports:
            self._thread.join(10)


WORKER_PROCESSES, WORKER_THREADS = 2, 8

STREAM = "bench"


GROUP = "switchboard"


POLL_S = 0.01  # how often a wait looks: the throughput clock stops when one returns


def body(i: int) -> bytes:
    return json.dumps({"order_id": i, "sku": f"SKU-{i % 97}", "qty": 1 + i % 7, "note": "bench"}).encode()


def fresh_db(pg: PostgresServer, name: str) -> str:
    """A migrated database for one run, after a CHECKPOINT: each run starts with
    no dirty buffers left over from the one before it to be flushed meanwhile."""
    url = pg.create_database(name)
    migrate.upgrade(url)
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        conn.execute(
            "INSERT INTO adapters (name, transport, mode, enabled) VALUES ('bench', 'redis', 'stream', false)"
        )
        conn.execute("CHECKPOINT")
    return url


RAW_SQL = [
    """INSERT INTO todos (queue, idempotency_key, payload)
       SELECT 'bench', k, p::jsonb FROM unnest(%(keys)b::text[], %(payloads)b::text[]) AS u(k, p)""",
    """INSERT INTO events (family, adapter, trust_mode, verified, verify_detail, idempotency_key,
                          source_message_id, payload)
       SELECT 'queue', 'bench', 'queue', false, 'redis acl: default', k, k, p::jsonb
       FROM unnest(%(keys)b::text[], %(payloads)b::text[]) AS u(k, p)""",
    """INSERT INTO inbox (adapter, idempotency_key, source_message_id, body, ack_kind, ack_key, ack_group,
                         ack_entry_id, ack_state, status)
       SELECT 'bench', k, k, b, 'xack', 'bench', 'switchboard', k, 'pending', 'stored'
       FROM unnest(%(keys)b::text[], %(bodies)b::bytea[]) AS u(k, b)""",
]


def bench_raw(url: str, n: int, per_tx: int = 1000) -> float:
    bodies = [body(i) for i in range(n)]
    started = time.perf_counter()
    with psycopg.connect(libpq_url(url)) as conn:
        for start in range(0, n, per_tx):
            chunk = bodies[start : start + per_tx]
            keys = [f"raw:{i}" for i in range(start, start + len(chunk))]
            params = {"keys": keys, "payloads": [b.decode() for b in chunk], "bodies": chunk}
            with conn.transaction(), conn.cursor() as cur:
                for statement in RAW_SQL:
                    cur.execute(statement, params)
    return n / (time.perf_counter() - started)


def preload(r: redis.Redis, n: int) -> None:
    r.delete(STREAM)
    for start in range(0, n, 5000):
        pipe = r.pipeline(transaction=False)
        for i in range(start, min(n, start + 5000)):
            pipe.xadd(STREAM, {"body": body(i)})
        pipe.execute()
    r.xgroup_create(STREAM, GROUP, id="0")


def bench_naive(url: str, r: redis.Redis, n: int) -> float:
    preload(r, n)
    started = time.perf_counter()
    done = 0
    with psycopg.connect(libpq_url(url)) as conn:
        while done < n:
            # [[stream, [(id, fields)]]]: RESP2's shape, which this client answers in.
            resp = cast("list[list[Any]]", r.xreadgroup(GROUP, "naive", {STREAM: ">"}, count=1, block=1000))
            if not resp:
                continue
            entry_id, fields = resp[0][1][0]
            key = f"redis:{STREAM}:{entry_id.decode()}"
            with conn.transaction():
                todo_id = conn.execute(
                    "INSERT INTO todos (queue, idempotency_key, payload) VALUES ('bench', %s, %s::jsonb)"
                    " RETURNING id",
                    (key, fields[b"body"].decode()),
                ).fetchone()[0]  # type: ignore[index]
                conn.execute(
                    "INSERT INTO events (family, adapter, trust_mode, verified, idempotency_key, payload,"
                    " todo_id)"
                    " VALUES ('queue', 'bench', 'queue', false, %s, %s::jsonb, %s)",
                    (key, fields[b"body"].decode(), todo_id),
                )
                conn.execute(
                    "INSERT INTO inbox (adapter, idempotency_key, source_message_id, body, ack_kind, ack_key,"
                    " ack_group, ack_entry_id, ack_state, status, todo_id)"
                    " VALUES ('bench', %s, %s, %s, 'xack', %s, %s, %s, 'acked', 'stored', %s)",
                    (key, entry_id.decode(), fields[b"body"], STREAM, GROUP, entry_id.decode(), todo_id),
                )
            r.xack(STREAM, GROUP, entry_id)
            done += 1
    return n / (time.perf_counter() - started)


# The bench's messages are under 100 bytes. At the default max_message_bytes
# (1 MiB) the in-flight bound (128 MiB) lets a read ask for 128 at most, not
# batch_size: a user with small messages sizes max_message_bytes to them
# (docs/operating.md, "Memory is bounded by bytes"), as the bench does.
# Measured when the bound was 512 MiB: 15.6-17.6k msg/s at the default
# against 18.5-20.1k with full batches (issue 16).
MAX_MESSAGE_BYTES = 64 * 1024


def write_config(path: Path, db_url: str, redis_url: str, batch_size: int, metrics_port: int = 0) -> Path:
    adapter = {"name": "bench", "mode": "stream", "source": STREAM, "group": GROUP, "queue": "bench",
               "batch_size": batch_size, "block_ms": 100, "url": redis_url,
               "max_message_bytes": MAX_MESSAGE_BYTES}  # fmt: skip
    written = config.write_config(
        path,
        database_url=db_url,
        adapters=[adapter],
        ingest={"enabled_refresh_ms": 50, **INGEST_OVERRIDES},
        acker={"batch_size": batch_size * 2, "poll_interval_ms": 100},
    )
    if metrics_port:
        # The ingester's port; the acker's comes from its environment
        # (SWITCHBOARD_METRICS_PORT), as two processes of one host need.
        with written.open("a") as f:
            f.write(f"\n[metrics]\nport = {metrics_port}\n")  # the gauges at their default refresh
    return written


def start(verb: str, config_path: Path, log: Path, env: dict[str, str] | None = None) -> SwitchboardProcess:
    """A process as the bench has always run them: without -X dev, and (as
    every kit process) without the caller's SWITCHBOARD_* variables."""
    consumer = "bench-1" if verb == "ingest" else None
    return SwitchboardProcess(verb, config_path, log, consumer=consumer, env=env)


def _status_mb(pid: int, field: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def rss_mb(proc: SwitchboardProcess) -> float:
    return _status_mb(proc.pid, "VmRSS")


def peak_rss_mb(proc: SwitchboardProcess) -> float:
    return _status_mb(proc.pid, "VmHWM")


CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process and its children that were waited for."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return 0.0
    return sum(int(x) for x in fields[11:15]) / CLK_TCK  # utime stime cutime cstime


def tree_cpu_seconds(root: int) -> float:
    """CPU of ``root`` and of every live descendant (PostgreSQL's backends)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    total, stack = 0.0, [root]
    while stack:
        pid = stack.pop()
        total += cpu_seconds(pid)
        stack.extend(children.get(pid, []))
    return total


# PostgreSQL's own work that a run may or may not meet, counted so that a
# slow run can be told apart from a slow pipeline: checkpoints (cluster-wide)
# and autovacuum's vacuums and analyzes of the run's database.
BACKGROUND_WORK = """
SELECT (SELECT checkpoints_timed + checkpoints_req FROM pg_stat_bgwriter),
       coalesce(sum(autovacuum_count), 0), coalesce(sum(autoanalyze_count), 0)
FROM pg_stat_user_tables
"""
BACKGROUND_KINDS = ("checkpoints", "autovacuums", "autoanalyzes")


def background_work(url: str) -> dict[str, int]:
    """The counts of :data:`BACKGROUND_KINDS` so far (statistics as flushed)."""
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        row = conn.execute(BACKGROUND_WORK).fetchone()
    assert row is not None
    return dict(zip(BACKGROUND_KINDS, (int(v) for v in row), strict=True))


def stream_drained(r: redis.Redis) -> bool:
    """Every entry delivered (lag 0) and XACKed (PEL empty). Asked of Redis,
    because polling PostgreSQL while measuring it would bill the polls (a
    count over a growing table) to the pipeline."""
    (group,) = r.xinfo_groups(STREAM)
    return bool(group["lag"] == 0 and group["pending"] == 0)


def acked_count(url: str) -> int:
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM inbox WHERE ack_state = 'acked'").fetchone()
        return int(row[0]) if row else 0


def set_enabled(url: str, enabled: bool) -> None:
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        conn.execute("UPDATE adapters SET enabled = %s WHERE name = 'bench'", (enabled,))


def start_pipeline(
    workdir: Path, url: str, redis_url: str, batch_size: int, run: str, ports: tuple[int, int] | None = None
) -> tuple[SwitchboardProcess, SwitchboardProcess]:
    """``ports``: metrics on, the ingester's and the acker's."""
    config_path = write_config(workdir / f"{run}.toml", url, redis_url, batch_size, ports[0] if ports else 0)
    acker_env = {"SWITCHBOARD_METRICS_PORT": str(ports[1])} if ports else None
    acker = start("ack", config_path, workdir / f"{run}-acker.log", acker_env)
    ingester = start("ingest", config_path, workdir / f"{run}-ingester.log")
    wait_ready(acker)
    wait_ready(ingester)
    return ingester, acker


def bench_switchboard(
    rig: Rig, n: int, batch_size: int, *, metrics: bool = False, run: str = "throughput"
) -> tuple[float, dict[str, float], dict[str, float]]:
    preload(rig.r, n)
    ports = (free_port(), free_port()) if metrics else None
    ingester, acker = start_pipeline(rig.workdir, rig.url, rig.redis_url, batch_size, run, ports)
    scraper = Scraper(list(ports or ()))
    try:
        pids = {"ingester": ingester.pid, "acker": acker.pid, **rig.servers}
        cpu_before = {name: tree_cpu_seconds(pid) for name, pid in pids.items()}
        started = time.perf_counter()
        set_enabled(rig.url, True)
        wait_for(lambda: stream_drained(rig.r), timeout_s=600, what="every entry XACKed", interval_s=POLL_S)
        elapsed = time.perf_counter() - started
        cpu_us = {name: (tree_cpu_seconds(pid) - cpu_before[name]) / n * 1e6 for name, pid in pids.items()}
        # The marks commit just after their XACK; then everything must be there.
        wait_for(lambda: acked_count(rig.url) == n, timeout_s=30, what="every inbox row marked acked")
        rss = {"ingester": peak_rss_mb(ingester), "acker": peak_rss_mb(acker)}
    finally:
        scraper.close()
        ingester.terminate()
        acker.terminate()
    return n / elapsed, rss, cpu_us


def count_on(conn: psycopg.Connection[Any], query: str) -> int:
    row = conn.execute(query).fetchone()
    return int(row[0]) if row else 0


def any_on(conn: psycopg.Connection[Any], query: str) -> bool:
    row = conn.execute(query).fetchone()
    return bool(row[0]) if row else False


# Todos not finished yet, through the partial indexes of the active states
# only: a count of the done ones would scan a growing table and bill it to
# the run being measured.
ACTIVE_TODOS = (
    "SELECT (SELECT count(*) FROM todos WHERE status = 'pending')"
    " + (SELECT count(*) FROM todos WHERE status = 'running')"
)


# Whether any is left, as the drains ask it every POLL_S: the first one
# found ends each walk of an index (a count walked every active row's entry
# at every poll, and billed it to the run being measured).
ANY_ACTIVE_TODOS = (
    "SELECT EXISTS (SELECT 1 FROM todos WHERE status = 'pending')"
    " OR EXISTS (SELECT 1 FROM todos WHERE status = 'running')"
)


def todos_active(url: str) -> int:
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        return count_on(conn, ACTIVE_TODOS)


def todos_done(url: str) -> int:
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        return count_on(conn, "SELECT count(*) FROM todos WHERE status = 'done'")


def workers_ready(worker: SwitchboardProcess) -> bool:
    """Every worker process booted (``worker_ready``) and LISTENing for the
    store's NOTIFY (its claimer's ``listening``)."""
    listening = [e for e in worker.events("listening") if e.get("channel") == queries.TODO_CHANNEL]
    return len(worker.events("worker_ready")) >= WORKER_PROCESSES and len(listening) >= WORKER_PROCESSES


def e2e_config(workdir: Path, url: str, redis_url: str, batch_size: int, run: str) -> Path:
    """The pipeline with workers: the no-op handler on queue ``bench``, the
    [worker] defaults."""
    adapter = {"name": "bench", "mode": "stream", "source": STREAM, "group": GROUP, "queue": "bench",
               "batch_size": batch_size, "block_ms": 100, "url": redis_url}  # fmt: skip
    return config.write_config(
        workdir / f"{run}.toml",
        database_url=url,
        adapters=[adapter],
        ingest={"enabled_refresh_ms": 50, **INGEST_OVERRIDES},
        acker={"batch_size": batch_size * 2, "poll_interval_ms": 100},
        queues={"bench": {"handler": "scripts.bench_actors:noop_handler"}},
    )


# (label, subscribers, bookkeeping): what a capable user writes with FastStream.
PEERS = (
    ("faststream 1 sub", 1, False),
    ("faststream 2 subs", 2, False),
    ("faststream 2 subs + bookkeeping", 2, True),
)


def finish_peer(proc: subprocess.Popen[bytes]) -> None:
    """A peer's stdin closed (its cue to end), then waited for; killed after 30 s."""
    if proc.stdin is not None:
        proc.stdin.close()
    reap(proc, 30)


def bench_peer(
    rig: Rig, n: int, subscribers: int, bookkeeping: bool, run: str
) -> tuple[float, dict[str, float]]:
    """The FastStream peer (scripts/bench_faststream.py) draining the same
    pre-loaded stream. Its clock starts when it is told to go, after its
    imports and connections, as Switchboard's starts when its adapter is
    enabled; it stops when every entry is XACKed. The bookkeeping peer's
    marks are then waited for, outside the clock, as Switchboard's are."""
    preload(rig.r, n)
    argv = [
        sys.executable, str(ROOT / "scripts" / "bench_faststream.py"), "--database", libpq_url(rig.url),
        "--redis", rig.redis_url, "--stream", STREAM, "--group", GROUP, "--subscribers", str(subscribers),
    ]  # fmt: skip
    if bookkeeping:
        argv.append("--bookkeeping")
    log = (rig.workdir / f"{run}.log").open("wb")
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log)  # noqa: S603
    assert proc.stdin is not None
    assert proc.stdout is not None
    try:
        line = proc.stdout.readline()  # bounded: the process dies with an error, closing its stdout
        if line.strip() != b"ready":
            raise SystemExit(f"bench: the peer {run} did not start (said {line!r}); log in {rig.workdir}")
        pids = {"peer": proc.pid, **rig.servers}
        cpu_before = {name: tree_cpu_seconds(pid) for name, pid in pids.items()}
        started = time.perf_counter()
        proc.stdin.write(b"go\n")
        proc.stdin.flush()

        def alive() -> bool:
            """Raises once the peer has ended: a peer that failed measures nothing."""
            if proc.poll() is not None:
                raise SystemExit(f"bench: the peer {run} ended (exit {proc.returncode}) before its work"
                                 f" was done; its log: {rig.workdir / f'{run}.log'}")  # fmt: skip
            return True

        wait_for(lambda: alive() and stream_drained(rig.r), timeout_s=600, what=f"{run}: every entry XACKed",
                 interval_s=POLL_S)  # fmt: skip
        elapsed = time.perf_counter() - started
        cpu_us = {name: (tree_cpu_seconds(pid) - cpu_before[name]) / n * 1e6 for name, pid in pids.items()}
        if bookkeeping:
            wait_for(lambda: alive() and acked_count(rig.url) == n, timeout_s=30,
                     what=f"{run}: every inbox row marked acked")  # fmt: skip
    finally:
        finish_peer(proc)
        log.close()
    return n / elapsed, cpu_us


def print_postgres(pg: PostgresServer) -> None:
    """Which PostgreSQL the figures are of: its version, where its binaries
    are, whether it can JIT and whether the server's default would (every
    Switchboard session sets jit = off: decision 0002)."""
    with psycopg.connect(libpq_url(pg.url()), autocommit=True) as conn:
        row = conn.execute(
            "SELECT current_setting('server_version'), pg_jit_available(), current_setting('jit')"
        ).fetchone()
    assert row is not None
    version, available, default = row
    print(
        f"bench: PostgreSQL {version} from {pg.bindir}, JIT available {available},"
        f" the server's default jit = {default}"
    )
