"""``switchboard demo``: the whole pipeline on embedded servers, no set-up.

Starts PostgreSQL (``ingest.embedded.servers``) and the transport's own
server with its source (``ingest/adapters/<transport>/demo.py``, the
default transport's unless ``--transport`` names another; a server that
cannot run here, as a missing system package, is one line and exit 2
before anything starts), migrates, produces sample orders while a real
ingester, acker and dramatiq workers run as separate processes, SIGKILLs
the ingester once mid-stream, restarts it, waits until everything is acked and every todo is
done (a few fail once and succeed on their retry), and prints what happened,
straight from SQL and the broker.

Stopped by SIGTERM or SIGINT, it stops everything it started and removes its
temporary directory, then exits 128 + the signal's number. Killed outright
(SIGKILL), its servers and processes die with it (``ingest.children``);
its directory stays until the next demo starts and removes it. A server that
cannot start is one line on stderr and exit 1, with nothing left behind.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import signal
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import psycopg

from backhalf.db import libpq_url
from backhalf.housekeeping import migrate
from ingest.config.transports import DEFAULT_TRANSPORT
from ingest.embedded.config import write_config
from ingest.embedded.demo_sources import DemoSource, demo_source, missing_broker
from ingest.embedded.demo_trace import DemoTrace, traced_order
from ingest.embedded.processes import Processes, SwitchboardProcess, WaitTimedOut, wait_for
from ingest.embedded.servers import embedded_postgres, remove_abandoned
from ingest.exit_codes import EXIT_CONFIG, EXIT_FAILURE, EXIT_OK
from ingest.signals import STOP_SIGNALS

PREFIX = "switchboard-demo-"
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
DONE_SQL = "SELECT count(*) FROM todos WHERE status = 'done'"
RETRIED_SQL = "SELECT count(*) FROM todos WHERE status = 'done' AND attempts > 1"
RETRIED_TRAIL_SQL = """
SELECT e.from_status, e.to_status, e.detail FROM todo_events e
WHERE e.todo_id = (SELECT min(id) FROM todos WHERE attempts > 1) ORDER BY e.id
"""
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


def _write_config(path: Path, db_url: str, adapter: dict[str, Any]) -> None:
    # Short retry delays: the demo's flaky orders succeed within a second.
    queue = {"handler": "ingest.embedded.demo_handlers:fulfil", "max_attempts": 3,
             "min_backoff_ms": 100, "max_backoff_ms": 500}  # fmt: skip
    write_config(path, database_url=db_url, adapters=[adapter], queues={"orders": queue})


class Stopped(Exception):
    """A stop signal arrived: raised where the demo was, so its clean-up runs."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


# The stop signal that arrived, if one did: a library that catches every
# exception (the signal handler raises wherever the main thread is) could
# swallow ``Stopped``, and with the signals ignored after it the demo would
# then run on for good; the demo's own loops look here too.
_stopped_by: list[int] = []


def _raise_if_stopped() -> None:
    if _stopped_by:
        raise Stopped(_stopped_by[0])


@contextlib.contextmanager
def _stop_signals_raise() -> Iterator[None]:
    """SIGTERM and SIGINT raise ``Stopped`` once; while the clean-up runs, a
    second one is ignored (the clean-up is bounded: each wait has a deadline)."""

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        _stopped_by.append(signum)
        raise Stopped(signum)

    _stopped_by.clear()
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    for sig in STOP_SIGNALS:
        signal.signal(sig, on_signal)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _say(text: str = "") -> None:
    print(text, flush=True)


def run(messages: int = 5000, transport: str = DEFAULT_TRANSPORT, trace: bool = False) -> int:
    if (missing := missing_broker(transport)) is not None:
        # Before anything starts: like a config error, one line, and no
        # point in running it again as it is.
        print(f"switchboard demo: {missing}", file=sys.stderr)
        return EXIT_CONFIG
    logging.getLogger("alembic").setLevel(logging.WARNING)  # the demo prints its own story
    try:
        with _stop_signals_raise():
            if removed := remove_abandoned(PREFIX):
                _say(f"demo: removed {len(removed)} folder(s) left by demos killed before their clean-up")
            return _run(messages, transport, trace)
    except Stopped as stop:
        done = "its servers and processes stopped, its folder removed"
        print(f"demo: stopped by {stop}: {done}", file=sys.stderr)
        release_interrupted(stop)
        return 128 + stop.signum


