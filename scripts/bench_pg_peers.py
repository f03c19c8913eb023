"""The PostgreSQL job queues beside Switchboard's workers in ``make bench``'s
downstream part (issue 42): pgqueuer and procrastinate, each run as its
own worker processes at the workers' concurrency, draining no-op jobs. Not
part of the product: the ``bench`` extra brings both.

Two sides live here:

* **What the peers' workers load**: pgqueuer's factory
  (:func:`pgqueuer_manager`: a ``QueueManager`` on one asyncpg connection,
  pgqueuer's default and fastest driver, with a no-op entrypoint), run by
  ``pgqueuer.run``, the programmatic twin of ``pgq run``
  (:func:`run_pgqueuer_worker`: this file's ``pgqueuer-worker`` command);
  and procrastinate's app (``procrastinate_app``: a no-op task on queue
  ``bench``), run by procrastinate's own CLI. Both connect through libpq's
  environment (``PGHOST``, ``PGPORT``, ``PGUSER``, ``PGPASSWORD``,
  ``PGDATABASE``: :func:`libpq_env`), which the bench sets to the peer's
  own database.
* **What the bench asks of each peer** (:class:`Peer`): its schema installed
  by its own tooling (``pgq install`` and the ``pgq autovac`` its tuning
  guide recommends; ``procrastinate schema --apply``); n jobs written by its
  own batch enqueue (pgqueuer's ``SyncQueries.enqueue``, procrastinate's
  ``batch_defer``) on a connection of the bench's, inside a transaction the
  bench holds open until the workers are ready and whose commit starts the
  clock; the command of one worker process; whether its processes are
  ready (listening); and its count of jobs not finished, and of jobs
  finished.

The knobs, per process (the bench runs two of each, as it runs
``switchboard worker --processes 2 --threads 8``):

* pgqueuer: ``batch_size=8`` (a dequeue claims at most what 8 threads
  start) and ``max_concurrent_tasks=16`` (its per-process cap on the jobs
  it holds, run or awaiting their completion's write: 8 in flight and a
  prefetch of 8 more, the most dramatiq's workers hold (their prefetch is
  twice their threads) and Switchboard's (at most a thread's worth of
  prefetch); pgqueuer requires the cap to be at least twice the batch).
  Its completions are written in batches of the same size. The other
  settings are ``pgq run``'s defaults. (With a cap of 8, and so batches of
  4, it drained less than half as fast in small runs: a dequeue then waits
  for the write of 4 completions.)
* procrastinate: ``--concurrency 8`` (it fetches one job per statement; it
  has no batch knob), LISTEN/NOTIFY on (its default), and ``--log-level
  warning``: its two INFO lines per job are off, as no other drain here
  logs per job.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import subprocess
import sys
from collections.abc import AsyncIterator, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

import asyncpg
import pgqueuer
import procrastinate
import psycopg
from pgqueuer import AsyncpgDriver, Job, Queries, QueueManager
from pgqueuer.adapters.drivers.psycopg import SyncPsycopgDriver
from pgqueuer.adapters.persistence.queries import SyncQueries
from pgqueuer.core import logconfig
from pgqueuer.domain.errors import FailingListenerError
from psycopg.conninfo import conninfo_to_dict

ENTRYPOINT = "bench_noop"  # pgqueuer's entrypoint and procrastinate's task name
QUEUE = "bench"  # procrastinate's queue
CONCURRENCY = 8  # jobs in flight per process: the threads of Switchboard's and dramatiq's
PGQ_BATCH_SIZE = CONCURRENCY
# Held at most, prefetched included: pgqueuer refuses a cap under twice the batch.
PGQ_MAX_CONCURRENT_TASKS = 2 * CONCURRENCY
PGQ_READY = "bench_pg_peers: pgqueuer is listening"
# How long one probe of pgqueuer's listener waits for its own notification.
PGQ_PROBE_TIMEOUT_S = 0.2
INSTALL_TIMEOUT_S = 120
ROOT = Path(__file__).resolve().parents[1]
THIS = "scripts.bench_pg_peers"  # as the peers' CLIs import it, from ROOT


def libpq_env(libpq_url: str) -> dict[str, str]:
    """libpq's environment variables for a ``postgresql://`` URL: how the
    peers' processes (and asyncpg, which reads the same ones) find their
    database without a password on a command line."""
    names = {"host": "PGHOST", "port": "PGPORT", "user": "PGUSER", "password": "PGPASSWORD",
             "dbname": "PGDATABASE"}  # fmt: skip
    parts = conninfo_to_dict(libpq_url)
    return {names[k]: str(v) for k, v in parts.items() if k in names and v is not None}


# --- what pgqueuer's CLI loads ------------------------------------------------------------


async def pgqueuer_noop(job: Job) -> None:
    """pgqueuer's own per-job cost, and nothing else."""


