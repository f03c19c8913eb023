"""The whole deployment (`switchboard ingest`, `ack` with its rescuer,
`worker` on PostgreSQL as its broker) under ``ack_after = "complete"`` and under kill -9 of
any of its processes at random while messages flow (issue 12). Real
PostgreSQL, Redis and dramatiq worker processes; the test's handler records
every run in ``handler_runs``. The seed is printed (and can be fixed with
SWITCHBOARD_TEST_SEED) so a failure can be replayed."""

from __future__ import annotations

import json
import os
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from ingest.adapters.redis.lists import processing_key
from ingest.embedded.processes import SwitchboardProcess, wait_for, wait_ready
from tests.support.config import stream_adapter
from tests.support.db import query, scalar
from tests.support.downstream import (
    FAST_RESCUE,
    QUEUE,
    SHORT_LEASE,
    assert_one_path,
    statuses,
    stop_all,
    stop_one,
    trail,
)
from tests.support.oracle import assert_exactly_once, assert_list_exactly_once
from tests.support.processes import Processes, stop_settled
from tests.support.streams import xpending

pytestmark = pytest.mark.system
SOURCE = "orders"
GROUP = "switchboard"
# Attempts to spare: a todo may lose a run to each kill of its worker.
CHAOS_QUEUE = {**QUEUE, "max_attempts": 10}


def adapter(mode: str, ack_after: str, **kw: Any) -> dict[str, Any]:
    if mode == "stream":
        return stream_adapter(SOURCE, batch_size=50, ack_after=ack_after, **kw)
    assert not kw
    return {"name": SOURCE, "transport": "redis", "mode": "list", "source": SOURCE, "queue": SOURCE,
            "batch_size": 50, "block_ms": 200, "ack_after": ack_after, "heartbeat_ttl_ms": 1500,
            "reap_interval_ms": 300}  # fmt: skip


def produce(redis_url: str, mode: str, payloads: list[dict[str, Any]]) -> list[str]:
    """Stream: the entry ids. List: the bodies (each distinct), as text."""
    bodies = [json.dumps(p) for p in payloads]
    with redis.Redis.from_url(redis_url, socket_timeout=10) as r:
        if mode == "list":
            r.lpush(SOURCE, *bodies)
            return bodies
        pipe = r.pipeline(transaction=False)
        for body in bodies:
            pipe.xadd(SOURCE, {"body": body})
        return [i.decode() for i in pipe.execute()]


def unacked_in_redis(redis_url: str, mode: str) -> int:
    """Stream: entries pending in the group. List: items on any processing list."""
    if mode == "stream":
        return xpending(redis_url, SOURCE, GROUP)
    with redis.Redis.from_url(redis_url, socket_timeout=10) as r:
        # The glob also matches the acker's removal markers (strings).
        keys = [k for k in r.scan_iter(match=processing_key(SOURCE, "*")) if r.type(k) == b"list"]
        return sum(int(r.llen(k)) for k in keys)


def todo_of(db_url: str, n: int) -> tuple[int, str]:
    (row,) = query(db_url, "SELECT id, status FROM todos WHERE (payload->>'n')::int = %(n)s", {"n": n})
    return int(row[0]), str(row[1])


def inbox_ack_state(db_url: str, todo_id: int) -> str:
    return str(scalar(db_url, "SELECT ack_state FROM inbox WHERE todo_id = %(t)s", {"t": todo_id}))


@pytest.mark.parametrize("mode", ["stream", "list"])
def test_with_ack_after_complete_the_broker_ack_waits_for_the_todo(
    mode: str, procs: Processes, make_config: Callable[..., Path], db_url: str, redis_url: str, runs_db: str
) -> None:
    """A slow todo's message stays un-acked in Redis (in the PEL, on the
    processing list) while its handler runs, though the acker acks the
    quick ones around it; once it is done, it is acked too. Streams: the
    claim sweep, which runs every 200 ms for entries idle over 1.5 s, leaves
    the waiting entry alone (it is stored; only its XACK is owed) instead of
    claiming and storing it again on every sweep. (Idle over 300 ms, a first
    store slower than that on a loaded machine was itself swept: not owed
    until it commits.)"""
    sweep = {"claim_idle_ms": 1500, "claim_interval_ms": 200} if mode == "stream" else {}
    config = make_config(adapter(mode, "complete", **sweep), queues={SOURCE: QUEUE})
    produce(redis_url, mode, [{"n": 0, "sleep_s": 4}, *({"n": i} for i in range(1, 6))])
    running = [
        procs.start("ingest", config, name="ingester-1"),
        procs.start("ack", config, name="acker-1"),
        procs.start("worker", config, name="worker-1"),
    ]

    def quick_ones_acked() -> bool:
        acked = scalar(db_url, "SELECT count(*) FROM inbox WHERE ack_state = 'acked'")
        return statuses(db_url).get("done") == 5 and acked == 5 and unacked_in_redis(redis_url, mode) == 1

    wait_for(quick_ones_acked, timeout_s=60, what="the 5 quick todos done and acked")
    slow, status = todo_of(db_url, 0)
    # Still running (it sleeps 4 s): its message is the one left un-acked.
    assert status == "running"
    assert inbox_ack_state(db_url, slow) == "pending"
    assert scalar(db_url, "SELECT waiting_for FROM ack_queue") == slow
    wait_for(lambda: unacked_in_redis(redis_url, mode) == 0, timeout_s=60, what="the slow one acked")
    assert todo_of(db_url, 0)[1] == "done"
    assert inbox_ack_state(db_url, slow) == "acked"
    stop_all(running)
    assert scalar(db_url, "SELECT max(deliveries) FROM inbox") == 1
    assert running[0].events("entries_claimed") == []


