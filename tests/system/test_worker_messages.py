"""A dramatiq message is a hint, never an authority (issue 32): real
``switchboard worker`` processes fed forged messages through dramatiq's own
Redis, as any client with the broker's password could send them. Each
refused message runs no handler (``handler_runs`` stays empty for it), is
not retried (nothing left in dramatiq's queues), and leaves its todo as it
was; options that would override the queue's settings are ignored."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import dramatiq
import pytest
import redis
from dramatiq.brokers.redis import RedisBroker

from ingest.embedded.processes import SwitchboardProcess, wait_for, wait_ready
from tests.support.config import stream_adapter
from tests.support.db import query, scalar
from tests.support.downstream import QUEUE, dramatiq_url
from tests.support.processes import Processes, assert_clean_exit

pytestmark = pytest.mark.system


def make_todo(db_url: str, queue: str, key: str, payload: dict[str, Any]) -> int:
    """A todo as the relay leaves it: dispatched, its message on its way."""
    return int(
        scalar(
            db_url,
            "INSERT INTO todos (queue, idempotency_key, payload, status, dispatched_at)"
            " VALUES (%(q)s, %(k)s, %(p)s, 'dispatched', now()) RETURNING id",
            {"q": queue, "k": key, "p": json.dumps(payload)},
        )
    )


@pytest.fixture
def broker(redis_url: str) -> Iterator[RedisBroker]:
    """A client of the workers' dramatiq Redis: what a forger would use."""
    client = redis.Redis.from_url(dramatiq_url(redis_url), socket_timeout=10)
    forger = RedisBroker(client=client)  # type: ignore[no-untyped-call]
    yield forger
    forger.close()


def send_raw(redis_url: str, onto: str, body: dict[str, Any]) -> None:
    """A message body as a forger writes it, onto dramatiq queue ``onto``,
    whatever its fields say (what dramatiq's dispatch script does)."""
    message_id = str(uuid.uuid4())
    body = {"message_id": message_id, "message_timestamp": 0, "options": {}, **body}
    with redis.Redis.from_url(dramatiq_url(redis_url), socket_timeout=10) as r:
        pipe = r.pipeline(transaction=True)
        pipe.hset(f"dramatiq:{onto}.msgs", message_id, json.dumps(body))
        pipe.rpush(f"dramatiq:{onto}", message_id)
        pipe.execute()


def send(broker: RedisBroker, queue_name: str, actor_name: str, *args: Any, **extra: Any) -> None:
    broker.enqueue(
        dramatiq.Message(
            queue_name=queue_name,
            actor_name=actor_name,
            args=args,
            kwargs=extra.get("kwargs", {}),
            options=extra.get("options", {}),
        )
    )


@pytest.fixture
def worker(
    procs: Processes, make_config: Callable[..., Path], redis_url: str, runs_db: str
) -> Iterator[SwitchboardProcess]:
    config = make_config(
        stream_adapter("orders"),
        queues={"orders": QUEUE, "refunds": QUEUE},
        dramatiq_url=dramatiq_url(redis_url),
    )
    proc = procs.start("worker", config, name="worker-1")
    wait_ready(proc, timeout_s=60)
    yield proc
    proc.terminate()
    assert_clean_exit(proc, 0)


def refusals(worker: SwitchboardProcess) -> list[str]:
    return [str(e["reason"]) for e in worker.events("message_refused")]


def dramatiq_backlog(redis_url: str) -> int:
    """Messages dramatiq's Redis still holds, queued, delayed for a retry or
    unacked: every one sits in its queue's ``.msgs`` hash until acked."""
    with redis.Redis.from_url(dramatiq_url(redis_url), socket_timeout=10) as r:
        return sum(int(r.hlen(k)) for k in r.scan_iter("dramatiq:*.msgs"))


