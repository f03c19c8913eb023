"""The workers' consumer (ingest.processes.worker_messages._QueueGuard) on a
real Redis: a fetched batch reaches the ``fetched`` hook in one call, a hook
that fails loses no message, and a Redis gone while the consumer requeues
what it fetched does not stop the worker's shutdown; and the middleware
gives back the claim of a message another middleware skipped."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import dramatiq
import redis
from dramatiq.broker import MessageProxy
from structlog.testing import capture_logs

from ingest.config import load
from ingest.processes.worker import SwitchboardMiddleware
from ingest.processes.worker_messages import FetchHooks, GuardedRedisBroker
from tests.support.config import stream_adapter, write_config
from tests.support.db import insert_todos, query
from tests.support.downstream import HANDLER
from tests.support.proxy import proxy_to

QUEUE = "orders"


def broker_at(url: str) -> GuardedRedisBroker:
    client = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)
    broker = GuardedRedisBroker(client=client)
    broker.declare_queue(QUEUE)
    return broker


def enqueue(broker: GuardedRedisBroker, n: int) -> None:
    for i in range(n):
        broker.enqueue(dramatiq.Message(queue_name=QUEUE, actor_name="switchboard:orders", args=(i + 1,),
                                        kwargs={}, options={}))  # fmt: skip


def drain(consumer: Any, n: int, timeout_s: float = 10) -> list[Any]:
    got: list[Any] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < n and time.monotonic() < deadline:
        message = next(consumer)
        if message is not None:
            got.append(message)
    return got


def test_a_fetched_batch_reaches_the_hook_at_once_and_a_failing_hook_loses_none(redis_url: str) -> None:
    broker = broker_at(redis_url)
    enqueue(broker, 5)
    batches: list[int] = []

    def failing(batch: list[Any]) -> None:
        batches.append(len(batch))
        raise RuntimeError("the claim's bug")

    broker.hooks = FetchHooks(fetched=failing)
    consumer = broker.consume(QUEUE, prefetch=10, timeout=100)
    with capture_logs() as logs:
        got = drain(consumer, 5)
    assert sorted(m.args[0] for m in got) == [1, 2, 3, 4, 5]
    assert batches == [5]  # one call for the whole fetch
    assert [e["hook"] for e in logs if e["event"] == "consumer_hook_failed"] == ["fetched"]
    consumer.close()


def test_a_redis_gone_while_the_fetched_are_requeued_does_not_stop_the_close(redis_url: str) -> None:
    port = urlsplit(redis_url).port
    assert port is not None
    with proxy_to(port) as proxy:
        broker = broker_at(proxy.url_for(redis_url))
        enqueue(broker, 4)
        consumer = broker.consume(QUEUE, prefetch=10, timeout=100)
        assert drain(consumer, 1)  # the other three wait in the consumer
        # Each try of the requeue is cut once sent: its reply never comes.
        proxy.cut_after = b"requeue"
        with capture_logs() as logs:
            consumer.close()  # no exception: the worker's stop goes on
    assert [e["event"] for e in logs if e["event"] == "fetched_messages_not_requeued"] == [
        "fetched_messages_not_requeued"
    ]


def test_a_claim_whose_message_a_later_middleware_skipped_is_given_back(
    db_url: str, redis_url: str, tmp_path: Path
) -> None:
    """A middleware after Switchboard's (an AgeLimit, a user's own) skips a
    claimed message: its actor never takes the claim, which is given back,
    not left running until its lease expires."""
    path = write_config(tmp_path / "switchboard.toml", database_url=db_url, redis_url=redis_url,
                        adapters=[stream_adapter(QUEUE)], queues={QUEUE: {"handler": HANDLER}})  # fmt: skip
    middleware = SwitchboardMiddleware(load(path, os.environ), threads=2)
    (todo_id,) = insert_todos(db_url, 1, queue=QUEUE)
    body: dramatiq.Message[Any] = dramatiq.Message(
        queue_name=QUEUE, actor_name=f"switchboard:{QUEUE}", args=(todo_id,), kwargs={}, options={}
    )
    message = MessageProxy(body)
    try:
        middleware._claims.claim([message])
        assert query(db_url, "SELECT status, attempts FROM todos") == [("running", 1)]
        middleware.after_skip_message(broker_at(redis_url), message)
        assert query(db_url, "SELECT status, attempts FROM todos") == [("dispatched", 0)]
    finally:
        middleware.after_worker_shutdown(broker_at(redis_url), None)
