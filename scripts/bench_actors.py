"""The bench's downstream work: a no-op, for dramatiq alone and for
Switchboard's workers (``scripts/bench.py``). Imported by dramatiq worker
processes, from the repository's root."""

from __future__ import annotations

import os
from typing import Any

import dramatiq
import redis
from dramatiq.brokers.redis import RedisBroker

# The bare drain's broker: at BENCH_DRAMATIQ_URL when dramatiq's CLI imports
# this module (the bench sets it), and nowhere else.
_url = os.environ.get("BENCH_DRAMATIQ_URL")
if _url:
    broker = RedisBroker(client=redis.Redis.from_url(_url, socket_timeout=10))  # type: ignore[no-untyped-call]
    dramatiq.set_broker(broker)

    @dramatiq.actor(queue_name="bare", actor_name="bench_noop")
    def noop(n: int) -> None:
        """dramatiq's own per-message cost, and nothing else."""


def noop_handler(todo: Any) -> None:
    """Switchboard's handler: nothing but the lifecycle around it."""


# The "dramatiq + one UPDATE per message" peer (issue 25): the cheapest
# durable state a user would write by hand, one committed UPDATE of the job's
# row per message, on a connection per worker thread.
_peer_db = os.environ.get("BENCH_PEER_DB")
if _url and _peer_db:
    import threading

    import psycopg

    _local = threading.local()
    _peer_conninfo: str = _peer_db

    @dramatiq.actor(queue_name="peer", actor_name="bench_update")
    def update(job_id: int) -> None:
        conn = getattr(_local, "conn", None)
        if conn is None:
            conn = _local.conn = psycopg.connect(_peer_conninfo, autocommit=True)
        conn.execute("UPDATE bench_jobs SET status = 'done', done_at = now() WHERE id = %s", (job_id,))
