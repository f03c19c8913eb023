"""The relay's enqueue against real Redis: one dramatiq message per todo,
sent as one pipeline, readable by dramatiq's own consumer."""

from __future__ import annotations

from urllib.parse import urlsplit

import redis
from dramatiq.brokers.redis import RedisBroker

from backhalf.dispatch import Enqueuer
from backhalf.queues import QueueConfig

QUEUE = QueueConfig(name="orders", handler="m:f")


def dramatiq_db(redis_url: str) -> str:
    parts = urlsplit(redis_url)
    return f"{parts.scheme}://{parts.netloc}/1"


def test_a_batch_is_one_pipeline_of_messages_dramatiq_reads_back(redis_url: str) -> None:
    url = dramatiq_db(redis_url)
    enqueuer = Enqueuer(url)
    try:
        with redis.Redis.from_url(url, socket_timeout=10) as r:
            enqueuer.enqueue([(QUEUE, 1)])  # the first, alone (the broker primes itself)
            enqueuer.enqueue([(QUEUE, n) for n in range(2, 202)])  # the rest, pipelined
            assert r.hlen("dramatiq:orders.msgs") == 201
        # What the pipeline sent is what dramatiq's own consumer reads back.
        consumer_broker = RedisBroker(url=url)  # type: ignore[no-untyped-call]
        try:
            consumer_broker.declare_queue("orders")
            consumer = consumer_broker.consume("orders", prefetch=300, timeout=1000)
            seen: list[int] = []
            for message in consumer:
                if message is None:
                    break
                seen.append(int(message.args[0]))
                consumer.ack(message)
            consumer.close()
        finally:
            consumer_broker.close()
        assert sorted(seen) == list(range(1, 202))
    finally:
        enqueuer.close()
