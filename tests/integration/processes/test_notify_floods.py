"""Forged notifications cost (almost) nothing (issue 43). Any login connected
to the database may NOTIFY on the acker's channel (``switchboard_ack``) and
the workers' (``switchboard_todos``), with any payload, as often as it likes.
A flood of thousands, from a plain connection, must make the acker and a
worker's claimer run a bounded number of statements (counted on the wire,
by a proxy in front of PostgreSQL that only they connect through), while a
real store in the middle of it is still acked, and a real todo still
claimed, promptly."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import psycopg
import pytest
import redis
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine

from backhalf import queries
from backhalf.db import DatabaseSettings, create_engine, create_sync_engine
from backhalf.lifecycle.state_writer import StateWriter
from ingest.adapters.redis.streams import StreamAcknowledger
from ingest.lifecycle import NOTIFIED_GAP_MAX_S
from ingest.processes.ack.acker import Hints, _listen_loop, drain_loop
from ingest.processes.workers.worker_broker import Claimer, Leases
from tests.integration.processes.test_acker import GROUP, STREAM, consume_and_commit, settings
from tests.support.db import libpq, scalar
from tests.support.statement_counter import counting

# Thousands as fast as one connection sends them (bursts the loops read in
# batches), or a steady stream, each one alone (the case a loop that looks
# once per wake pays for in full).
FLOODS = {"burst": (3000, 0.0), "steady": (1000, 0.001)}
# Looks a flood may cause beyond one per NOTIFIED_GAP_MAX_S of it: the gap's
# first doublings and the real work's own looks. (Before the fix, a steady
# flood cost the acker some 850 statements in 2 s, the claimer 1,000 claims;
# now about 100 and 20.)
SLACK = 15
# Statements a look may take: the acker's drain is a checkout's ping, BEGIN,
# the plan settings, the cursor's peek, the queue's claim, COMMIT (and, with
# something owed, the cursor's claim and mark); a claim is one.
ACKER_LOOK = 8
CLAIM = 1


def bound(forged: Flood, per_look: int) -> float:
    """Statements allowed: at most a look per gap at its widest, and none
    per notification."""
    return per_look * (forged.elapsed() / NOTIFIED_GAP_MAX_S + SLACK)


# The forger: a process of its own (a thread would share this process's
# interpreter lock with the loops under test and slow them, hiding their
# cost), sending notifications one transaction each until told to stop on
# its standard input and its count at least are sent; it prints how many.
FORGER = """
import sys, threading, time, psycopg
url, channel, forged, pace_s = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
payloads = sys.argv[5:]
enough = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), enough.set()), daemon=True).start()
sent = 0
with psycopg.connect(url, autocommit=True) as conn:
    while sent < forged or not enough.is_set():
        conn.execute("SELECT pg_notify(%s, %s)", (channel, payloads[sent % len(payloads)]))
        sent += 1
        if pace_s:
            time.sleep(pace_s)
