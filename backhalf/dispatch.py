"""The dispatch relay and the rescuer: committed todos to dramatiq, as an outbox.

Both run inside ``switchboard ack`` (DESIGN.md section 7), each in its own
transactions:

* **The relay** claims committed ``pending`` todos (``FOR UPDATE SKIP
  LOCKED``: relays split the work), enqueues one dramatiq message per todo
  on its queue's actor, marks them ``dispatched`` with their ``todo_events``
  rows, and commits, in that order. A todo is never enqueued before the
  transaction that created it committed (it is invisible until then); a
  crash between the enqueue and the commit rolls the marks back, and the
  todos are enqueued again: the worker skips a message whose todo is no
  longer to run.
* **The rescuer** finds todos ``running`` past their lease (the worker was
  killed) or ``dispatched`` with no progress for too long (the message was
  lost: dramatiq's Redis restarted without persistence, a queue flushed),
  and dispatches them again the same way, or fails a running one whose
  attempts are used up.

A message carries the todo's id only: the worker reads the payload, the
attempt and the state from PostgreSQL, which is the truth.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import structlog
from sqlalchemy.ext.asyncio import AsyncEngine

from backhalf import metrics, todos
from backhalf.db import driver_connection, within_deadline, wrap_driver_errors
from backhalf.errors import BackhalfError, StoreError
from backhalf.queues import QueueConfig

if TYPE_CHECKING:
    from dramatiq.brokers.redis import RedisBroker

log = structlog.get_logger(__name__)

# Redis waits of the relay's dramatiq client: bounded, like every other.
BROKER_SOCKET_TIMEOUT_S = 10.0


class DispatchError(BackhalfError):
    """Enqueueing to dramatiq's broker failed; the todos stay as they were."""

    failed = "broker"


class Enqueuer:
    """dramatiq's Redis broker, as the relay uses it: messages in, nothing
    consumed. Imported here only, so processes that never dispatch never
    load dramatiq."""

    def __init__(self, url: str) -> None:
        import redis
        from dramatiq.brokers.redis import RedisBroker
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        client = redis.Redis.from_url(
            url,
            socket_timeout=BROKER_SOCKET_TIMEOUT_S,
            socket_connect_timeout=BROKER_SOCKET_TIMEOUT_S,
            driver_info=None,  # no CLIENT SETINFO: ops/redis-users.acl does not grant it (Redis 7.0 lacks it)
            # One try: the relay's loop retries, and a broker out of reach is
            # then a broker error within its bound, not the transaction's
            # deadline passing under hidden retries (read as the database's).
            retry=Retry(NoBackoff(), 0),
        )
        # No middleware: the actors' options (retries, time limit) apply
        # where the message is processed, in the workers' broker.
        self._client = client
        self._broker: RedisBroker = RedisBroker(client=client, middleware=[])  # type: ignore[no-untyped-call]
        self._primed = False

    def enqueue(self, messages: Sequence[tuple[QueueConfig, int]]) -> None:
        """One dramatiq message per (queue, todo id), sent in one pipeline:
        one round trip for the batch, not one per todo, while the relay's
        transaction holds the todos' rows. Blocking (run it in a thread).

        dramatiq's ``RedisBroker.enqueue`` runs its Lua ``dispatch`` script
        through ``broker.scripts``; for the batch, those scripts are bound to
        a pipeline instead, so each enqueue is queued and the pipeline sends
        them together. The broker computes one value lazily with a script of
        its own (its Lua stack size): the first message ever is enqueued
        alone, so that value is known before any script is pipelined."""
        import dramatiq

        built: list[dramatiq.Message[Any]] = [
            dramatiq.Message(
                queue_name=queue.broker_queue,
                actor_name=queue.actor_name,
                args=(todo_id,),
                kwargs={},
                options={},
            )
            for queue, todo_id in messages
        ]
        if not self._primed and built:
            self._broker.enqueue(built.pop(0))
            self._primed = True
        if not built:
            return
        scripts = self._broker.scripts
        pipe = self._client.pipeline(transaction=False)
        self._broker.scripts = {name: pipe.register_script(script.script) for name, script in scripts.items()}
        try:
            for message in built:
                self._broker.enqueue(message)
        finally:
            self._broker.scripts = scripts
        pipe.execute()

    def close(self) -> None:
        self._broker.close()


class Dispatcher:
    """The relay's and the rescuer's transactions, for the configured queues."""

    def __init__(
        self,
        engine: AsyncEngine,
        queues: Mapping[str, QueueConfig],
        enqueuer: Enqueuer,
        *,
        batch_size: int,
        dispatch_timeout_ms: int,
        deadline_ms: int,
    ) -> None:
        self._engine = engine
        self._queues = dict(queues)
        self._enqueuer = enqueuer
        self._batch_size = batch_size
        self._dispatch_timeout_ms = dispatch_timeout_ms
        self._deadline_ms = deadline_ms

    def close(self) -> None:
        self._enqueuer.close()

    async def relay_once(self) -> int:
        """Dispatch up to a batch of pending todos of each queue; return how many."""
        what = f"dispatching up to {self._batch_size} todos"
        async with within_deadline(self._engine.begin(), self._deadline_ms, what) as conn:
            with wrap_driver_errors(StoreError, what):
                pg = await driver_connection(conn)
                async with pg.cursor() as cur:
                    claimed = await todos.claim_pending(cur, sorted(self._queues), self._batch_size)
                    if not claimed:
                        return 0
                    await self._enqueue([(tid, queue) for tid, queue in claimed])
                    marked = await todos.mark_dispatched(
                        cur, [tid for tid, _ in claimed], todos.DISPATCHED_BY_RELAY
                    )
        if metrics.on():
            for queue, n in Counter(queue for _tid, queue in claimed).items():
                metrics.DISPATCHED.labels(queue).inc(n)
        log.info("todos_dispatched", dispatched=marked, claimed=len(claimed))
        return len(claimed)

    async def rescue_once(self) -> int:
        """Dispatch again (or fail) up to a batch of stuck todos; return how many."""
        what = "rescuing stuck todos"
        stale = [
            (q.name, q.max_attempts, (self._dispatch_timeout_ms + q.max_backoff_ms) / 1000)
            for q in self._queues.values()
        ]
        async with within_deadline(self._engine.begin(), self._deadline_ms, what) as conn:
            with wrap_driver_errors(StoreError, what):
                pg = await driver_connection(conn)
                async with pg.cursor() as cur:
                    moved = await todos.rescue(cur, stale, self._batch_size)
                    again = [(tid, queue) for tid, queue, status in moved if status == "dispatched"]
                    if again:
                        await self._enqueue(again)
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

    async def _enqueue(self, claimed: list[tuple[int, str]]) -> None:
        messages = [(self._queues[queue], tid) for tid, queue in claimed]
        try:
            # redis-py's client is blocking: off the event loop, bounded by
            # its socket timeouts.
            await asyncio.to_thread(self._enqueuer.enqueue, messages)
        except Exception as exc:  # the broker's errors, whatever their type: the todos stay
            raise DispatchError(f"enqueueing {len(messages)} todos to dramatiq failed: {exc}") from exc