def release_interrupted(stop: Stopped) -> None:
    """Free what the calls a stop signal interrupted left in their frames.

    The signal raises wherever the main thread is, possibly inside a library
    opening a socket it closes only on its own errors (a client's connect, on
    OSError): that socket lives on in the exception's frames and is closed by
    the collector once they go. Closing it here, on purpose, keeps the
    ResourceWarning (a traceback under ``-W error``) out of a clean stop."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        traceback.clear_frames(stop.__traceback__)  # skips a frame still running: this one's caller
        stop.__traceback__ = None
        gc.collect()


def _run(messages: int, transport: str, trace: bool) -> int:
    with contextlib.ExitStack() as stack:
        # PostgreSQL here; the transport's own server comes with its source
        # (the workers take their todos from PostgreSQL: no other broker runs).
        try:
            alone = stack.enter_context(embedded_postgres(PREFIX))
            base, pg = alone.base, alone.postgres
            db_url = pg.create_database("switchboard")
        except (RuntimeError, OSError) as exc:
            # The kit's message: its first line says why; the log tail below it
            # went with the folder, which is removed by now.
            print(f"switchboard demo: {str(exc).splitlines()[0]}", file=sys.stderr)
            return EXIT_FAILURE
        _say(f"demo: working in {base}")
        _say(f"demo: PostgreSQL on 127.0.0.1:{pg.port} (pid {pg.pid})")
        try:
            source, where = stack.enter_context(demo_source(transport, base))
        except (RuntimeError, OSError) as exc:
            print(f"switchboard demo: {str(exc).splitlines()[0]}", file=sys.stderr)
            return EXIT_FAILURE
        if where:
            _say(f"demo: {where}")
        # Without the caller's SWITCHBOARD_* variables: an exported production
        # SWITCHBOARD_DATABASE_URL would override the demo's own config.
        processes = Processes(base)
        stack.callback(processes.kill_all)  # last: every log file closed, even a dead process's
        stack.callback(processes.stop_all, PROCESS_STOP_TIMEOUT_S)
        migrate.upgrade(db_url)
        _say("demo: migrated")
        config = base / "switchboard.toml"
        _write_config(config, db_url, source.adapter())
        traced = stack.enter_context(DemoTrace(traced_order(messages))) if trace else None
        try:
            return _drive(config, db_url, source, messages, processes, traced)
        except (WaitTimedOut, ProcessExited) as exc:
            print(f"demo: FAILED: {exc}", file=sys.stderr)
            for proc in processes.all:  # their logs go with the folder
                tail = proc.raw_log().splitlines()[-3:]
                print("\n".join(f"  {proc.log_path.name}: {line}" for line in tail), file=sys.stderr)
            return EXIT_FAILURE
    raise AssertionError("unreachable")  # pragma: no cover - for mypy: ExitStack may swallow


class ProcessExited(RuntimeError):
    """The ingester or the acker ended while the demo still needed it."""


def _running(*procs: SwitchboardProcess) -> bool:
    for proc in procs:
        if not proc.alive():
            said = proc.raw_log().strip().splitlines()[-1:] or ["nothing"]
            name = proc.log_path.name.split(".")[0]
            raise ProcessExited(f"the {name} exited with {proc.proc.returncode}; its last line: {said[0]}")
    return True


def _drive(
    config: Path, db_url: str, r: DemoSource, messages: int, processes: Processes, traced: DemoTrace | None
) -> int:
    with psycopg.connect(libpq_url(db_url), autocommit=True, connect_timeout=10) as db:
        env = {**r.process_env, **(traced.env() if traced else {})}
        acker = processes.start("ack", config, name="acker", env=env)
        ingester = processes.start("ingest", config, name="ingester-1", env=env)
        worker = processes.start("worker", config, name="worker", env=env)

        def restart() -> SwitchboardProcess:
            return processes.start("ingest", config, name="ingester-1", env=env)

        ingester = _produce(r, db, messages, acker, ingester, restart, traced)
        _say(f"demo: produced {messages} messages to {r.transport} {r.source_word} {r.adapter()['source']!r}")
        _wait_drained(r, db, messages, acker, ingester, worker)
        codes = {
            "ingester-1": ingester.stop(PROCESS_STOP_TIMEOUT_S),
            "acker": acker.stop(PROCESS_STOP_TIMEOUT_S),
            "worker": worker.stop(PROCESS_STOP_TIMEOUT_S),
        }
        ok = _report(r, db, messages, codes)
        if traced is not None:
            traced.say_spans(_say)
        _say(f"\ndemo: {'OK: no loss, no duplicate' if ok else 'FAILED'}")
        return EXIT_OK if ok else EXIT_FAILURE


def _produce(
    r: DemoSource,
    db: psycopg.Connection[Any],
    messages: int,
    acker: SwitchboardProcess,
    ingester: SwitchboardProcess,
    restart: Callable[[], SwitchboardProcess],
    traced: DemoTrace | None,
) -> SwitchboardProcess:
    """Produce the orders in chunks; a third of the way in, SIGKILL the
    ingester once and start it again. Return the ingester running now.
    With ``traced``, its order goes with its producer's trace context."""
    killed = False
    chunk = 100
    for start in range(0, messages, chunk):
        orders = range(start, min(start + chunk, messages))
        order = traced.order if traced is not None and traced.order in orders else None
        r.produce([_order(i) for i in orders if i != order])
        if traced is not None and order is not None:
            r.produce([_order(order)], traced.traceparent)
        time.sleep(0.02)
        _raise_if_stopped()
        if not killed and start >= messages // 3:
            ingester = _kill_and_restart(r, db, acker, ingester, restart)
            killed = True
    return ingester