print(sent)
"""


@dataclass
class Flood:
    started: float
    process: subprocess.Popen[str]
    sent: int = 0
    stopped: float | None = None  # when the loops under test stopped

    def elapsed(self) -> float:
        return (self.stopped or time.monotonic()) - self.started

    def enough(self) -> None:
        """Stop once all are sent; wait for that."""
        out, _ = self.process.communicate("", timeout=120)
        self.sent = int(out)


@contextmanager
def flood(db_url: str, channel: str, payloads: list[str], kind: str) -> Iterator[Flood]:
    """Forged notifications on ``channel`` from a plain connection of another
    process, each its own transaction, cycling through ``payloads``, until
    the block calls ``enough`` (or ends) and its count at least are sent,
    paced as ``kind`` says."""
    count, pace_s = FLOODS[kind]
    argv = [sys.executable, "-c", FORGER, libpq(db_url), channel, str(count), str(pace_s), *payloads]
    process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    forged = Flood(time.monotonic(), process)
    try:
        yield forged
    finally:
        if process.poll() is None and not forged.sent:
            forged.enough()
        process.kill()
        process.wait(timeout=10)
    assert forged.sent >= count, "the flood did not finish"


@pytest.mark.parametrize("kind", sorted(FLOODS))
async def test_a_flood_of_forged_notifications_costs_the_acker_a_bounded_number_of_statements(
    engine: AsyncEngine, db_url: str, redis_url: str, kind: str
) -> None:
    s = settings(db_url, redis_url)
    r = redis.Redis.from_url(redis_url, socket_timeout=10)
    acker_settings = s.acker.__class__(poll_interval_ms=60_000)  # no poll within the test
    acknowledgers = {"orders": StreamAcknowledger(s.adapters[0])}
    hints, wake, stop = Hints(acknowledgers), asyncio.Event(), asyncio.Event()
    # Anyone's text, names of nothing acked here, and the adapter's own name.
    payloads = ["orders", "", "x" * 7000, "billing", "orders\x01", "orders"]
    with counting(port_of(db_url)) as counter:
        database = DatabaseSettings(url=counter.url_for(db_url))  # the acker's connections, all counted
        acker_engine = create_engine(database)
        tasks = [
            asyncio.create_task(_listen_loop(database, acker_settings, wake, hints, stop)),
            asyncio.create_task(
                drain_loop(acker_engine, acknowledgers, acker_settings, wake, stop, hints=hints)
            ),
        ]
        await asyncio.sleep(0.5)  # listening; the first look made the adapter's cursor
        before = counter.statements
        with flood(db_url, queries.ACK_CHANNEL, payloads, kind) as forged:
            await asyncio.sleep(0.3)
            r.xadd(STREAM, {"body": "{}"})
            await consume_and_commit(engine, s, 1)  # a real store mid-flood, its NOTIFY among the forged
            async with asyncio.timeout(10):
                while r.xpending(STREAM, GROUP)["pending"]:  # noqa: ASYNC110 - polling Redis, not PostgreSQL
                    await asyncio.sleep(0.02)
            await asyncio.sleep(max(0.0, 1.0 - forged.elapsed()))  # the flood goes on a while
            await asyncio.to_thread(forged.enough)
        await asyncio.sleep(0.5)  # the last notifications read and looked at
        forged.stopped, spent = time.monotonic(), counter.statements - before
        stop.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await acker_engine.dispose()
    for a in acknowledgers.values():
        await a.close()
    assert scalar(db_url, "SELECT ack_state FROM inbox") == "acked"
    # Before: a probe statement per notification and a drain per burst.
    assert spent <= bound(forged, ACKER_LOOK), (spent, forged.sent, forged.elapsed())


@pytest.mark.parametrize("kind", sorted(FLOODS))
def test_a_flood_of_forged_notifications_costs_a_claimer_a_bounded_number_of_claims(
    writer: StateWriter, db_url: str, kind: str
) -> None:
    claimed: list[int] = []
    stop = threading.Event()
    with counting(port_of(db_url)) as counter:
        engine = create_sync_engine(DatabaseSettings(url=counter.url_for(db_url)), pool_size=2)
        claimer = Claimer(engine, writer, Leases(), ["q"], threads=2, lease_s=30, poll_interval_s=60)

        def consume() -> None:
            while not stop.is_set():
                message = claimer.next_message(0.2)
                if message is not None:
                    claimed.append(message.claim.todo.id)

        assert claimer.next_message(0.3) is None  # connected, listening
        before = counter.statements
        consumer = threading.Thread(target=consume, name="consumer")
        consumer.start()
        try:
            payloads = ["q", "", "another-queue", "y" * 7000, "q"]
            with flood(db_url, queries.TODO_CHANNEL, payloads, kind) as forged:
                time.sleep(0.3)
                todo_id = insert_and_notify(db_url)
                deadline = time.monotonic() + 10
                while todo_id not in claimed and time.monotonic() < deadline:
                    time.sleep(0.02)
                assert claimed == [todo_id]
                time.sleep(max(0.0, 1.0 - forged.elapsed()))  # the flood goes on a while
                forged.enough()
            time.sleep(0.5)  # the last notifications read and looked at
            forged.stopped, spent = time.monotonic(), counter.statements - before
        finally:
            stop.set()
            consumer.join(timeout=10)
            claimer.release()
            engine.dispose()
    # Before: a claim per burst, as fast as they came (well over a thousand).
    assert spent <= bound(forged, CLAIM), (spent, forged.sent, forged.elapsed())


def port_of(url: str) -> int:
    port = make_url(url).port
    assert port is not None
    return port


def insert_and_notify(db_url: str) -> int:
    """A todo made as the store makes one: its NOTIFY delivered at commit."""
    with psycopg.connect(libpq(db_url)) as conn:
        row = conn.execute(
            "INSERT INTO todos (queue, idempotency_key, payload) VALUES ('q', 'real', '{}') RETURNING id"
        ).fetchone()
        assert row is not None
        conn.execute(queries.NOTIFY_WORKERS, {"channel": queries.TODO_CHANNEL, "queues": ["q"]})
    return int(row[0])