def test_forged_messages_run_no_handler_and_are_not_retried(
    worker: SwitchboardProcess, broker: RedisBroker, db_url: str, redis_url: str
) -> None:
    refund = make_todo(db_url, "refunds", "refund-1", {"n": 1})
    # A todo of refunds, named by a message for the orders actor.
    send(broker, "orders", "switchboard:orders", refund)
    # The refunds actor on the orders queue, steering it with a keyword.
    send(broker, "orders", "switchboard:refunds", refund, kwargs={"_queue": "refunds"})
    # The refunds actor on a dramatiq queue not its own.
    send(broker, "orders", "switchboard:refunds", refund)
    # Not one todo id: a string, a number beyond bigint, a boolean, two ids.
    send(broker, "orders", "switchboard:orders", "abc")
    send(broker, "orders", "switchboard:orders", 2**70)
    send(broker, "orders", "switchboard:orders", True)
    send(broker, "orders", "switchboard:orders", refund, refund)
    # Shapes dramatiq decodes without a check (review of issue 32): keywords
    # that are not a dict, a retry count that would zero the backoff, a body
    # naming a queue the worker does not consume (it ended dramatiq's thread).
    for forged in (
        {"queue_name": "orders", "actor_name": "switchboard:orders", "args": [refund], "kwargs": None},
        {"queue_name": "orders", "actor_name": "switchboard:orders", "args": [refund], "kwargs": 5},
        {"queue_name": 7, "actor_name": "switchboard:orders", "args": [refund], "kwargs": {}},
    ):
        send_raw(redis_url, "orders", forged)
    for _ in range(10):  # more than the worker's threads
        send_raw(
            redis_url,
            "orders",
            {"queue_name": "zzz", "actor_name": "switchboard:orders", "args": [1], "kwargs": {}},
        )
    # Then a good message: once it is done, every forged one ahead of it was read.
    order = make_todo(db_url, "orders", "order-1", {"n": 2})
    send(broker, "orders", "switchboard:orders", order)
    wait_for(
        lambda: scalar(db_url, "SELECT status FROM todos WHERE id = %(i)s", {"i": order}) == "done",
        timeout_s=60,
        what="the good todo done",
    )
    wait_for(lambda: len(refusals(worker)) >= 20, timeout_s=30, what="twenty refusals logged")
    expected = ["todo_of_another_queue", *["bad_arguments"] * 8, *["other_queue"] * 11]
    assert sorted(refusals(worker)) == sorted(expected)
    assert "Logging error" not in worker.raw_log()  # dramatiq's own lines never met a forged shape
    # None ran a handler, or touched the refunds todo; none is waiting for a retry.
    assert query(db_url, "SELECT DISTINCT todo_id FROM handler_runs") == [(order,)]
    assert query(db_url, "SELECT status, attempts FROM todos WHERE id = %(i)s", {"i": refund}) == [
        ("dispatched", 0)
    ]
    wait_for(lambda: dramatiq_backlog(redis_url) == 0, timeout_s=30, what="every message acked, none delayed")


def test_a_messages_options_do_not_override_its_queue(
    worker: SwitchboardProcess, broker: RedisBroker, db_url: str
) -> None:
    """A time limit of 50 ms and no retries, asked by the message: the
    handler sleeps 0.5 s and is done at its first attempt all the same."""
    todo = make_todo(db_url, "orders", "slow-1", {"sleep_s": 0.5})
    send(broker, "orders", "switchboard:orders", todo, options={"time_limit": 50, "max_retries": 0})
    wait_for(
        lambda: scalar(db_url, "SELECT status FROM todos WHERE id = %(i)s", {"i": todo}) == "done",
        timeout_s=60,
        what="the todo done",
    )
    ran = query(db_url, "SELECT attempts, last_error FROM todos WHERE id = %(i)s", {"i": todo})
    assert ran == [(1, None)]
    (ignored,) = worker.events("message_options_ignored")
    assert ignored["options"] == ["max_retries", "time_limit"]