def _order(i: int) -> bytes:
    return json.dumps({"order_id": i, "sku": f"SKU-{i % 17}", "qty": 1 + i % 5}).encode()


def _kill_and_restart(
    r: DemoSource,
    db: psycopg.Connection[Any],
    acker: SwitchboardProcess,
    ingester: SwitchboardProcess,
    restart: Callable[[], SwitchboardProcess],
) -> SwitchboardProcess:
    wait_for(
        lambda: _running(acker, ingester) and _scalar(db, TODOS_SQL) > 0,
        timeout_s=WAIT_TIMEOUT_S,
        what="the first todos",
    )
    ingester.kill()
    # Only what is certain at this moment: commits the ingester had sent may
    # still land, so a count of todos now would not add up with the end.
    pending = r.unacked()
    _say(
        f"demo: SIGKILLed the ingester mid-stream with {pending} messages not yet acked"
        f" ({r.unacked_label}): each is acked once stored, or read again and stored once"
    )
    restarted = restart()
    _say(f"demo: restarted the ingester ({r.restart_note})")
    return restarted


def _wait_drained(
    r: DemoSource,
    db: psycopg.Connection[Any],
    messages: int,
    acker: SwitchboardProcess,
    ingester: SwitchboardProcess,
    worker: SwitchboardProcess,
) -> None:
    wait_for(
        lambda: _running(acker, ingester) and _scalar(db, ACKED_SQL) >= messages,
        timeout_s=WAIT_TIMEOUT_S,
        what="every message acked",
    )
    wait_for(
        lambda: _running(acker, ingester) and r.unacked() == 0,
        timeout_s=WAIT_TIMEOUT_S,
        what=f"nothing {r.unacked_label}",
    )
    wait_for(
        lambda: _running(acker, ingester, worker) and _scalar(db, DONE_SQL) >= messages,
        timeout_s=WAIT_TIMEOUT_S,
        what="every todo done by the workers",
    )


def _report(r: DemoSource, db: psycopg.Connection[Any], messages: int, codes: dict[str, int]) -> bool:
    """Print what happened, from SQL and the broker; True: no loss, no duplicate, clean exits."""
    row = db.execute(SUMMARY_SQL).fetchone()
    assert row is not None
    todos, distinct, inbox_rows, acked, redeliveries, events = row
    pending = r.unacked()
    _say()
    _say(f"  messages produced       {messages}")
    _say(f"  todos created           {todos}")
    _say(f"  duplicates              {todos - distinct}")
    _say(f"  events recorded         {events}")
    _say(f"  inbox rows              {inbox_rows}")
    _say(f"  acked ({r.ack_word})".ljust(25) + f" {acked}")
    _say(f"  redelivered entries     {redeliveries} (of those pending at the kill; each stored once)")
    _say(f"  {r.unacked_label}".ljust(25) + f" {pending}")
    done, retried = _scalar(db, DONE_SQL), _scalar(db, RETRIED_SQL)
    _say(f"  todos done (workers)    {done}")
    _say(f"  done after a retry      {retried}")
    _say(f"  exit codes on SIGTERM   {codes}")
    _say_trails(db)
    ok = todos == messages == distinct == done and acked == inbox_rows and pending == 0
    return ok and all(c == 0 for c in codes.values())


def _say_trails(db: psycopg.Connection[Any]) -> None:
    key_row = db.execute(TRAIL_KEY_SQL).fetchone()
    if key_row:
        _say(f"\n  audit trail of {key_row[0]} (audit_message_trail):")
        cur = db.execute(TRAIL_SQL, {"key": key_row[0]})
        names = [c.name for c in cur.description or ()]
        for trail in cur.fetchall():
            for name, value in zip(names, trail, strict=True):
                _say(f"    {name:<18} {value}")
    retried_trail = db.execute(RETRIED_TRAIL_SQL).fetchall()
    if retried_trail:
        _say("\n  todo_events of a todo that failed once (todos show ID prints it too):")
        for from_status, to_status, detail in retried_trail:
            _say(f"    {from_status or '(new)':<10} -> {to_status:<10} {detail}")
