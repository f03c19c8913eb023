"""Claimed at fetch (issue 25): the todos of a batch of dramatiq messages
are started in one statement when the worker process's consumer fetches
the batch, not one by one as each run begins.

The consumer (:class:`ingest.processes.worker_messages.GuardedRedisBroker`)
hands every batch it fetches to :meth:`FetchClaims.claim`, which starts the
todos of the messages shaped as the relay sends them (one todo id, on the
queue's own dramatiq queue; a delayed message is claimed when it comes back
from its delay queue) through the process's state writer and keeps each
answer with its message until a worker thread takes it
(:meth:`FetchClaims.take`). The claim counts the attempt and starts the
lease; the run extends the lease if its message waited long in the
prefetch (backhalf.worker). A message whose claim failed, or whose row
another transaction held, is started by its run alone, as before.

A message the worker fetched but never ran (dramatiq requeues its prefetch
when it stops) has its claim given back first (:meth:`FetchClaims.give_back`):
dispatched again, its attempt not counted, so the requeued message runs at
once elsewhere instead of waiting for the lease to expire.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterable
from typing import Any

import structlog

from backhalf import todos
from backhalf.errors import StoreError
from backhalf.queues import QueueConfig
from backhalf.state_writer import StateWriter
from backhalf.worker import Claim
from ingest.processes.worker_messages import message_refusal

log = structlog.get_logger(__name__)

# How often the consumers look for claims whose leases need extending.
REFRESH_EVERY_S = 1.0
# A claim that found rows held by another transaction asks for those again
# after these waits (37 ms in all), holding the batch back meanwhile.
BUSY_RETRY_DELAYS_S = (0.002, 0.005, 0.01, 0.02)
GIVEN_BACK = "given back unrun: the worker stopped with its message fetched"


class FetchClaims:
    """The claims of one worker process's fetched messages, by message."""

    def __init__(
        self,
        writer: Callable[[], StateWriter],
        by_actor: dict[str, QueueConfig],
        served_broker_queues: Collection[str],
    ) -> None:
        self._writer = writer  # the process's, made on first use
        self._by_actor = by_actor
        self._served = served_broker_queues
        self._lock = threading.Lock()
        # By the identity of dramatiq's message proxy (the object that goes
        # from the consumer to a worker thread; it compares by value, so it
        # is no key itself), kept alive by its entry until a worker thread
        # takes it or it is given back.
        self._claims: dict[int, tuple[Any, Claim]] = {}
        self._queues = {q.name: q for q in by_actor.values()}
        # When the claims were last looked at for leases to extend (refresh).
        self._refreshed = 0.0

    def claim(self, messages: Iterable[Any]) -> None:
        """Start the todos of a fetched batch (consumer thread), in one
        batch of the state writer: one round trip for the batch."""
        owners: list[Any] = []
        requests: list[todos.StartRequest] = []
        for message in messages:
            queue = self._claimable(message)
            if queue is None:
                continue
            owners.append(message)
            lease_s = queue.lease_ms / 1000
            requests.append(
                todos.StartRequest(message.args[0], queue.name, uuid.uuid4(), lease_s, queue.max_attempts)
            )
        for delay_s in (*BUSY_RETRY_DELAYS_S, None):
            if not requests:
                return
            answers = self._writer().claim(requests)
            now = time.monotonic()
            busy: list[tuple[Any, todos.StartRequest]] = []
            with self._lock:
                for message, request, started in zip(owners, requests, answers, strict=True):
                    if started is None:
                        continue
                    if started.found == todos.BUSY:
                        busy.append((message, request))
                    else:
                        self._claims[id(message)] = (message, Claim(started, now))
            if not busy or delay_s is None:
                return
            # Rows the relay still holds (its message overtook its commit,
            # by a millisecond or so): asked again shortly, before the batch
            # goes on; past these, each run starts its todo alone.
            time.sleep(delay_s)
            owners, requests = [m for m, _ in busy], [r for _, r in busy]

    def _claimable(self, message: Any) -> QueueConfig | None:
        """The queue of a message to claim: one for a Switchboard actor, as
        the relay sends it, not delayed. The others are refused by the
        middleware (or run by another actor) as they would be unclaimed."""
        queue = self._by_actor.get(message.actor_name)
        if queue is None or "eta" in message.options:
            return None
        try:
            refusal = message_refusal(message, queue, self._served)
        except Exception:  # noqa: BLE001 - a shape nothing foresaw: the middleware refuses it
            return None
        return queue if refusal is None else None

    def refresh(self) -> None:
        """Extend the leases of claims still waiting in the prefetch once
        they are half the lease margin old (any consumer thread, at each
        turn of its loop; a look at most every REFRESH_EVERY_S): a message
        behind slow runs could otherwise see its todo rescued, and its
        attempt spent, before its run began."""
        now = time.monotonic()
        with self._lock:
            if now - self._refreshed < REFRESH_EVERY_S:
                return
            self._refreshed = now
            due = [
                (key, message, claim)
                for key, (message, claim) in self._claims.items()
                if self._due(claim, now)
            ]
        if not due:
            return
        runs = [(claim.started, self._queue_of(claim).lease_ms / 1000) for _, _, claim in due]
        try:
            answers = self._writer().extend(runs)
        except StoreError as exc:
            log.warning("claim_leases_not_extended", claims=len(due), error=str(exc))
            return
        with self._lock:
            for (key, message, claim), extended in zip(due, answers, strict=True):
                # Extended: its lease is counted from now. Lost or busy: left
                # as it is; its run asks again (and skips a lost one).
                if extended and self._claims.get(key, (None,))[0] is message:
                    self._claims[key] = (message, Claim(claim.started, now))

    def _queue_of(self, claim: Claim) -> QueueConfig:
        assert claim.started.todo is not None
        return self._queues[claim.started.todo.queue]

    def _due(self, claim: Claim, now: float) -> bool:
        """Claimed more than half its queue's lease margin ago."""
        return (
            claim.started.todo is not None and now - claim.at > self._queue_of(claim).lease_margin_ms / 2000
        )

    def take(self, message: Any) -> Claim | None:
        """The claim made for this message, once (worker thread)."""
        with self._lock:
            entry = self._claims.pop(id(message), None)
        return None if entry is None else entry[1]

    def give_back(self, messages: Iterable[Any]) -> None:
        """The claims of messages about to be requeued unrun: dispatched
        again (committed before the requeue, so the message's next fetch
        finds its todo to run). One that cannot be given back stays running
        until its lease expires; the rescuer then dispatches it."""
        with self._lock:
            entries = [e for e in (self._claims.pop(id(m), None) for m in messages) if e is not None]
        self.give_back_claims([claim for _, claim in entries])

    def give_back_claims(self, claims: Iterable[Claim]) -> None:
        """Claims taken off their messages, given back (see :meth:`give_back`)."""
        runs = [claim.started for claim in claims if claim.started.todo is not None]
        if not runs:
            return
        endings = [todos.Ending(run, "dispatched", None, GIVEN_BACK, unrun=True) for run in runs]
        answers = self._writer().end_all(endings)  # never raises: failures are answers
        failed = [a for a in answers if isinstance(a, BaseException)]
        log.info("claims_given_back", todos=len(runs) - len(failed), not_given_back=len(failed),
                 error=f"{type(failed[0]).__name__}: {failed[0]}" if failed else None)  # fmt: skip
