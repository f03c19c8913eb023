"""The rescuer: claims whose lease lapsed, put back (DESIGN.md section 7b).

It runs inside ``switchboard ack``, every ``[acker] rescue_interval_ms``, in
transactions of its own. A worker extends the leases of every claim it
holds while it lives, so a lease lapses only when its worker is gone
(killed, cut off, or stopped without giving the claim back): the todo goes
back to pending, due at once, its attempt counted (or to failed, if that was
its last), and the workers of its queue are woken. Rescuers running at once
never take the same todo (``SKIP LOCKED``). Beside it, the safety net under
``ack_after = "complete"``: acks still waiting for todos that ended.
"""

from __future__ import annotations

from collections.abc import Mapping

import structlog
from sqlalchemy.ext.asyncio import AsyncEngine

from backhalf import metrics
from backhalf.db import driver_connection, within_deadline, wrap_driver_errors
from backhalf.errors import StoreError
from backhalf.lifecycle import todos
from backhalf.lifecycle.queues import QueueConfig

log = structlog.get_logger(__name__)


class Rescuer:
    """The rescuer's transactions, for the configured queues."""

    def __init__(
        self, engine: AsyncEngine, queues: Mapping[str, QueueConfig], *, batch_size: int, deadline_ms: int
    ) -> None:
        self._engine = engine
        self._queues = [(q.name, q.max_attempts) for q in queues.values()]
        self._batch_size = batch_size
        self._deadline_ms = deadline_ms

    async def rescue_once(self) -> int:
        """Put back (or fail) up to a batch of lapsed claims, and release the
        acks left waiting; return how many of both."""
        what = "rescuing todos whose lease lapsed"
        async with within_deadline(self._engine.begin(), self._deadline_ms, what) as conn:
            with wrap_driver_errors(StoreError, what):
                pg = await driver_connection(conn)
                async with pg.cursor() as cur:
                    moved = await todos.rescue(cur, self._queues, self._batch_size)
        for tid, queue, status in moved:
            if metrics.on():
                metrics.RESCUED.labels(queue, status).inc()
                if status == "failed":  # its last attempt's worker died: finished here
                    metrics.FINISHED.labels(queue, "failed").inc()
            log.warning("todo_rescued", todo_id=tid, queue=queue, to_status=status)
        released = await self._release_orphaned_acks()
        return len(moved) + released

    async def _release_orphaned_acks(self) -> int:
        what = "releasing acks still waiting for todos that ended"
        async with within_deadline(self._engine.begin(), self._deadline_ms, what) as conn:
            with wrap_driver_errors(StoreError, what):
                pg = await driver_connection(conn)
                async with pg.cursor() as cur:
                    released = await todos.release_orphaned_acks(cur, self._batch_size)
        if released:
            # Each one is a worker that ended a todo without releasing its
            # ack: its config lacks the adapter's ack_after = "complete".
            log.warning("orphaned_acks_released", released=released,
                        hint="give the workers the same config as the ingesters")  # fmt: skip
        return released
