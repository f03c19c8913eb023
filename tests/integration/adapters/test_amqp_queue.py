"""AMQP beyond the contract, against a real RabbitMQ (``tests/support/amqp.py``):
keys from ``message_id`` or the body's digest, delivery counts from a quorum
queue's ``x-delivery-count`` and the ``redelivered`` flag, the ack strictly
after the commit and only up to what committed, an ack sent and never marked
settled by the consumer's next channel, a channel the server closes
(``consumer_timeout``) surfaced as an error and recovered from, and a queue
that is not there."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import uuid
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from backhalf import failpoints
from backhalf.reads import backlog
from ingest.adapters.base import Delivery, PullAdapter
from ingest.adapters.factory import make_adapter
from ingest.config import AdapterConfig, Settings
from ingest.errors import BrokerError
from tests.support.amqp import declare_queue, owned_rabbitmq, publish, queue_counts
from tests.support.amqp_plain import publish_without_ids
from tests.support.db import acked, query, scalar
from tests.support.in_process import pipeline, settings, wait_until

NAME = "jobs"


@pytest.fixture
def registered() -> tuple[tuple[str, str], ...]:
    return ()  # the pipeline registers its adapter itself


@pytest.fixture
def no_failpoints() -> Iterator[None]:
    yield
    failpoints.configure("")


def unique(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:10]}"


def table(url: str, queue: str, **keys: Any) -> dict[str, Any]:
    return {
        "name": NAME,
        "transport": "amqp",
        "source": queue,
        "url": url,
        "consumer": "c1",
        "block_ms": 100,
        **keys,
    }


def one(s: Settings) -> AdapterConfig:
    (cfg,) = s.adapters
    return cfg


def bodies(n: int, start: int = 0) -> list[bytes]:
    return [json.dumps({"n": i}).encode() for i in range(start, start + n)]


async def read_n(adapter: PullAdapter, n: int) -> list[Delivery]:
    got: list[Delivery] = []
    async with asyncio.timeout(20):
        while len(got) < n:
            got += await adapter.read(n - len(got))
    return got


async def counts(url: str, queue: str) -> tuple[int, int, int]:
    return await asyncio.to_thread(queue_counts, url, queue)


async def test_keys_come_from_message_id_else_the_bodys_digest(
    db_url: str, redis_url: str, amqp_url: str
) -> None:
    queue = unique("keys")
    declare_queue(amqp_url, queue)
    sent = bodies(4)
    publish(amqp_url, queue, sent[:2], message_ids=["a-1", "a-2"])
    publish_without_ids(amqp_url, queue, sent[2:])
    s = settings(db_url, redis_url, table(amqp_url, queue))
    async with pipeline(s, acker=False):
        await wait_until(lambda: acked(db_url) == 4)
    rows = query(db_url, "SELECT idempotency_key, source_message_id FROM inbox ORDER BY idempotency_key")
    digests = [hashlib.sha256(b).hexdigest() for b in sent[2:]]
    assert sorted(rows) == sorted(
        [(f"amqp:{queue}:a-1", "a-1"), (f"amqp:{queue}:a-2", "a-2")]
        + [(f"amqp:{queue}:{d}", d) for d in digests]
    )
    assert await counts(amqp_url, queue) == (0, 0, 0)


async def test_the_same_body_without_a_message_id_makes_one_todo_even_after_it_ended(
    db_url: str, redis_url: str, amqp_url: str
) -> None:
    """The digest is the message's id: its inbox row dedups it for as long as
    the row is kept, not only while its todo is active."""
    queue = unique("dups")
    declare_queue(amqp_url, queue)
    s = settings(db_url, redis_url, table(amqp_url, queue))
    async with pipeline(s, acker=False):
        publish_without_ids(amqp_url, queue, [b'{"same": 1}'])
        await wait_until(lambda: acked(db_url) == 1)
        query(db_url, "UPDATE todos SET status = 'done'")
        publish_without_ids(amqp_url, queue, [b'{"same": 1}', b'{"same": 1}'])
        # Two copies in one batch merge before the store: counted once more.
        await wait_until(lambda: scalar(db_url, "SELECT deliveries FROM inbox") >= 2)
        await wait_until(lambda: _unacked_is(amqp_url, queue, 0))
    assert scalar(db_url, "SELECT count(*) FROM todos") == 1
    assert acked(db_url) == 1
    assert await counts(amqp_url, queue) == (0, 0, 0)


async def test_deliveries_are_counted_from_x_delivery_count_or_redelivered(
    db_url: str, redis_url: str, amqp_url: str
) -> None:
    for quorum in (False, True):
        queue = unique("quorum" if quorum else "classic")
        declare_queue(amqp_url, queue, quorum=quorum)
        publish(amqp_url, queue, bodies(3))
        s = settings(db_url, redis_url, table(amqp_url, queue))
        first = make_adapter(one(s), ledger=None)
        try:
            assert [d.deliveries for d in await read_n(first, 3)] == [1, 1, 1]
        finally:
            await first.close()  # unacked: requeued
        for expected in (2, 3):
            again = make_adapter(one(s), ledger=None)
            try:
                got = await read_n(again, 3)
            finally:
                await again.close()
            # A classic queue says only "redelivered"; a quorum queue counts.
            assert [d.deliveries for d in got] == [expected if quorum else 2] * 3, (quorum, got)


async def test_acks_only_what_committed_up_to_its_last_tag(
    db_url: str, redis_url: str, amqp_url: str
) -> None:
    """``ack_stored`` acks the batches ``stored()`` confirmed, with one
    multiple ack, never past them: the batch read after stays unacked."""
    queue = unique("upto")
    declare_queue(amqp_url, queue)
    publish(amqp_url, queue, bodies(10))
    s = settings(db_url, redis_url, table(amqp_url, queue, batch_size=5))
    adapter = make_adapter(one(s), ledger=None)
    try:
        first = await read_n(adapter, 5)
        second = await read_n(adapter, 5)
        assert await adapter.ack_stored() == []  # nothing committed yet
        adapter.stored()  # the first batch committed
        sent_acks = await adapter.ack_stored()
        assert [d.idempotency_key for d in sent_acks] == [d.idempotency_key for d in first]
        await wait_until(lambda: _unacked_is(amqp_url, queue, 5))
        assert await counts(amqp_url, queue) == (0, 5, 1)
        adapter.rewind()  # the second never commits: read again from memory, same channel
        replayed = await read_n(adapter, 5)
        assert [d.ack_ref for d in replayed] == [d.ack_ref for d in second]
        adapter.stored()
        assert len(await adapter.ack_stored()) == 5
        await wait_until(lambda: _unacked_is(amqp_url, queue, 0))
    finally:
        await adapter.close()
    assert await counts(amqp_url, queue) == (0, 0, 0)


async def _read_until_redelivered(adapter: PullAdapter) -> tuple[list[Delivery], list[str]]:
    """Read until the deliveries come again; how many reads failed first.
    The server's close surfaces as a BrokerError from a read, unless the
    next read already found the channel closed and opened a new one."""
    errors: list[str] = []
    async with asyncio.timeout(90):  # the server checks consumer timeouts every few seconds
        while True:
            try:
                got = await adapter.read(10)
            except BrokerError as exc:
                errors.append(str(exc))
                continue
            if got:
                return got, errors


async def _unacked_is(url: str, queue: str, n: int) -> bool:
    return (await counts(url, queue))[1] == n


async def test_an_ack_sent_but_never_marked_is_settled_by_the_next_channel(
    db_url: str, redis_url: str, amqp_url: str, engine: AsyncEngine, no_failpoints: None
) -> None:
    """A crash between the ack and its mark (injected: the step fails right
    after the ack) leaves rows pending whose messages the broker no longer
    holds; the consumer's next channel settles them, and nothing is stored
    twice."""
    queue = unique("settle")
    declare_queue(amqp_url, queue)
    publish(amqp_url, queue, bodies(6))
    s = settings(db_url, redis_url, table(amqp_url, queue))
    failpoints.configure("after_own_ack=raise@1")
    async with pipeline(s, acker=False):
        await wait_until(lambda: scalar(db_url, "SELECT count(*) FROM inbox") == 6)
        await wait_until(lambda: _unacked_is(amqp_url, queue, 0))
    assert scalar(db_url, "SELECT count(*) FROM inbox WHERE ack_state = 'pending'") == 6
    assert await counts(amqp_url, queue) == (0, 0, 0)
    # The acker's gauges see them (switchboard_pending_acks), though no cursor walks them.
    async with engine.connect() as conn:
        owed = await backlog.ack_backlog(conn, [NAME])
    assert owed[NAME].pending == 6
    failpoints.configure("")
    async with pipeline(s, acker=False):
        await wait_until(lambda: acked(db_url) == 6)
    assert scalar(db_url, "SELECT count(*) FROM todos") == 6
    assert scalar(db_url, "SELECT sum(deliveries) FROM inbox") == 6


async def test_a_commit_that_fails_after_the_commit_point_acks_nothing_until_stored_again(
    db_url: str, redis_url: str, amqp_url: str, no_failpoints: None
) -> None:
    """A failure right after the commit (before the ack): the messages stay
    unacked on the channel, are stored again from memory (deduplicated) and
    only then acked: one todo each, the queue empty."""
    queue = unique("after-commit")
    declare_queue(amqp_url, queue)
    publish(amqp_url, queue, bodies(8))
    s = settings(db_url, redis_url, table(amqp_url, queue))
    failpoints.configure("after_commit=raise@1")
    async with pipeline(s, acker=False):
        await wait_until(lambda: acked(db_url) == 8)
        await wait_until(lambda: _unacked_is(amqp_url, queue, 0))
    assert scalar(db_url, "SELECT count(*) FROM todos") == 8
    assert scalar(db_url, "SELECT count(*) FROM inbox") == 8


async def test_a_missing_queue_is_a_broker_error_saying_to_create_it(
    db_url: str, redis_url: str, amqp_url: str
) -> None:
    s = settings(db_url, redis_url, table(amqp_url, unique("absent")))
    adapter = make_adapter(one(s), ledger=None)
    try:
        with pytest.raises(BrokerError, match=r"does not exist .*create it"):
            await adapter.read(10)
        figures = await adapter.describe()
    finally:
        await adapter.close()
    assert figures["queue"] == "missing"


async def test_a_channel_the_server_closes_is_an_error_then_its_deliveries_come_back(
    db_url: str, redis_url: str
) -> None:
    """RabbitMQ's ``consumer_timeout`` closes a channel holding a delivery
    unacked too long, asynchronously: a read raises it (or the next read finds
    the channel closed and opens another; never a hang), and
    the reconnected adapter gets the deliveries again, counted as redelivered."""
    with owned_rabbitmq(consumer_timeout_ms=1000) as server:
        queue = unique("timeout")
        declare_queue(server.url, queue)
        publish(server.url, queue, bodies(3))
        s = settings(db_url, redis_url, table(server.url, queue))
        adapter = make_adapter(one(s), ledger=None)
        try:
            held = await read_n(adapter, 3)
            assert [d.deliveries for d in held] == [1, 1, 1]
            again, errors = await _read_until_redelivered(adapter)
            assert all("ended" in e for e in errors), errors
            if len(again) < 3:
                again += await read_n(adapter, 3 - len(again))
            assert sorted(d.idempotency_key for d in again) == sorted(d.idempotency_key for d in held)
            assert {d.deliveries for d in again} == {2}
            adapter.stored()  # a batch from the old channel is void; this one is live
        finally:
            await adapter.close()


async def test_settle_leaves_other_consumers_rows_and_this_channels_own(
    db_url: str, redis_url: str, amqp_url: str, engine: AsyncEngine
) -> None:
    """Only the intents of this consumer's ended channels are settled."""
    from backhalf.writes.stream_groups import GroupStartLedger

    queue = unique("scope")
    declare_queue(amqp_url, queue)
    publish(amqp_url, queue, bodies(3))
    s = settings(db_url, redis_url, table(amqp_url, queue))
    async with pipeline(s, acker=False):
        await wait_until(lambda: acked(db_url) == 3)
    query(
        db_url,
        "UPDATE inbox SET ack_state = 'pending', ack_xid = 1,"
        " consumer = CASE WHEN id = (SELECT min(id) FROM inbox) THEN 'c2' ELSE consumer END,"
        " ack_entry_id = CASE WHEN id = (SELECT max(id) FROM inbox) THEN 'now:7' ELSE 'old:7' END",
    )
    settled = await GroupStartLedger(engine, 10_000).settle_acks(NAME, "c1", "now:")
    assert settled == 1
    rows = query(db_url, "SELECT consumer, ack_entry_id, ack_state FROM inbox ORDER BY id")
    assert rows == [("c2", "old:7", "pending"), ("c1", "old:7", "acked"), ("c1", "now:7", "pending")]


