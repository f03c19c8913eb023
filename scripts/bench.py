"""``make bench``: Switchboard's throughput and latency beside two baselines,
all measured in one run on the same machine, so noise cancels in the ratios.

1. raw: the database's limit for the same three rows per message (inbox,
   event, todo), 1000 messages per transaction, psycopg ``unnest`` with
   binary parameters, no Redis, no Python per-message work beyond building
   the arrays.
2. naive: a one-message-per-transaction consumer (XREADGROUP COUNT 1, three
   INSERTs, COMMIT, XACK), the loop most people write first.
3. switchboard: the real ``switchboard ingest`` and ``switchboard ack``
   processes draining a pre-loaded stream; the clock starts when the adapter
   is enabled and stops when the last entry is XACKed and marked.
4. latency: the same processes at a fixed offered load; XADD -> todo
   committed and XADD -> XACK, from ``track_commit_timestamp``.
5. downstream (issues 12, 42): six no-op drains at the same concurrency
   (2 processes x 8 threads; the asyncio peers at their knobs for 8 per
   process), each timed from its workers ready to its last job done, with
   its CPU per todo by process: bare dramatiq on Redis (its own CLI; the
   queue loaded first and moved in by one RENAME), "dramatiq + one UPDATE
   per message" (the same, each message one committed UPDATE of its job's
   row), pgqueuer and procrastinate (scripts/bench_pg_peers.py: each in a
   database of its own, its schema installed by its own tooling, its jobs
   written by its own batch enqueue), Switchboard's worker half alone
   (``switchboard worker`` on todos pre-stored: the rows the store writes)
   and Switchboard end to end (a pre-loaded stream -> todos -> the same
   no-op as a handler -> done, every entry XACKed; the clock from enabling
   the adapter). The PostgreSQL drains' jobs are written by one
   transaction held open until their workers are ready (listening); its
   commit starts the clock, as the RENAME does for dramatiq's. Then XADD ->
   todo done at the offered rates of ``--done-rates``, with where the time
   goes step by step. The drains run ``--downstream-rounds`` times (3)
   interleaved, the order rotated; each figure is the median of its
   rounds, each ratio the median of the rounds' ratios, printed beside
   issue 42's targets. ``--downstream`` runs this part alone (20,000
   messages).
6. metrics (issue 14): ingest + ack with ``[metrics]`` off and on (each
   endpoint scraped every second), runs interleaved, the ratio of medians.
7. peers (issue 16): Switchboard's ingest + ack beside what a capable user
   writes with FastStream (scripts/bench_faststream.py): batched stream
   subscribers, one and two, with and without Switchboard's bookkeeping,
   writing Switchboard's own tables; interleaved rounds, the order rotated,
   the ratio per round. ``--peers`` runs this part alone; with
   ``--stock-postgres`` on PostgreSQL's default settings.
8. NATS (issue 26, scripts/bench_nats.py): ingest + ack of a JetStream
   adapter on an embedded nats-server beside a batched nats-py consumer,
   the raw limit and the Redis stream pipeline, interleaved rounds (20,000
   messages a run, 10,000 with ``--quick``; ``--nats`` runs this part
   alone: 50,000, 20,000 with ``--quick``).
9. webhooks (issue 30, scripts/bench_webhooks.py): ``switchboard receive``
   beside the same Starlette/uvicorn app answering 200 without storing, at
   a fixed concurrency from a load generator of its own, then the receiver
   at 500 deliveries/s offered; every delivery checked stored
   (``--webhooks`` runs this part alone).
10. console (issue 31, scripts/bench_console.py): ``switchboard web``'s
   pages over loopback on a million-row inbox (100,000 with ``--quick``),
   each beside one ``count(*)`` of that inbox (``--console`` alone).
11. history (issue 45, scripts/bench_history.py): ingest + ack on an empty
   database beside a database retaining 1,000,000 finished messages over 30
   days (100,000 with ``--quick``; ``--history N`` runs this part alone with
   N), interleaved rounds, the ratio per round (target >= 0.9x). With
   ``--packaged-postgres`` on Debian's server, JIT on as users run it.
12. tracing (issue 47, scripts/bench_tracing.py): start-up without the
   ``[otel]`` extra, installed and off, and on; then ingest + ack and end to
   end with tracing off against on, every message carrying a sampled
   ``traceparent``, interleaved rounds (targets: on >= 0.8x of off).
   ``--tracing`` runs this part alone.

Starts its own PostgreSQL and Valkey (as the tests do). Prints msg/s, the
ratios, latency percentiles and the processes' peak RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import psycopg
import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_kit import (  # noqa: E402
    ANY_ACTIVE_TODOS,
    GROUP,
    INGEST_OVERRIDES,
    PEERS,
    POLL_S,
    SCRAPE_INTERVAL_S,
    STREAM,
    WORKER_PROCESSES,
    WORKER_THREADS,
    Rig,
    acked_count,
    any_on,
    bench_naive,
    bench_peer,
    bench_raw,
    bench_switchboard,
    body,
    count_on,
    e2e_config,
    fresh_db,
    preload,
    print_postgres,
    rss_mb,
    set_enabled,
    start,
    start_pipeline,
    stream_drained,
    todos_active,
    todos_done,
    tree_cpu_seconds,
    workers_ready,
)

from backhalf import queries  # noqa: E402
from backhalf.db import libpq_url  # noqa: E402
from backhalf.lifecycle import todos  # noqa: E402
from ingest.children import die_with_parent, reap  # noqa: E402
from ingest.embedded.processes import SwitchboardProcess, WaitTimedOut, wait_for, wait_ready  # noqa: E402
from ingest.embedded.servers import (  # noqa: E402
    PostgresServer,
    RedisServer,
    embedded_servers,
    packaged_postgres_bindir,
)

# Metrics on against off: runs of each, interleaved; each run is scraped this often.
METRICS_ROUNDS = 5
METRICS_MIN_MESSAGES = 50_000  # runs of a few seconds: shorter ones measured start-up noise


# --- 1. the database's limit -------------------------------------------------------------


# --- 2. the naive consumer ---------------------------------------------------------------


# --- 3 and 4. switchboard ----------------------------------------------------------------


def bench_metrics_overhead(
    workdir: Path, pg: Any, r: redis.Redis, redis_url: str, n: int, batch_size: int
) -> dict[bool, list[tuple[float, float]]]:
    """Ingest + ack with metrics off and on, interleaved, the order swapped
    every round (off-on, on-off, ...), so that drift in the machine's load
    and whatever the first run of a pair pays fall on both alike. Each run:
    (msg/s, the ingester's and acker's CPU per message in us). The CPU is
    the steadier figure on a shared machine: throughput also moves with
    whatever else runs."""
    runs: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    for i in range(METRICS_ROUNDS):
        for metrics in (False, True) if i % 2 == 0 else (True, False):
            name = f"metrics{i}{'on' if metrics else 'off'}"
            rig = Rig(workdir, fresh_db(pg, name), r, redis_url, {})
            rate, _rss, cpu_us = bench_switchboard(rig, n, batch_size, metrics=metrics, run=name)
            pg.drop_database(name)
            runs[metrics].append((rate, cpu_us["ingester"] + cpu_us["acker"]))
    return runs


def print_metrics_overhead(runs: dict[bool, list[tuple[float, float]]], n: int) -> None:
    def median(metrics: bool, i: int) -> float:
        return statistics.median(run[i] for run in runs[metrics])

    print(
        f"  metrics on / off, throughput    {median(True, 0) / median(False, 0):>10.3f}x"
        f"  (medians of {METRICS_ROUNDS} runs of {n:,} each, interleaved; scraped every"
        f" {SCRAPE_INTERVAL_S:g} s)"
    )
    print(
        f"  metrics on / off, CPU per msg   {median(True, 1) / median(False, 1):>10.3f}x"
        f"  (ingester + acker: off {median(False, 1):.1f} us, on {median(True, 1):.1f} us)"
    )
    for metrics in (False, True):
        figures = ", ".join(f"{rate:,.0f} msg/s {cpu:.1f} us" for rate, cpu in runs[metrics])
        print(f"    {'on ' if metrics else 'off'} runs: {figures}")


def bench_backlog(
    workdir: Path, url: str, r: redis.Redis, redis_url: str, n: int, batch_size: int
) -> tuple[float, list[tuple[int, float, float, float]]]:
    """Drain a backlog of ``n``; return msg/s and (drained, ingester MB, acker MB, time) samples."""
    preload(r, n)
    ingester, acker = start_pipeline(workdir, url, redis_url, batch_size, f"backlog-{n}")
    samples: list[tuple[int, float, float, float]] = []
    try:
        started = time.perf_counter()
        set_enabled(url, True)
        deadline = started + 3600
        next_sample = started
        # The end is looked for every 10 ms (sleeping 0.5 s between checks
        # quantized a 10,000-message run, about half a second, to 20k or 10k
        # msg/s); RSS and progress are sampled every 0.5 s.
        while not stream_drained(r):
            if time.perf_counter() > deadline:
                raise TimeoutError("bench: backlog not drained within an hour")
            if time.perf_counter() >= next_sample:
                (group,) = r.xinfo_groups(STREAM)
                drained = n - int(group["lag"] or 0)
                samples.append((drained, rss_mb(ingester), rss_mb(acker), time.perf_counter()))
                next_sample += 0.5
            time.sleep(0.01)
        elapsed = time.perf_counter() - started
        wait_for(lambda: acked_count(url) == n, timeout_s=60, what="every inbox row marked acked")
    finally:
        ingester.terminate()
        acker.terminate()
    return n / elapsed, samples


def produce_at(r: redis.Redis, rate: int, seconds: float) -> int:
    """XADD at ``rate`` msg/s for ``seconds``, each body stamped with its send
    time (``t``); return how many were sent."""
    sent = 0
    started = time.perf_counter()
    tick_s = 0.005  # send in 5 ms slices at the offered rate
    while (now := time.perf_counter() - started) < seconds:
        due = int(now * rate) - sent
        if due > 0:
            pipe = r.pipeline(transaction=False)
            for _ in range(due):
                pipe.xadd(STREAM, {"body": json.dumps({"t": time.time(), "i": sent})})
                sent += 1
            pipe.execute()
        time.sleep(tick_s)
    return sent


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def bench_latency(
    workdir: Path, url: str, r: redis.Redis, redis_url: str, rate: int, seconds: float, batch_size: int
) -> dict[str, list[float]]:
    r.delete(STREAM)
    r.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
    set_enabled(url, True)
    ingester, acker = start_pipeline(workdir, url, redis_url, batch_size, "latency")
    sent = 0
    try:
        sent = produce_at(r, rate, seconds)
        wait_for(lambda: stream_drained(r), timeout_s=120, what="the latency run XACKed", interval_s=POLL_S)
        wait_for(lambda: acked_count(url) == sent, timeout_s=30, what="the latency run marked")
    finally:
        ingester.terminate()
        acker.terminate()
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        rows = conn.execute(
            """SELECT extract(epoch FROM pg_xact_commit_timestamp(t.xmin)) - (t.payload->>'t')::float8,
                      extract(epoch FROM pg_xact_commit_timestamp(i.xmin)) - (t.payload->>'t')::float8
               FROM todos t JOIN inbox i ON i.todo_id = t.id"""
        ).fetchall()
    return {
        "XADD -> todo committed": [float(a) * 1000 for a, _ in rows],
        "XADD -> XACK": [float(b) * 1000 for _, b in rows],
    }


# --- 5. downstream ------------------------------------------------------------------------

# The idle poll of the dramatiq drains' own consumers (dramatiq's
# dramatiq_worker_timeout, ms): with dramatiq's default (up to a second)
# they would sleep through the start of the clock while the queue is held
# aside. Switchboard's workers wake on the store's NOTIFY instead.
IDLE_POLL_MS = 50
# The latency to done is measured for this long at each offered rate
# (``--done-rates``).
DONE_SECONDS = 6.0
# Issue 42's targets, side by side in one run: (drain, the drain it is
# divided by, the ratio at least), and XADD -> done at an offered rate
# (p50, p99 at most, ms).
RATIO_TARGETS = (
    ("switchboard", "bare", 1.25),
    ("switchboard", "update", 2.0),
    ("worker_half", "pgqueuer", 1.5),
    ("worker_half", "procrastinate", 10.0),
)
LATENCY_TARGETS_MS = {500: (20.0, 60.0)}


def dramatiq_url(redis_url: str) -> str:
    return redis_url.rsplit("/", 1)[0] + "/1" if redis_url.count("/") > 2 else redis_url + "/1"


def drain_dramatiq(
    workdir: Path,
    redis_url: str,
    queue: str,
    actor: str,
    ids: range,
    servers: dict[str, int],
    env: dict[str, str] | None = None,
) -> tuple[float, dict[str, float]]:
    """A message per id to ``actor`` on ``queue``, drained by dramatiq's own
    CLI (scripts.bench_actors). The queue is loaded first and held aside;
    the clock starts once the worker processes are ready (start-up apart, as
    Switchboard's), when one RENAME moves it in. CPU of dramatiq's processes
    and of ``servers``, per message, over the same span."""
    import dramatiq
    from dramatiq.brokers.redis import RedisBroker

    url = dramatiq_url(redis_url)
    client = redis.Redis.from_url(url, socket_timeout=10)
    client.flushdb()
    loader = RedisBroker(client=client, middleware=[])  # type: ignore[no-untyped-call]
    for i in ids:
        loader.enqueue(dramatiq.Message(queue_name=queue, actor_name=actor, args=(i,), kwargs={}, options={}))
    # Held aside while the workers start: their fetch reads this list only.
    client.rename(f"dramatiq:{queue}", f"dramatiq:{queue}.held")
    log_path = workdir / f"{queue}-dramatiq.log"
    log = log_path.open("wb")
    full_env = {**os.environ, **(env or {}), "BENCH_DRAMATIQ_URL": url,
                "dramatiq_worker_timeout": str(IDLE_POLL_MS)}  # fmt: skip
    proc = subprocess.Popen(  # noqa: S603 - our interpreter, fixed arguments
        [sys.executable, "-m", "dramatiq", "scripts.bench_actors", "--processes", str(WORKER_PROCESSES),
         "--threads", str(WORKER_THREADS), "--queues", queue],
        cwd=ROOT, env=full_env, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    pids = {"dramatiq": proc.pid, **servers}
    n = len(ids)
    try:
        wait_for(
            lambda: log_path.read_text(errors="replace").count("Worker process is ready") >= WORKER_PROCESSES,
            timeout_s=120,
            what=f"the {queue} workers ready",
        )
        cpu_before = {name: tree_cpu_seconds(pid) for name, pid in pids.items()}
        started = time.perf_counter()
        client.rename(f"dramatiq:{queue}.held", f"dramatiq:{queue}")
        wait_for(lambda: client.hlen(f"dramatiq:{queue}.msgs") == 0, timeout_s=600,
                 what=f"the {queue} drain", interval_s=POLL_S)  # fmt: skip
        elapsed = time.perf_counter() - started
        cpu_us = {name: (tree_cpu_seconds(pid) - cpu_before[name]) / n * 1e6 for name, pid in pids.items()}
    finally:
        proc.terminate()
        reap(proc, 60)
        log.close()
        loader.close()
    return n / elapsed, cpu_us


def bench_bare_dramatiq(
    workdir: Path, redis_url: str, n: int, servers: dict[str, int]
) -> tuple[float, dict[str, float]]:
    """dramatiq alone: n no-op messages drained by its CLI."""
    return drain_dramatiq(workdir, redis_url, "bare", "bench_noop", range(n), {"redis": servers["redis"]})


def bench_update_peer(
    workdir: Path, pg: PostgresServer, redis_url: str, n: int, servers: dict[str, int]
) -> tuple[float, dict[str, float]]:
    """The "dramatiq + one UPDATE per message" peer: n jobs in a table of
    their own, a dramatiq message per job, each handled by one committed
    UPDATE of its row; the clock and the CPU as the bare drain's."""
    db = pg.create_database("update_peer")
    with psycopg.connect(libpq_url(db), autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE bench_jobs (id int8 PRIMARY KEY, status text NOT NULL, done_at timestamptz)"
        )
        conn.execute("INSERT INTO bench_jobs SELECT g, 'pending', NULL FROM generate_series(1, %s) g", (n,))
        conn.execute("CHECKPOINT")
    result = drain_dramatiq(workdir, redis_url, "peer", "bench_update", range(1, n + 1), servers,
                            env={"BENCH_PEER_DB": libpq_url(db)})  # fmt: skip
    with psycopg.connect(libpq_url(db), autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM bench_jobs WHERE status = 'done'").fetchone()
    pg.drop_database("update_peer")
    if row is None or int(row[0]) != n:
        raise SystemExit(f"bench: the UPDATE peer finished {row[0] if row else 0} of {n} jobs")
    return result


class WorkerProcesses(Protocol):
    """What a held drain needs of the processes it starts."""

    @property
    def pid(self) -> int: ...

    def terminate(self) -> object: ...


class PeerProcess:
    """A worker process of a PostgreSQL peer (scripts/bench_pg_peers.py),
    run from the repository's root with its output in ``log``; SIGKILLed if
    the bench dies."""

    def __init__(self, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.log = log
        self._out = log.open("wb")
        self._proc = subprocess.Popen(  # noqa: S603 - our interpreter, fixed arguments
            argv, cwd=ROOT, env=env, stdout=self._out, stderr=subprocess.STDOUT, **die_with_parent()
        )

    @property
    def pid(self) -> int:
        return self._proc.pid

    def terminate(self) -> None:
        self._proc.terminate()
        reap(self._proc, 60)
        self._out.close()


def drain_held(
    url: str,
    n: int,
    *,
    run: str,
    write: Callable[[psycopg.Connection[Any]], None],
    start: Callable[[], Sequence[WorkerProcesses]],
    ready: Callable[[psycopg.Connection[Any]], bool],
    any_active_sql: str,
    servers: dict[str, int],
) -> tuple[float, dict[str, float]]:
    """A drain of n jobs in PostgreSQL, timed from its workers ready.
    ``write`` puts the jobs in one transaction, held open while the worker
    processes ``start`` returns come up, until ``ready`` (they are
    listening, and find nothing: the rows are not committed); its commit
    starts the clock, as the RENAME does for the dramatiq drains, and the
    clock stops when ``any_active_sql`` finds none. The CPU of the workers
    (every process ``start`` returned, with its children) and of
    ``servers``, per job, over the same span."""
    procs: Sequence[WorkerProcesses] = ()

    def cpu_s() -> dict[str, float]:
        workers = sum(tree_cpu_seconds(p.pid) for p in procs)
        return {"workers": workers, **{name: tree_cpu_seconds(pid) for name, pid in servers.items()}}

    conninfo = libpq_url(url)
    with (
        psycopg.connect(conninfo, autocommit=True) as holder,
        psycopg.connect(conninfo, autocommit=True) as watcher,
    ):
        # Its questions read the partial indexes of the active states: a scan
        # of the table, as the finished rows grow, was billed to the run
        # being measured.
        watcher.execute("SET enable_seqscan = off")
        try:
            with holder.transaction():
                write(holder)
                watcher.execute("CHECKPOINT")  # the jobs' pages written out now, not during the run
                procs = start()
                wait_for(lambda: ready(watcher), timeout_s=120, what=f"{run}: the workers ready")
                cpu_before = cpu_s()
                started = time.perf_counter()
            # Committed: every job due at once.
            wait_for(lambda: not any_on(watcher, any_active_sql), timeout_s=900,
                     what=f"{run}: every job done", interval_s=POLL_S)  # fmt: skip
            elapsed = time.perf_counter() - started
            cpu_us = {name: (after - cpu_before[name]) / n * 1e6 for name, after in cpu_s().items()}
        finally:
            for proc in procs:
                proc.terminate()
    return n / elapsed, cpu_us


def bench_pg_peer(
    workdir: Path, pg: PostgresServer, name: str, n: int, servers: dict[str, int], run: str
) -> tuple[float, dict[str, float]]:
    """A PostgreSQL job queue (scripts/bench_pg_peers.py) draining n no-op
    jobs in a database of its own, its schema installed by its own tooling,
    its jobs written by its own batch enqueue, drained by
    ``WORKER_PROCESSES`` worker processes at its knobs for 8 in flight.
    Every job is checked finished."""
    import bench_pg_peers  # the bench extra's pgqueuer and procrastinate

    peer = bench_pg_peers.PEERS[name]
    url = pg.create_database(run)
    env = {**os.environ, **bench_pg_peers.libpq_env(libpq_url(url))}
    peer.install(env, workdir / f"{run}-install.log")
    payloads = [body(i) for i in range(n)]
    logs = [workdir / f"{run}-worker{i}.log" for i in range(WORKER_PROCESSES)]
    result = drain_held(
        url,
        n,
        run=run,
        write=lambda conn: peer.enqueue(conn, payloads),
        start=lambda: [PeerProcess(peer.worker_argv(), env, log) for log in logs],
        ready=lambda conn: peer.ready(logs, conn),
        any_active_sql=peer.any_active_sql,
        servers=servers,
    )
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        finished = count_on(conn, peer.finished_sql)
    pg.drop_database(run)
    if finished != n:
        raise SystemExit(f"bench: {name} finished {finished} of {n} jobs; logs in {workdir}")
    return result


# The rows the store writes for a todo: the todo, pending, and its 'created'
# todo_events row, n of them in one statement.
STORE_TODOS = """
WITH t AS (
    INSERT INTO todos (queue, idempotency_key, payload)
    SELECT 'bench', u.k, u.p::jsonb
    FROM unnest(%(keys)b::text[], %(payloads)b::text[]) WITH ORDINALITY AS u(k, p, n) ORDER BY u.n
    RETURNING id
)
INSERT INTO todo_events (todo_id, from_status, to_status, detail)
SELECT id, NULL, 'pending', %(detail)s FROM t
"""


def bench_worker_half(
    workdir: Path, pg: PostgresServer, redis_url: str, n: int, batch_size: int, run: str
) -> tuple[float, dict[str, float]]:
    """Switchboard's worker half alone: n todos pre-stored (the store's rows
    and its NOTIFY, in the held transaction), drained by ``switchboard
    worker`` with the no-op handler; the clock and the CPU as the other
    PostgreSQL drains'. Every todo is checked done."""
    url = fresh_db(pg, run)
    config_path = e2e_config(workdir, url, redis_url, batch_size, run)
    params = {
        "keys": [f"redis:{STREAM}:{i + 1}-0" for i in range(n)],
        "payloads": [body(i).decode() for i in range(n)],
        "detail": todos.CREATED_BY_STORE,
    }

    def write(conn: psycopg.Connection[Any]) -> None:
        conn.execute(STORE_TODOS, params)
        conn.execute(queries.NOTIFY_WORKERS, {"channel": queries.TODO_CHANNEL, "queues": ["bench"]})

    started: list[SwitchboardProcess] = []

    def start() -> list[SwitchboardProcess]:
        started.append(SwitchboardProcess("worker", config_path, workdir / f"{run}-worker.log", cwd=ROOT))
        return started

    result = drain_held(
        url,
        n,
        run=run,
        write=write,
        start=start,
        ready=lambda _conn: workers_ready(started[0]),
        any_active_sql=ANY_ACTIVE_TODOS,
        servers={"postgres": pg.pid},
    )
    done = todos_done(url)
    pg.drop_database(run)
    if done != n:
        raise SystemExit(f"bench: the worker half finished with {done} of {n} todos done; logs in {workdir}")
    return result


def bench_done_latency(
    workdir: Path, url: str, r: redis.Redis, redis_url: str, rate: int, seconds: float, batch_size: int
) -> tuple[list[float], list[tuple[float, float]]]:
    """XADD -> todo done (its last commit), in ms, at ``rate`` msg/s offered
    to the whole deployment: ingester, acker and workers running; and each
    step's p50 and p99 (STAGE_NAMES), in ms."""
    r.delete(STREAM)
    r.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
    set_enabled(url, True)
    run = f"done-latency-{rate}"  # logs of their own: wait_ready looks for a line in them
    config_path = e2e_config(workdir, url, redis_url, batch_size, run)
    procs = [
        start("ack", config_path, workdir / f"{run}-acker.log"),
        start("ingest", config_path, workdir / f"{run}-ingester.log"),
        SwitchboardProcess("worker", config_path, workdir / f"{run}-worker.log", cwd=ROOT),
    ]
    sent = 0
    try:
        wait_ready(procs[0])
        wait_ready(procs[1])
        wait_for(lambda: workers_ready(procs[2]), timeout_s=120, what=f"{run}: the workers ready")
        sent = produce_at(r, rate, seconds)
        try:
            wait_for(lambda: stream_drained(r) and todos_active(url) == 0, timeout_s=120,
                     what=f"the latency run at {rate}/s done", interval_s=POLL_S)  # fmt: skip
        except WaitTimedOut:
            with psycopg.connect(libpq_url(url), autocommit=True) as conn:
                counts = conn.execute("SELECT status, count(*) FROM todos GROUP BY status").fetchall()
            print(f"bench: the latency run at {rate}/s did not finish: todos {counts}, logs in {workdir}")
            raise
    finally:
        for proc in reversed(procs):
            proc.terminate()
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        rows = conn.execute(
            """SELECT extract(epoch FROM pg_xact_commit_timestamp(t.xmin)) - (t.payload->>'t')::float8
               FROM todos t WHERE t.status = 'done'"""
        ).fetchall()
        # Where the time goes: each step's p50 and p99, from todo_events
        # (created_at is its transaction's start).
        stages = conn.execute(STAGES).fetchone()
    if len(rows) != sent:
        raise SystemExit(f"bench: the latency run finished {len(rows)} of {sent} todos")
    assert stages is not None
    steps = [(p50 * 1000, p99 * 1000) for p50, p99 in stages]
    return [float(a) * 1000 for (a,) in rows], steps


# The todo's path (DESIGN.md section 7b): created pending by the store, then
# claimed (running) by a worker, then done.
STAGE_NAMES = ("XADD->pending", "pending->running", "running->done")
STAGES = """
WITH x AS (
    SELECT (t.payload->>'t')::float8 AS sent,
           extract(epoch FROM min(e.created_at) FILTER (WHERE e.to_status = 'pending')) AS p,
           extract(epoch FROM max(e.created_at) FILTER (WHERE e.to_status = 'running')) AS r,
           extract(epoch FROM max(e.created_at) FILTER (WHERE e.to_status = 'done')) AS f
    -- by the primary key: todos is partitioned by status, which it holds
    FROM todos t JOIN todo_events e ON e.todo_id = t.id GROUP BY t.id, t.status
)
SELECT percentile_cont(ARRAY[0.5, 0.99]) WITHIN GROUP (ORDER BY p - sent),
       percentile_cont(ARRAY[0.5, 0.99]) WITHIN GROUP (ORDER BY r - p),
       percentile_cont(ARRAY[0.5, 0.99]) WITHIN GROUP (ORDER BY f - r)
FROM x
"""


def bench_end_to_end(rig: Rig, n: int, batch_size: int, run: str) -> tuple[float, dict[str, float]]:
    """Switchboard end to end: entries to todos done by the no-op handler.
    The clock starts once every process is ready (start-up apart, as the
    bare drain's) with the adapter enabled, and stops when every todo is
    done and every entry acked; the CPU is counted over the same span."""
    preload(rig.r, n)
    config_path = e2e_config(rig.workdir, rig.url, rig.redis_url, batch_size, run)
    acker = start("ack", config_path, rig.workdir / f"{run}-acker.log")
    ingester = start("ingest", config_path, rig.workdir / f"{run}-ingester.log")
    worker = SwitchboardProcess("worker", config_path, rig.workdir / f"{run}-worker.log", cwd=ROOT)
    pids = {"workers": worker.pid, "ingester": ingester.pid, "acker": acker.pid, **rig.servers}
    watcher: psycopg.Connection[Any] | None = None
    try:
        watcher = psycopg.connect(libpq_url(rig.url), autocommit=True)
        watcher.execute("SET enable_seqscan = off")  # it reads the partial indexes, as the table grows
        wait_ready(acker)
        wait_ready(ingester)
        wait_for(lambda: workers_ready(worker), timeout_s=120, what=f"{run}: the workers ready")
        cpu_before = {name: tree_cpu_seconds(pid) for name, pid in pids.items()}
        started = time.perf_counter()
        set_enabled(rig.url, True)
        # Drained: all n stored (and acked); none active: all finished.
        conn = watcher
        wait_for(lambda: stream_drained(rig.r) and not any_on(conn, ANY_ACTIVE_TODOS), timeout_s=900,
                 what="every todo done", interval_s=POLL_S)  # fmt: skip
        elapsed = time.perf_counter() - started
        cpu_us = {name: (tree_cpu_seconds(pid) - cpu_before[name]) / n * 1e6 for name, pid in pids.items()}
    finally:
        if watcher is not None:
            watcher.close()
        for proc in (worker, ingester, acker):
            proc.terminate()
    done = todos_done(rig.url)
    if done != n:
        raise SystemExit(f"bench: end to end finished with {done} of {n} todos done")
    return n / elapsed, cpu_us


# Issue 25: the downstream comparison, interleaved, the median of its rounds.
DOWNSTREAM_ROUNDS = 3
# The drains, in the first round's order, and how they are printed.
DRAINS = {
    "bare": "bare dramatiq no-op drain",
    "update": "dramatiq + one UPDATE a message",
    "pgqueuer": "pgqueuer no-op drain",
    "procrastinate": "procrastinate no-op drain",
    "worker_half": "Switchboard worker half",
    "switchboard": "Switchboard end to end",
}


def print_downstream(
    base: Path, pg: Any, rs: Any, n: int, batch_size: int, rates: list[int], rounds: int = DOWNSTREAM_ROUNDS
) -> None:
    """The six drains (DRAINS), ``rounds`` times interleaved (the order
    rotated each round, so a slow minute of a shared machine falls on each
    in turn), each figure the median of its rounds and each ratio the
    median of the rounds' ratios, beside issue 42's targets; then XADD ->
    done at each of ``rates``."""
    servers = {"postgres": pg.pid, "redis": rs.pid}
    pg_only = {"postgres": pg.pid}
    r = redis.Redis.from_url(rs.url)

    def switchboard(run: str) -> tuple[float, dict[str, float]]:
        result = bench_end_to_end(Rig(base, fresh_db(pg, run), r, rs.url, servers), n, batch_size, run)
        pg.drop_database(run)
        return result

    runs: dict[str, Callable[[str], tuple[float, dict[str, float]]]] = {
        "bare": lambda _run: bench_bare_dramatiq(base, rs.url, n, servers),
        "update": lambda _run: bench_update_peer(base, pg, rs.url, n, servers),
        "pgqueuer": lambda run: bench_pg_peer(base, pg, "pgqueuer", n, pg_only, run),
        "procrastinate": lambda run: bench_pg_peer(base, pg, "procrastinate", n, pg_only, run),
        "worker_half": lambda run: bench_worker_half(base, pg, rs.url, n, batch_size, run),
        "switchboard": switchboard,
    }
    results: dict[str, list[tuple[float, dict[str, float]]]] = {name: [] for name in runs}
    order = list(runs)
    for i in range(rounds):
        for name in order[i % len(order) :] + order[: i % len(order)]:
            # A run's name is its database's and its logs': new each round.
            results[name].append(runs[name](f"{name}_{i + 1}"))
        line = ", ".join(f"{k} {v[-1][0]:,.0f}" for k, v in results.items())
        print(f"  round {i + 1}: todos/s {line}")

    def median_rate(name: str) -> float:
        return statistics.median(x for x, _ in results[name])

    def cpu(name: str) -> str:
        keys = results[name][0][1]
        return ", ".join(f"{k} {statistics.median(c[k] for _, c in results[name]):.0f} us" for k in keys)

    shape = f"{WORKER_PROCESSES} processes x {WORKER_THREADS} threads (or the asyncio peers' equivalents)"
    print(f"  medians of {rounds} rounds, {n:,} todos each, {shape}, from the workers ready:")
    for name, label in DRAINS.items():
        print(f"  {label:<34} {median_rate(name):>10,.0f} todos/s")
        print(f"    CPU per todo                     {cpu(name)}")
    for name, base_name, target in RATIO_TARGETS:
        each = [a[0] / b[0] for a, b in zip(results[name], results[base_name], strict=True)]
        ratio = statistics.median(each)
        spread = f" (rounds {min(each):.2f}-{max(each):.2f})" if len(each) > 1 else ""
        verdict = "met" if ratio >= target else "not met"
        print(f"  {DRAINS[name]} / {DRAINS[base_name]}: {ratio:.2f}x{spread}"
              f"  target >= {target:g}x: {verdict}")  # fmt: skip
    for rate in rates:
        run = f"done_latency_{rate}"
        values, steps = bench_done_latency(base, fresh_db(pg, run), r, rs.url, rate, DONE_SECONDS, batch_size)
        pg.drop_database(run)
        p50, p99 = percentile(values, 50), percentile(values, 99)
        verdict = ""
        if (bounds := LATENCY_TARGETS_MS.get(rate)) is not None:
            met = "met" if p50 <= bounds[0] and p99 <= bounds[1] else "not met"
            verdict = f"  target p50 <= {bounds[0]:g} ms, p99 <= {bounds[1]:g} ms: {met}"
        print(f"  XADD -> todo done at {rate}/s  p50 {p50:6.1f} ms  p99 {p99:6.1f} ms"
              f"  max {max(values):6.1f} ms  (n={len(values)}){verdict}")  # fmt: skip
        print("    steps, p50/p99 ms: " + ", ".join(
            f"{name} {a:.0f}/{b:.0f}" for name, (a, b) in zip(STAGE_NAMES, steps, strict=True)
        ))  # fmt: skip


# --- 7. the FastStream peers (issue 16) -------------------------------------------------

PEER_ROUNDS = 4


def bench_peers(workdir: Path, pg: Any, rs: Any, n: int, batch_size: int, rounds: int) -> None:
    """Switchboard (ingest + ack) and each FastStream peer, drained from the
    same pre-loaded stream in fresh databases, interleaved over ``rounds``
    rounds, the order rotated each round; Switchboard's msg/s divided by each
    peer's of the same round."""
    r = redis.Redis.from_url(rs.url)
    servers = {"postgres": pg.pid, "redis": rs.pid}
    names = ["switchboard", *(label for label, _, _ in PEERS)]
    rates: dict[str, list[float]] = {name: [] for name in names}
    cpus: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    print(f"  FastStream peers: {n:,} messages per run, {rounds} rounds, order rotated each round")
    for i in range(rounds):
        order = names[i % len(names) :] + names[: i % len(names)]
        for name in order:
            db = f"peer{i}_{names.index(name)}"
            url = fresh_db(pg, db)
            if name == "switchboard":
                rate, _rss, cpu = bench_switchboard(
                    Rig(workdir, url, r, rs.url, servers), n, batch_size, run=db
                )
            else:
                _, subscribers, bookkeeping = next(p for p in PEERS if p[0] == name)
                rate, cpu = bench_peer(Rig(workdir, url, r, rs.url, servers), n, subscribers, bookkeeping, db)
            pg.drop_database(db)
            rates[name].append(rate)
            cpus[name].append(cpu)
        sb = rates["switchboard"][-1]
        print(f"    round {i + 1}: switchboard {sb:,.0f} msg/s; " + ", ".join(
            f"{label} {rates[label][-1]:,.0f} ({sb / rates[label][-1]:.2f}x)" for label, _, _ in PEERS
        ))  # fmt: skip
    for label, _, _ in PEERS:
        ratios = [a / b for a, b in zip(rates["switchboard"], rates[label], strict=True)]
        print(f"  switchboard / {label:<32} median {statistics.median(ratios):.2f}x"
              f"  (min {min(ratios):.2f}x, max {max(ratios):.2f}x)")  # fmt: skip
    for name in names:
        medians = {k: statistics.median(c[k] for c in cpus[name]) for k in cpus[name][0]}
        print(f"    CPU per message, {name:<32} " + ", ".join(f"{k} {v:.1f} us" for k, v in medians.items()))


# --- 8. NATS (issue 26) -------------------------------------------------------------------


def bench_nats_part(base: Path, pg: PostgresServer, rs: Any, n: int, batch_size: int) -> None:
    """scripts/bench_nats.py's rounds, with this run's Redis stream pipeline."""
    import bench_nats  # nats-py: the embedded kit's

    r = redis.Redis.from_url(rs.url)

    def redis_run(url: str, servers: dict[str, int], run: str) -> tuple[float, dict[str, float]]:
        rate, _rss, cpu = bench_switchboard(Rig(base, url, r, rs.url, servers), n, batch_size, run=run)
        return rate, cpu

    bench_nats.compare(base, pg, rs.pid, redis_run, n, batch_size)


# --- 9. webhooks (issue 30) ---------------------------------------------------------------


def bench_webhooks_part(base: Path, pg: PostgresServer, quick: bool) -> None:
    """scripts/bench_webhooks.py's runs on this run's PostgreSQL."""
    import bench_webhooks  # Starlette and uvicorn: the http extra's

    bench_webhooks.compare(base, pg, quick=quick)


# --- 10. the console (issue 31) -----------------------------------------------------------


def bench_console_part(base: Path, pg: PostgresServer, rs: RedisServer, quick: bool) -> None:
    """scripts/bench_console.py's pages on this run's PostgreSQL."""
    import bench_console

    bench_console.compare(base, pg, rs.url, quick=quick)


def bench_history_part(base: Path, pg: PostgresServer, rs: RedisServer, retained: int, n: int) -> None:
    """scripts/bench_history.py's comparison on this run's servers; its databases dropped after."""
    import bench_history

    bench_history.compare(base, pg, rs.url, retained, n)
    pg.drop_database("hist_empty")
    pg.drop_database("hist_full")


def bench_tracing_part(base: Path, pg: PostgresServer, rs: RedisServer, n: int) -> None:
    """scripts/bench_tracing.py's comparison on this run's servers."""
    import bench_tracing

    bench_tracing.compare(base, pg, rs.url, n)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a short run (about a minute)")
    parser.add_argument("--messages", type=int, help="messages for the throughput runs")
    parser.add_argument("--rate", type=int, default=2000, help="offered load for the latency run, msg/s")
    parser.add_argument("--batch-size", type=int, default=2000, help="the adapter's batch_size")
    parser.add_argument("--keep-logs", action="store_true", help="keep the processes' logs")
    parser.add_argument("--commits-in-flight", type=int, help="the ingester's commits_in_flight")
    parser.add_argument(
        "--backlog",
        type=int,
        metavar="N",
        help="instead: drain a backlog of 10,000 and one of N, compare msg/s, and sample RSS over N",
    )
    parser.add_argument(
        "--downstream",
        action="store_true",
        help="only the downstream figures: Switchboard's workers and end to end beside four peers' drains",
    )
    parser.add_argument(
        "--peers",
        action="store_true",
        help="only Switchboard beside the FastStream peers (issue 16), in interleaved rounds",
    )
    parser.add_argument("--rounds", type=int, default=PEER_ROUNDS, help="rounds of the peer comparison")
    parser.add_argument(
        "--nats",
        action="store_true",
        help="only the NATS comparison (issue 26): JetStream beside nats-py, raw and the Redis stream",
    )
    parser.add_argument(
        "--webhooks",
        action="store_true",
        help="only the webhook receiver (issue 30): switchboard receive beside a no-store server",
    )
    parser.add_argument(
        "--console",
        action="store_true",
        help="only the console (issue 31): its pages on a million-row inbox beside a count(*) of it",
    )
    parser.add_argument(
        "--stock-postgres",
        action="store_true",
        help="PostgreSQL on its default settings (but listen_addresses): shared_buffers 128MB",
    )
    parser.add_argument(
        "--history", type=int, metavar="N", help="only the history part, with N finished messages retained"
    )
    parser.add_argument(
        "--tracing", action="store_true", help="only the tracing part (issue 47): tracing off against on"
    )
    parser.add_argument(
        "--packaged-postgres",
        action="store_true",
        help="the machine's packaged PostgreSQL (Debian's, JIT on as users run it) instead of pgserver's",
    )
    parser.add_argument(
        "--done-rates",
        type=lambda text: [int(x) for x in text.split(",")],
        default=[500],
        metavar="R,R",
        help="offered rates (msg/s) at which XADD -> todo done is measured (default: 500)",
    )
    parser.add_argument(
        "--downstream-rounds",
        type=int,
        default=DOWNSTREAM_ROUNDS,
        help=f"interleaved rounds of the downstream comparison (default: {DOWNSTREAM_ROUNDS})",
    )
    args = parser.parse_args(argv)
    if args.commits_in_flight:
        INGEST_OVERRIDES["commits_in_flight"] = args.commits_in_flight
    n = args.messages or (20_000 if args.quick else 100_000)
    naive_n = max(1000, n // 20)
    latency_s = 3.0 if args.quick else 10.0

    # Sized like a small production server rather than the test suite's
    # 16 MB: a million-message run must not measure cache thrashing.
    pg_conf = "track_commit_timestamp = on\nshared_buffers = 1GB\nmax_wal_size = 4GB\n"
    if args.stock_postgres:  # the defaults the embedded server overrides, set back
        pg_conf = "shared_buffers = 128MB\nmax_connections = 100\n"
    postgres_bin = None
    if args.packaged_postgres:
        postgres_bin = packaged_postgres_bindir()
        if postgres_bin is None:
            raise SystemExit(
                "bench: --packaged-postgres: no /usr/lib/postgresql/*/bin/postgres on this machine"
            )
    with embedded_servers(
        "switchboard-bench-",
        appendfsync="everysec",
        postgres_conf=pg_conf,
        keep_base=args.keep_logs,
        postgres_bin=postgres_bin,
    ) as servers:
        base, pg, rs = servers.base, servers.postgres, servers.redis
        try:
            r = redis.Redis.from_url(rs.url)
            print_postgres(pg)
            if args.backlog:
                small, _ = bench_backlog(base, fresh_db(pg, "small"), r, rs.url, 10_000, args.batch_size)
                pg.drop_database("small")
                large, samples = bench_backlog(
                    base, fresh_db(pg, "large"), r, rs.url, args.backlog, args.batch_size
                )
                print(
                    f"bench: backlog of 10,000: {small:,.0f} msg/s; of {args.backlog:,}: {large:,.0f} msg/s"
                )
                print(f"  ratio large/small backlog       {large / small:>10.2f}x")
                warm = [s for s in samples if s[0] >= args.backlog // 10] or samples
                tenth = max(1, len(samples) // 10)
                for label, part in (("first", samples[:tenth]), ("last", samples[-tenth:])):
                    rate = (part[-1][0] - part[0][0]) / max(part[-1][3] - part[0][3], 1e-9)
                    print(f"  drain rate over the {label} tenth of the run  {rate:>10,.0f} msg/s")
                for name, col in (("ingester", 1), ("acker", 2)):
                    first, last, top = warm[0][col], warm[-1][col], max(s[col] for s in warm)
                    print(
                        f"  {name} RSS after 10%: {first:.0f} MB, at the end: {last:.0f} MB,"
                        f" max {top:.0f} MB ({(top / first - 1) * 100:+.1f}%)"
                    )
                return 0
            if args.peers:
                print(f"bench: {os.cpu_count()} CPUs, the FastStream peers only, batch {args.batch_size}"
                      f"{', stock PostgreSQL' if args.stock_postgres else ''}")  # fmt: skip
                bench_peers(base, pg, rs, args.messages or 50_000, args.batch_size, args.rounds)
                return 0
            if args.nats:
                print(f"bench: {os.cpu_count()} CPUs, NATS only")
                bench_nats_part(
                    base, pg, rs, args.messages or (20_000 if args.quick else 50_000), args.batch_size
                )
                return 0
            if args.webhooks:
                print(f"bench: {os.cpu_count()} CPUs, the webhook receiver only")
                bench_webhooks_part(base, pg, args.quick)
                return 0
            if args.console:
                print(f"bench: {os.cpu_count()} CPUs, the console only")
                bench_console_part(base, pg, rs, args.quick)
                return 0
            if args.history:
                print(f"bench: {os.cpu_count()} CPUs, the history only")
                bench_history_part(base, pg, rs, args.history, args.messages or 50_000)
                return 0
            if args.tracing:
                print(f"bench: {os.cpu_count()} CPUs, tracing only")
                bench_tracing_part(base, pg, rs, args.messages or (10_000 if args.quick else 40_000))
                return 0
            if args.downstream:
                down_n = args.messages or 20_000
                print(f"bench: {os.cpu_count()} CPUs, downstream only, {down_n} messages")
                print_downstream(
                    base, pg, rs, down_n, args.batch_size, args.done_rates, args.downstream_rounds
                )
                return 0
            print(f"bench: {os.cpu_count()} CPUs, {n} messages (naive: {naive_n}), batch {args.batch_size}")
            raw = bench_raw(fresh_db(pg, "raw"), n)
            # Each baseline's database goes once measured: left behind, its
            # autovacuum (100k+ inserted rows) ran during the next measurement and
            # was billed to it (PostgreSQL 30 -> 40 us per message at 300k).
            pg.drop_database("raw")
            print(f"  raw psycopg unnest, 1000/tx     {raw:>10,.0f} msg/s")
            naive = bench_naive(fresh_db(pg, "naive"), r, naive_n)
            pg.drop_database("naive")
            print(f"  naive 1 msg/tx consumer         {naive:>10,.0f} msg/s")
            server_pids = {"postgres": pg.pid, "redis": rs.pid}
            rig = Rig(base, fresh_db(pg, "sb"), r, rs.url, server_pids)
            sb, rss, cpu_us = bench_switchboard(rig, n, args.batch_size)
            pg.drop_database("sb")
            print(f"  switchboard ingest + ack        {sb:>10,.0f} msg/s")
            print(f"  ratio to raw                    {sb / raw:>10.2f}x")
            print(f"  ratio to naive                  {sb / naive:>10.1f}x")
            print(
                f"  peak RSS                        ingester {rss['ingester']:.0f} MB,"
                f" acker {rss['acker']:.0f} MB"
            )
            print(
                "  CPU per message                 " + ", ".join(f"{k} {v:.0f} us" for k, v in cpu_us.items())
            )
            # Issue 16: beside the FastStream peers, 50,000 messages per run
            # (its measurements' size), at least three rounds.
            peer_n = args.messages or (20_000 if args.quick else 50_000)
            bench_peers(base, pg, rs, peer_n, args.batch_size, max(3, args.rounds))
            # Issue 26, 20,000 messages a run here (10,000 with --quick): about
            # 1.5 minutes on a loaded day, the stream's load (every write
            # synced) the slow part; ``--nats`` alone runs 50,000.
            bench_nats_part(
                base, pg, rs, args.messages or (10_000 if args.quick else 20_000), args.batch_size
            )
            bench_webhooks_part(base, pg, args.quick)
            bench_console_part(base, pg, rs, args.quick)
            bench_history_part(
                base, pg, rs, 100_000 if args.quick else 1_000_000, 20_000 if args.quick else 50_000
            )
            bench_tracing_part(base, pg, rs, 10_000 if args.quick else 40_000)
            metrics_n = max(n, METRICS_MIN_MESSAGES)
            runs = bench_metrics_overhead(base, pg, r, rs.url, metrics_n, args.batch_size)
            print_metrics_overhead(runs, metrics_n)
            latencies = bench_latency(
                base, fresh_db(pg, "lat"), r, rs.url, args.rate, latency_s, args.batch_size
            )
            for name, values in latencies.items():
                print(
                    f"  {name:<24} at {args.rate}/s  p50 {percentile(values, 50):6.1f} ms  "
                    f"p99 {percentile(values, 99):6.1f} ms  max {max(values):6.1f} ms  (n={len(values)})"
                )
            down_n = max(2000, n // 5)  # 20,000 in a full run, 4,000 with --quick
            print_downstream(base, pg, rs, down_n, args.batch_size, args.done_rates, args.downstream_rounds)
        finally:
            if args.keep_logs:
                print(f"bench: logs kept in {base}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
