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