@contextlib.asynccontextmanager
async def pgqueuer_manager() -> AsyncIterator[QueueManager]:
    """``pgq run scripts.bench_pg_peers:pgqueuer_manager``: one asyncpg
    connection, the no-op entrypoint; prints ``PGQ_READY`` once the manager's
    listener answers (its run loop is up and LISTENing)."""
    connection = await asyncpg.connect()
    manager = QueueManager(Queries(AsyncpgDriver(connection)))
    manager.entrypoint(ENTRYPOINT)(pgqueuer_noop)
    announcer = asyncio.create_task(_announce_listening(manager))
    try:
        yield manager
    finally:
        announcer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await announcer
        await connection.close()


def run_pgqueuer_worker(
    batch_size: int = PGQ_BATCH_SIZE, max_concurrent_tasks: int = PGQ_MAX_CONCURRENT_TASKS
) -> None:
    """What ``pgq run scripts.bench_pg_peers:pgqueuer_manager --batch-size 8
    --max-concurrent-tasks 16`` does, through ``pgqueuer.run``, the CLI's own
    programmatic twin: ``pgq run`` of pgqueuer 1.6.0 stops at start with
    typer 0.29 (its ``--log-level`` reaches the logger set-up as a string).
    The CLI's logging, at its default level."""
    logconfig.setup_fancy_logger(logconfig.LogLevel.INFO)
    asyncio.run(
        pgqueuer.run(
            pgqueuer_manager, batch_size=batch_size, max_concurrent_tasks=max_concurrent_tasks or None
        )
    )


async def _announce_listening(manager: QueueManager) -> None:
    """pgqueuer's own round trip of a NOTIFY to its listener: it answers only
    once ``run`` has set the listener up."""
    while True:
        try:
            await manager.listener_healthy(timeout=timedelta(seconds=PGQ_PROBE_TIMEOUT_S))
        except FailingListenerError:
            continue
        print(PGQ_READY, flush=True)
        return


# --- what procrastinate's CLI loads -------------------------------------------------------

# No connection argument: the pool connects through libpq's environment.
procrastinate_app = procrastinate.App(connector=procrastinate.PsycopgConnector())


async def _procrastinate_noop(**payload: Any) -> None:
    """procrastinate's own per-job cost, and nothing else."""


# Registered by a call, not a decorator: where the bench extra is not
# installed, mypy sees procrastinate (and pgqueuer) as untyped, and strict
# mode refuses a function made untyped by its decorator.
procrastinate_noop = procrastinate_app.task(name=ENTRYPOINT, queue=QUEUE)(_procrastinate_noop)


# --- what the bench asks of a peer ----------------------------------------------------------


class Peer(Protocol):
    name: str
    # Whether any job is not finished yet (the first one found ends each
    # walk of the peer's own partial indexes: it is asked every 10 ms), and
    # how many are finished.
    any_active_sql: str
    finished_sql: str

    def install(self, env: Mapping[str, str], log: Path) -> None:
        """The peer's schema, by its own tooling, in the database of ``env``."""

    def enqueue(self, conn: psycopg.Connection[Any], payloads: Sequence[bytes]) -> None:
        """One job per payload, by the peer's own batch enqueue, on ``conn``
        (autocommit, inside the caller's open transaction)."""

    def worker_argv(self) -> list[str]:
        """One worker process of ``CONCURRENCY``, run from ``ROOT``."""

    def ready(self, logs: Sequence[Path], conn: psycopg.Connection[Any]) -> bool:
        """Every worker process started with ``logs`` listening."""