CHAOS_N = 300
CHAOS_ROUNDS = 5  # each strikes a process at work: ten, most landing on starting ones, took longer
ROLES = {"ingester-1": "ingest", "ingester-2": "ingest", "acker-1": "ack", "worker-1": "worker"}


@pytest.mark.parametrize(
    ("mode", "ack_after"), [("stream", "store"), ("stream", "complete"), ("list", "complete")]
)
def test_chaos_kill9_of_any_process_while_messages_flow(
    mode: str,
    ack_after: str,
    procs: Processes,
    make_config: Callable[..., Path],
    db_url: str,
    redis_url: str,
    runs_db: str,
) -> None:
    """Ingesters, the acker (and with it the rescuer) and the workers each
    killed -9 at random moments while a producer adds messages.
    At the end: one todo per message, every todo done, every handler run
    recorded, each todo's trail a path through the state machine, every
    message acked in PostgreSQL and in Redis."""
    seed = int(os.environ.get("SWITCHBOARD_TEST_SEED", random.randrange(2**32)))
    print(f"chaos seed: {seed}")
    rng = random.Random(seed)
    # A short claim_idle_ms: a surviving ingester claims a dead one's entries.
    config = make_config(
        adapter(mode, ack_after, claim_idle_ms=1500, claim_interval_ms=500) if mode == "stream"
        else adapter(mode, ack_after),
        queues={SOURCE: CHAOS_QUEUE},
        acker=FAST_RESCUE,
        worker=SHORT_LEASE,  # a kill's claims lapse within the bounded wait
    )  # fmt: skip
    produced: list[str] = []
    producing_done = threading.Event()

    def producer() -> None:
        # The messages flow throughout the kills: a slice every 100-300 ms.
        try:
            sent = 0
            while sent < CHAOS_N:
                size = min(CHAOS_N - sent, 30)
                produced.extend(produce(redis_url, mode, [{"n": i} for i in range(sent, sent + size)]))
                sent += size
                time.sleep(0.1 + 0.2 * (sent % 3) / 2)
        finally:
            producing_done.set()

    slots: dict[str, SwitchboardProcess] = {n: procs.start(v, config, name=n) for n, v in ROLES.items()}
    feeder = threading.Thread(target=producer, daemon=True)
    feeder.start()
    kills = 0
    for _ in range(CHAOS_ROUNDS):
        victim = rng.choice(sorted(slots))
        wait_ready(slots[victim])  # at work, not still importing (tests/support/chaos.py)
        time.sleep(rng.uniform(0.3, 1.5))  # a random moment to strike, not a wait for an outcome
        slots[victim].kill()
        kills += 1
        if rng.random() < 0.7:
            slots[victim] = procs.start(ROLES[victim], config, name=victim)
    assert producing_done.wait(60), "the producer did not finish"
    feeder.join(10)
    for name, proc in list(slots.items()):  # every slot running for the finish
        if not proc.alive():
            slots[name] = procs.start(ROLES[name], config, name=name)
    for proc in slots.values():
        wait_ready(proc)

    def converged() -> bool:
        acked = scalar(db_url, "SELECT count(*) FROM inbox WHERE ack_state = 'acked'")
        return (
            statuses(db_url) == {"done": CHAOS_N}
            and acked == CHAOS_N
            and unacked_in_redis(redis_url, mode) == 0
        )

    what = f"convergence after {kills} kills (seed {seed})"
    wait_for(converged, timeout_s=180, what=what)
    stop_settled(slots.values(), converged, what=what, stop=stop_one)
    if mode == "stream":
        assert_exactly_once(db_url, redis_url, stream=SOURCE, group=GROUP, produced_ids=produced)
    else:
        assert_list_exactly_once(db_url, redis_url, source=SOURCE, bodies=[b.encode() for b in produced])
    # Each todo's handler finished at least once; a run cut off by a kill
    # may have run again (at least once, as the README says).
    unfinished = (
        "SELECT count(*) FROM todos t WHERE NOT EXISTS"
        " (SELECT 1 FROM handler_runs r WHERE r.todo_id = t.id AND r.outcome = 'done')"
    )
    assert scalar(db_url, unfinished) == 0
    for (todo_id,) in query(db_url, "SELECT id FROM todos"):
        assert_one_path(trail(db_url, todo_id))
    if ack_after == "complete":
        # No message acked before its todo was done, and every release made
        # by the end itself, none left for the rescuer's sweep to find.
        early = (
            "SELECT count(*) FROM inbox i"
            " JOIN todo_events e ON e.todo_id = i.todo_id AND e.to_status = 'done'"
            " WHERE i.acked_at < e.created_at"
        )
        assert scalar(db_url, early) == 0
        swept = [e for p in procs.all if p.verb == "ack" for e in p.events("orphaned_acks_released")]
        assert swept == []
    procs.assert_no_secret_logged()