async def test_a_disabled_adapter_gives_its_prefetch_back_and_resumes_when_enabled(
    db_url: str, redis_url: str, amqp_url: str, engine: AsyncEngine
) -> None:
    """Disabled, the ingester stops consuming: what its channel's prefetch
    held goes back to the queue (ready again, no consumer), for other
    consumers; enabled again, it is consumed and stored once."""
    from ingest.actions import adapters as adapter_actions

    queue = unique("enabled")
    declare_queue(amqp_url, queue)
    s = settings(db_url, redis_url, table(amqp_url, queue, batch_size=5))
    s = replace(s, ingest=replace(s.ingest, enabled_refresh_ms=100))
    async with pipeline(s, acker=False):
        await wait_until(lambda: _counts_are(amqp_url, queue, (0, 0, 1)))  # consuming
        publish(amqp_url, queue, bodies(3))
        await wait_until(lambda: acked(db_url) == 3)
        await adapter_actions.set_enabled(engine, NAME, False)
        await wait_until(lambda: _counts_are(amqp_url, queue, (0, 0, 0)))  # no consumer left
        # With no consumer on the queue, nothing published now can reach the
        # adapter: it stays ready in the queue.
        publish(amqp_url, queue, bodies(12, start=3))
        assert await counts(amqp_url, queue) == (12, 0, 0)
        await adapter_actions.set_enabled(engine, NAME, True)
        await wait_until(lambda: acked(db_url) == 15)
        await wait_until(lambda: _counts_are(amqp_url, queue, (0, 0, 1)))
    assert scalar(db_url, "SELECT count(*) FROM todos") == 15