def _run(argv: list[str], env: Mapping[str, str], log: Path) -> None:
    with log.open("ab") as out:
        subprocess.run(argv, cwd=ROOT, env=dict(env), stdout=out, stderr=subprocess.STDOUT,  # noqa: S603
                       check=True, timeout=INSTALL_TIMEOUT_S)  # fmt: skip


class PgQueuer:
    name = "pgqueuer"
    any_active_sql = (
        "SELECT EXISTS (SELECT 1 FROM pgqueuer WHERE status = 'queued')"
        " OR EXISTS (SELECT 1 FROM pgqueuer WHERE status = 'picked')"
    )
    finished_sql = "SELECT count(*) FROM pgqueuer_log WHERE status = 'successful'"

    def install(self, env: Mapping[str, str], log: Path) -> None:
        for command in ("install", "autovac"):
            _run([sys.executable, "-m", "pgqueuer", command], env, log)

    def enqueue(self, conn: psycopg.Connection[Any], payloads: Sequence[bytes]) -> None:
        n = len(payloads)
        SyncQueries(SyncPsycopgDriver(conn)).enqueue([ENTRYPOINT] * n, list(payloads), [0] * n)

    def worker_argv(self) -> list[str]:
        return [sys.executable, str(Path(__file__)), "pgqueuer-worker"]

    def ready(self, logs: Sequence[Path], conn: psycopg.Connection[Any]) -> bool:
        return all(PGQ_READY in log.read_text(errors="replace") for log in logs)


class Procrastinate:
    name = "procrastinate"
    any_active_sql = "SELECT EXISTS (SELECT 1 FROM procrastinate_jobs WHERE status IN ('todo', 'doing'))"
    finished_sql = "SELECT count(*) FROM procrastinate_jobs WHERE status = 'succeeded'"
    APP = f"--app={THIS}.procrastinate_app"

    def install(self, env: Mapping[str, str], log: Path) -> None:
        _run([sys.executable, "-m", "procrastinate", self.APP, "schema", "--apply"], env, log)

    def enqueue(self, conn: psycopg.Connection[Any], payloads: Sequence[bytes]) -> None:
        procrastinate_noop.configure(connection=conn).batch_defer(*(json.loads(p) for p in payloads))

    def worker_argv(self) -> list[str]:
        return [sys.executable, "-m", "procrastinate", self.APP, "--log-level", "warning", "worker",
                "--concurrency", str(CONCURRENCY), "--queues", QUEUE]  # fmt: skip

    def ready(self, logs: Sequence[Path], conn: psycopg.Connection[Any]) -> bool:
        """Each worker's notification connection has run its LISTEN (its last
        statement until its first keep-alive, 30 s on): procrastinate says
        nothing when it is listening."""
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND query LIKE 'LISTEN %procrastinate%'"
        ).fetchone()
        return row is not None and int(row[0]) >= len(logs)


PEERS: dict[str, Peer] = {"pgqueuer": PgQueuer(), "procrastinate": Procrastinate()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("command", choices=["pgqueuer-worker"], help="one pgqueuer worker process")
    parser.add_argument("--batch-size", type=int, default=PGQ_BATCH_SIZE, help="pgqueuer's batch_size")
    parser.add_argument("--max-concurrent-tasks", type=int, default=PGQ_MAX_CONCURRENT_TASKS,
                        help="pgqueuer's max_concurrent_tasks (0: no cap)")  # fmt: skip
    args = parser.parse_args(argv)
    run_pgqueuer_worker(args.batch_size, args.max_concurrent_tasks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
