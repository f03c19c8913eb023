"""The relay's enqueue against real Redis: one dramatiq message per todo,
sent as one pipeline, readable by dramatiq's own consumer; and the
relay's claim against real PostgreSQL."""

from __future__ import annotations

from urllib.parse import urlsplit

import psycopg
import redis
from dramatiq.brokers.redis import RedisBroker

from backhalf import queries
from backhalf.dispatch import Enqueuer
from backhalf.queues import QueueConfig
from tests.support.db import libpq, query
from tests.support.plans import scans_of

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


def test_the_relays_claim_reads_no_finished_todo(db_url: str) -> None:
    """Issue 25: 200,000 done todos retained beside a backlog of pending ones,
    statistics up to date. The claim walks each queue's pending rows in id
    order and stops at its limit (per queue); in one walk over all queues
    in id order PostgreSQL chose the primary key and filtered every done
    todo out, 110 ms a claim."""
    with psycopg.connect(libpq(db_url), autocommit=True) as conn:
        conn.execute(
            "INSERT INTO todos (queue, idempotency_key, payload, status)"
            " SELECT 'orders', 'done-' || g, '{}', 'done' FROM generate_series(1, 200000) g"
        )
        for queue in ("orders", "refunds"):
            conn.execute(
                "INSERT INTO todos (queue, idempotency_key, payload, status)"
                " SELECT %(q)s, 'new-' || g, '{}', 'pending' FROM generate_series(1, 1000) g",
                {"q": queue},
            )
        conn.execute("ANALYZE todos")
        with conn.transaction():
            claimed = conn.execute(
                queries.CLAIM_PENDING_TODOS, {"queues": ["orders", "refunds"], "limit": 100}
            )
            rows = claimed.fetchall()
            (plan,) = conn.execute(
                "EXPLAIN (ANALYZE, FORMAT JSON) " + queries.CLAIM_PENDING_TODOS,
                {"queues": ["orders", "refunds"], "limit": 100},
            ).fetchone()  # type: ignore[misc]
    assert sorted({q for _, q in rows}) == ["orders", "refunds"]
    assert len(rows) == 200  # up to the limit of each queue, oldest first
    oldest = query(db_url, "SELECT min(id) FROM todos WHERE status = 'pending' GROUP BY queue ORDER BY 1")
    assert {i for (i,) in oldest} <= {i for i, _ in rows}
    scans = scans_of(plan[0]["Plan"], "todos")
    assert {s.get("Index Name") for s in scans} == {"ix_todos_pending"}, scans
    # The claim again (its own locks do not stop it): 100 index entries of
    # each queue read, no done todo.
    assert sum(int(s["Actual Rows"]) * int(s["Actual Loops"]) for s in scans) <= 2 * 100, scans
