"""A dramatiq message for a Switchboard actor is a hint, never an authority
(issue 32): anyone with dramatiq's Redis password can enqueue one. What the
workers' middleware refuses (:func:`message_refusal`), which options it
drops (:func:`ignored_options`), and the broker whose consumers drop a
message claiming a dramatiq queue other than the one it was read from.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any

import redis
import structlog
from dramatiq.broker import Consumer
from dramatiq.brokers.redis import RedisBroker
from dramatiq.common import q_name
from dramatiq.errors import BrokerConnectionError
from dramatiq.middleware import (
    AgeLimit,
    Callbacks,
    MiddlewareError,
    Pipelines,
    Retries,
    ShutdownNotifications,
    TimeLimit,
)
from dramatiq.results import Results

from backhalf import metrics
from backhalf.queues import QueueConfig

log = structlog.get_logger(__name__)

# The options dramatiq itself puts on a message (its retries' count and
# traceback, a delay's eta, the Redis broker's id): kept. Any other option a
# message carries would override its queue's settings (time_limit,
# max_retries, backoff, max_age, callbacks, pipelines): dropped.
DRAMATIQ_BOOKKEEPING = frozenset({"retries", "traceback", "requeue_timestamp", "eta", "redis_message_id"})
# dramatiq's middleware that read a message's options.
OPTION_READERS = (AgeLimit, TimeLimit, ShutdownNotifications, Callbacks, Pipelines, Retries, Results)
# A todo id is a PostgreSQL bigint.
MAX_TODO_ID = 2**63 - 1


def message_refusal(message: Any, queue: QueueConfig, served: Collection[str]) -> str | None:
    """Why a message for ``queue``'s actor must not run, or None: the relay
    sends exactly one todo id, no keywords, on the queue's own dramatiq
    queue (``served``: the dramatiq queues this worker consumes)."""
    args, kwargs, options = message.args, message.kwargs, message.options
    if type(kwargs) is not dict or kwargs or type(options) is not dict:
        return "bad_arguments"
    if (
        type(args) is not tuple
        or len(args) != 1
        or type(args[0]) is not int
        or not 1 <= args[0] <= MAX_TODO_ID
    ):
        return "bad_arguments"
    if type(message.queue_name) is not str or q_name(message.queue_name) != queue.broker_queue:
        return "other_queue"
    if queue.broker_queue not in served:
        return "other_queue"
    return None


def ignored_options(options: dict[str, Any], queue: QueueConfig) -> list[str]:
    """The options to drop: any that would override the queue's settings, and
    a ``retries`` count dramatiq never writes (not a count, or below zero:
    a negative one zeroes its backoff). A count past ``max_attempts`` is
    dramatiq's own during a database outage (those retries count no
    attempt), and its backoff caps it."""
    dropped = [key for key in options if key not in DRAMATIQ_BOOKKEEPING]
    retries = options.get("retries")
    if "retries" in options and not (type(retries) is int and retries >= 0):
        dropped.append("retries")
    return dropped


class MiddlewareOrderError(MiddlewareError):
    """SwitchboardMiddleware is behind a middleware that reads message options."""


class _QueueGuard(Consumer):
    """A consumer that drops (acks, logs and counts) a message dramatiq itself
    cannot handle: one whose body names a dramatiq queue other than the one
    it was read from (the worker thread looks that name up among its
    consumers, and a name it does not consume ends the thread: a forged
    message could stop a worker's threads one by one), or whose fields are
    not of the types dramatiq assumes (its own log line of a skipped message
    fails on keywords that are not a dict). Such a message never reaches a
    worker thread or any middleware.

    It also hands each batch dramatiq's consumer fetched to the broker's
    ``fetched`` hook at once (the claim at fetch: one statement for the
    batch), gives the claims of messages requeued unrun back first
    (``requeued``), and lets the ``acks`` hook hold an ack until the todo's
    end is committed (ingest.processes.worker_acks)."""

    def __init__(self, inner: Consumer, queue_name: str, hooks: FetchHooks) -> None:
        self._inner, self._queue_name, self._hooks = inner, queue_name, hooks
        # Messages of the last fetched batch not handed to dramatiq yet.
        self._fetched: deque[Any] = deque()

    def __iter__(self) -> _QueueGuard:
        return self

    def __next__(self) -> Any:
        if self._hooks.tick is not None:
            self._call(self._hooks.tick, "tick")
        if self._fetched:
            return self._fetched.popleft()
        while True:
            message = next(self._inner)
            if message is None:
                return None
            batch = [m for m in (message, *self._rest_of_batch()) if self._accepted(m)]
            if not batch:
                continue
            fetched = self._hooks.fetched
            if fetched is not None:
                # A failure leaves the batch unclaimed (each run starts its
                # own todo): the messages are never lost between the two.
                self._call(partial(fetched, batch), "fetched")
            self._fetched.extend(batch[1:])
            return batch[0]

    def _call(self, hook: Callable[[], None], name: str) -> None:
        try:
            hook()
        except Exception as exc:  # a hook's bug must not cost the consumer its batch
            log.exception("consumer_hook_failed", hook=name, dramatiq_queue=self._queue_name,
                          error=f"{type(exc).__name__}: {exc}")  # fmt: skip

    def _rest_of_batch(self) -> list[Any]:
        """The messages dramatiq's Redis consumer fetched with this one, from
        its cache (decoded, as it would one at a time; no network call)."""
        cache = getattr(self._inner, "message_cache", None)
        rest = []
        while cache and cache[0] is not None:
            message = next(self._inner)
            if message is None:
                break
            rest.append(message)
        return rest

    def _accepted(self, message: Any) -> bool:
        reason = self._refusal(message)
        if reason is None:
            return True
        log.warning("message_refused", reason=reason, dramatiq_queue=self._queue_name,
                    message_id=str(message.message_id)[:64])  # fmt: skip
        if metrics.on():
            metrics.MESSAGES_REFUSED.labels(q_name(self._queue_name), reason).inc()
        self._drop(message)
        return False

    def _refusal(self, message: Any) -> str | None:
        if not well_formed(message):
            return "bad_arguments"
        if message.queue_name != self._queue_name:
            return "other_queue"
        if "eta" in message.options and not self._queue_name.endswith(".DQ"):
            # No dramatiq enqueue puts an eta outside the delay queue: held in
            # the consumer's memory until then, a few would stop its fetches.
            return "bad_arguments"
        return None

    def _drop(self, message: Any) -> None:
        """Ack it by the id dramatiq's enqueue stores it under (the message
        id, unless its options say otherwise), whatever its options hold."""
        options = message.options if type(message.options) is dict else {}
        stored_as = options.get("redis_message_id")
        if type(stored_as) is not str:
            stored_as = str(message.message_id)
        # The message is dramatiq's frozen dataclass: its options are given
        # the id the ack reads (a forged body may lack it, or not be a dict).
        object.__setattr__(message._message, "options", {**options, "redis_message_id": stored_as})
        self._inner.ack(message)

    def ack(self, message: Any) -> None:
        if self._hooks.acks is None:
            self._inner.ack(message)
        else:
            self._hooks.acks(message, self._inner.ack)

    def nack(self, message: Any) -> None:
        if self._hooks.nacks is not None:
            self._hooks.nacks(message)  # no ack is held for it any more
        self._inner.nack(message)

    def requeue(self, messages: Iterable[Any]) -> None:
        listed = list(messages)
        requeued = self._hooks.requeued
        if requeued is not None and listed:
            self._call(partial(requeued, listed), "requeued")
        self._inner.requeue(listed)

    def close(self) -> None:
        """Requeue what was fetched and not handed on (dramatiq requeues only
        its work queue), then close. A Redis that fails the requeue leaves
        them in this worker's unacked set, redelivered once it is gone (their
        claims were given back first): the worker's stop goes on."""
        try:
            if self._fetched:
                fetched, self._fetched = list(self._fetched), deque()
                self.requeue(fetched)
        except (redis.RedisError, BrokerConnectionError) as exc:
            log.warning("fetched_messages_not_requeued", dramatiq_queue=self._queue_name,
                        error=f"{type(exc).__name__}: {exc}")  # fmt: skip
        finally:
            self._inner.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def well_formed(message: Any) -> bool:
    """The field types dramatiq assumes of a message it decodes (it checks none)."""
    return (
        type(message.queue_name) is str
        and type(message.actor_name) is str
        and type(message.args) is tuple
        and type(message.kwargs) is dict
        and type(message.options) is dict
    )


@dataclass
class FetchHooks:
    """What the worker's middleware does as its consumers fetch, requeue and
    ack (ingest.processes.worker_claims, ingest.processes.worker_acks);
    unset, the consumers do as dramatiq's own."""

    fetched: Callable[[list[Any]], None] | None = None
    requeued: Callable[[list[Any]], None] | None = None
    acks: Callable[[Any, Callable[[Any], None]], None] | None = None
    nacks: Callable[[Any], None] | None = None
    # Called at each turn of the consumer's loop (at least every idle poll).
    tick: Callable[[], None] | None = None


class GuardedRedisBroker(RedisBroker):
    """dramatiq's Redis broker whose consumers drop messages claiming another
    queue, and call its :class:`FetchHooks`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[no-untyped-call]
        self.hooks = FetchHooks()

    def consume(self, queue_name: str, prefetch: int = 1, timeout: int = 5000) -> Consumer:
        return _QueueGuard(super().consume(queue_name, prefetch, timeout), queue_name, self.hooks)