async def _counts_are(url: str, queue: str, expected: tuple[int, int, int]) -> bool:
    return await counts(url, queue) == expected


async def test_marks_that_fail_are_written_with_the_next_batchs(
    db_url: str, redis_url: str, amqp_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The broker took the ack but its mark failed (the database away for a
    moment): the refs are kept and marked with the next batch's."""
    from backhalf.errors import AckStateError
    from backhalf.writes import acks

    real = acks.mark_own
    failures = [AckStateError("injected: the mark's transaction failed")]

    async def failing_once(conn: Any, adapter: str, refs: Any) -> int:
        if failures:
            raise failures.pop()
        return await real(conn, adapter, refs)

    monkeypatch.setattr(acks, "mark_own", failing_once)
    queue = unique("marks")
    declare_queue(amqp_url, queue)
    s = settings(db_url, redis_url, table(amqp_url, queue))
    async with pipeline(s, acker=False):
        publish(amqp_url, queue, bodies(4))
        await wait_until(lambda: scalar(db_url, "SELECT count(*) FROM inbox") == 4)
        await wait_until(lambda: _unacked_is(amqp_url, queue, 0))
        # The mark follows the broker's ack: its (failing) transaction comes
        # a moment after the queue shows none unacked.
        await wait_until(lambda: not failures)
        assert scalar(db_url, "SELECT count(*) FROM inbox WHERE ack_state = 'pending'") == 4
        publish(amqp_url, queue, bodies(2, start=4))
        await wait_until(lambda: acked(db_url) == 6)


async def test_a_rewound_batch_of_a_dropped_channel_is_never_replayed_as_live(
    db_url: str, redis_url: str, amqp_url: str
) -> None:
    """Its tags named deliveries of a channel that is gone: replayed, their
    ack would go to the next channel, where the same tags name other
    messages. They come again from the broker instead, with new refs."""
    queue = unique("dropped")
    declare_queue(amqp_url, queue)
    publish(amqp_url, queue, bodies(3))
    s = settings(db_url, redis_url, table(amqp_url, queue))
    adapter = make_adapter(one(s), ledger=None)
    try:
        first = await read_n(adapter, 3)
        await adapter.pause()  # the channel goes (as after a failed ack)
        adapter.rewind()
        again = await read_n(adapter, 3)
    finally:
        await adapter.close()
    assert sorted(d.idempotency_key for d in again) == sorted(d.idempotency_key for d in first)
    assert not {d.ack_ref for d in again} & {d.ack_ref for d in first}
    assert {d.deliveries for d in again} == {2}


async def test_a_read_cancelled_while_the_channel_opens_leaves_no_half_open_channel(
    db_url: str, redis_url: str, amqp_url: str
) -> None:
    """A stop or an abandoned prefetch cancels a read at any await of the
    channel's opening: the next read opens a consuming channel again, never
    a half-open one with no consumer (which would read nothing, for good).
    The cancellation is tried every 6 ms through an opening (one of these
    found a channel left half-open, and a raw client error)."""
    queue = unique("cancelled")
    declare_queue(amqp_url, queue)
    s = settings(db_url, redis_url, table(amqp_url, queue))
    adapter = make_adapter(one(s), ledger=None)
    try:
        for delay_ms in range(0, 120, 6):
            publish(amqp_url, queue, bodies(1, start=delay_ms))
            await adapter.pause()  # the next read opens a channel
            reading = asyncio.create_task(adapter.read(1))
            await asyncio.sleep(delay_ms / 1000)
            reading.cancel()
            got: list[Delivery] = []
            with contextlib.suppress(asyncio.CancelledError):
                got = await reading
            if not got:  # cancelled: the poll loop rewinds what an abandoned read took
                adapter.rewind()
                got = await read_n(adapter, 1)
            assert len(got) == 1, delay_ms
            adapter.stored()
            await adapter.ack_stored()
    finally:
        await adapter.close()
    assert await counts(amqp_url, queue) == (0, 0, 0)
