"""SQS beyond the contract, against the suite's SQS-compatible server
(``tests/support/sqs.py``): deletes the queue refuses one by one, a
redelivery's newer receipt handle, the visibility held while a batch is
unstored and released at the stop, the redrive policy checked against
``max_deliveries``, FIFO order per group, and a queue that is not there."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine
from structlog.testing import capture_logs

from backhalf.records import AckClaim
from ingest.adapters.factory import make_acknowledger, make_adapter
from ingest.config import AdapterConfig, Settings
from ingest.errors import AckError, BrokerError
from ingest.processes.ack.acker import drain_adapter, drain_loop
from ingest.processes.pull.ingester import run_ingester
from tests.support.db import query, scalar
from tests.support.in_process import pipeline, settings, wait_until
from tests.support.sqs import REGION, client, counts, create_queue, receive, send, use_emulator_credentials

NAME = "orders"


@pytest.fixture
def registered() -> tuple[tuple[str, str], ...]:
    return ()  # the pipeline registers its adapter itself


@pytest.fixture
def sqs(sqs_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    use_emulator_credentials(monkeypatch)
    return client(sqs_endpoint)


def unique(name: str, *, fifo: bool = False) -> str:
    return f"{name}-{uuid.uuid4().hex[:10]}" + (".fifo" if fifo else "")


def table(endpoint: str, queue: str, **keys: Any) -> dict[str, Any]:
    return {
        "name": NAME,
        "transport": "sqs",
        "source": queue,
        "url": endpoint,
        "region": REGION,
        "consumer": "c1",
        "block_ms": 1000,
        **keys,
    }


def one(s: Settings) -> AdapterConfig:
    (cfg,) = s.adapters
    return cfg


def bodies(n: int, start: int = 0, **extra: Any) -> list[bytes]:
    return [json.dumps({"n": i, **extra}).encode() for i in range(start, start + n)]


async def test_deletes_the_queue_refuses_stay_owed_until_a_redelivery_brings_a_newer_handle(
    db_url: str, redis_url: str, sqs_endpoint: str, sqs: Any, engine: AsyncEngine
) -> None:
    """A DeleteMessageBatch whose entries fail one by one: those stay owed
    and are retried, none is marked acked, the rest are; the message comes
    back after its visibility timeout with a newer handle, which its inbox
    row takes, and the delete with it empties the queue: one todo each."""
    queue = unique("orders")
    url = create_queue(sqs, queue)
    s = settings(db_url, redis_url, table(sqs_endpoint, queue, ack_wait_ms=3000))
    send(sqs, url, bodies(12))
    async with pipeline(s, acker=False):
        await wait_until(lambda: scalar(db_url, "SELECT count(*) FROM inbox") == 12)
    # Three handles the queue no longer takes (moto refuses an unknown
    # handle with ReceiptHandleIsInvalid, as AWS does an expired FIFO one).
    refused = [i for (i,) in query(db_url, "SELECT id FROM inbox ORDER BY id LIMIT 3 OFFSET 4")]
    query(
        db_url,
        "UPDATE inbox SET ack_entry_id = 'gone-' || id WHERE id = ANY(%(ids)s) RETURNING id",
        {"ids": refused},
    )
    acknowledger = make_acknowledger(one(s))
    try:
        for _ in range(2):  # and again: the refused ones are taken again, the others not resent
            with pytest.raises(AckError, match="refused 3 of"):
                await drain_adapter(engine, NAME, acknowledger, limit=100)
            states = dict(query(db_url, "SELECT id, ack_state FROM inbox"))
            assert {i for i, st in states.items() if st == "pending"} == set(refused)
            assert sum(st == "acked" for st in states.values()) == 9
            visible, in_flight, _ = counts(sqs, url)
            assert visible + in_flight == 3  # nine deleted, the refused three not
    finally:
        await acknowledger.close()
    # The three come back once their visibility lapses: their rows take the
    # newer handles, and the acker deletes with them.
    async with pipeline(s):
        await wait_until(lambda: scalar(db_url, "SELECT count(*) FROM inbox WHERE ack_state = 'acked'") == 12)
        await wait_until(lambda: counts(sqs, url) == (0, 0, 0))
    rows = query(
        db_url, "SELECT ack_entry_id, deliveries FROM inbox WHERE id = ANY(%(ids)s)", {"ids": refused}
    )
    assert all(not handle.startswith("gone-") and deliveries == 2 for handle, deliveries in rows), rows
    assert scalar(db_url, "SELECT count(*) FROM inbox") == 12
    assert scalar(db_url, "SELECT count(*) FROM todos") == 12


async def test_a_held_batch_stays_invisible_and_is_released_at_the_stop(
    db_url: str, redis_url: str, sqs_endpoint: str, sqs: Any
) -> None:
    """Read and not stored (a slow commit): the visibility is extended past
    its timeout, so no other consumer gets the messages meanwhile; the stop
    releases them at once instead of after the timeout."""
    queue = unique("held")
    url = create_queue(sqs, queue)
    send(sqs, url, bodies(3))
    cfg = one(settings(db_url, redis_url, table(sqs_endpoint, queue, ack_wait_ms=2000)))
    adapter = make_adapter(cfg, ledger=None)
    stop = asyncio.Event()
    extending = asyncio.create_task(adapter.run_background(stop))
    try:
        held = await adapter.read(10)
        assert len(held) == 3
        # Two and a half visibility timeouts: never visible again meanwhile.
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            assert await asyncio.to_thread(counts, sqs, url) == (0, 3, 0)
            await asyncio.sleep(0.25)
    finally:
        stop.set()
        await extending
        await adapter.close()
    assert counts(sqs, url) == (3, 0, 0)  # released at once, not after 2 s


async def test_a_redrive_that_would_move_poison_away_unseen_is_refused(
    db_url: str, redis_url: str, sqs_endpoint: str, sqs: Any
) -> None:
    early = unique("early")
    create_queue(sqs, early, max_receive_count=5)
    adapter = make_adapter(one(settings(db_url, redis_url, table(sqs_endpoint, early))), ledger=None)
    with pytest.raises(BrokerError, match=r"maxReceiveCount\), before Switchboard's max_deliveries \(10\)"):
        await adapter.start()
    await adapter.close()
    fine = unique("fine")
    create_queue(sqs, fine, max_receive_count=15)
    adapter = make_adapter(one(settings(db_url, redis_url, table(sqs_endpoint, fine))), ledger=None)
    try:
        await adapter.start()
        figures = await adapter.describe()
    finally:
        await adapter.close()
    assert figures == {
        "visible": 0,
        "in_flight": 0,
        "delayed": 0,
        "fifo": False,
        "max_receive_count": 15,
        "dead_letter_messages": 0,
    }


async def test_a_queue_that_does_not_exist_is_a_broker_error_saying_so(
    db_url: str, redis_url: str, sqs_endpoint: str, sqs: Any
) -> None:
    adapter = make_adapter(one(settings(db_url, redis_url, table(sqs_endpoint, "nowhere"))), ledger=None)
    with pytest.raises(
        BrokerError, match=r"the SQS queue 'nowhere' does not exist at 127\.0\.0\.1:.*create it"
    ):
        await adapter.start()
    await adapter.close()


async def test_fifo_groups_are_stored_in_their_order(
    db_url: str, redis_url: str, sqs_endpoint: str, sqs: Any
) -> None:
    """Three groups, small batches read concurrently: within each group no
    later message is stored before an earlier one. A batch is one
    transaction (its rows are written in key order, the store's lock
    order), so order shows between batches: ``stored_at`` is the storing
    transaction's start, and a group's next messages are received only once
    the earlier ones are deleted, after their commit."""
    queue = unique("fifo", fifo=True)
    url = create_queue(sqs, queue, fifo=True)
    for group in ("a", "b", "c"):
        send(sqs, url, bodies(12, group=group), group=group)
    s = settings(db_url, redis_url, table(sqs_endpoint, queue, batch_size=4))
    async with pipeline(s):
        await wait_until(lambda: scalar(db_url, "SELECT count(*) FROM inbox WHERE ack_state = 'acked'") == 36)
    rows = query(db_url, "SELECT body, stored_at FROM inbox")
    # Each row keeps its message's group and sequence number, for audit.
    audited = query(db_url, "SELECT body, source_attributes FROM inbox")
    for group in ("a", "b", "c"):
        mine = sorted(
            (json.loads(bytes(b))["n"], a) for b, a in audited if json.loads(bytes(b))["group"] == group
        )
        assert {a["MessageGroupId"] for _, a in mine} == {group}
        # moto's SequenceNumbers are random (AWS's grow within a group): present and distinct.
        sequence = [a["SequenceNumber"] for _, a in mine]
        assert all(number.isdigit() for number in sequence)
        assert len(set(sequence)) == 12
    for group in ("a", "b", "c"):
        times = sorted(
            (m["n"], at) for m, at in ((json.loads(bytes(b)), at) for b, at in rows) if m["group"] == group
        )
        assert [n for n, _ in times] == list(range(12))
        assert [at for _, at in times] == sorted(at for _, at in times), f"group {group} stored out of order"
    assert len({at for _, at in rows}) > 3  # several batches, not one
    assert counts(sqs, url) == (0, 0, 0)


async def test_a_handle_refused_as_invalid_for_three_timeouts_is_given_up(
    db_url: str, redis_url: str, sqs_endpoint: str, sqs: Any, engine: AsyncEngine
) -> None:
    """A message deleted behind Switchboard's back (another consumer, a
    purge): its handle is refused for good. It stays owed for three
    visibility timeouts (were the message still queued, it would have come
    back with a newer handle by then), then its delete is given up."""
    queue = unique("gone")
    url = create_queue(sqs, queue)
    s = settings(db_url, redis_url, table(sqs_endpoint, queue, ack_wait_ms=1000))
    send(sqs, url, bodies(2))
    async with pipeline(s, acker=False):
        await wait_until(lambda: scalar(db_url, "SELECT count(*) FROM inbox") == 2)
    gone, handle = query(db_url, "SELECT id, ack_entry_id FROM inbox ORDER BY id LIMIT 1")[0]
    sqs.delete_message(QueueUrl=url, ReceiptHandle=handle)  # deleted elsewhere
    query(db_url, "UPDATE inbox SET ack_entry_id = 'gone' WHERE id = %(id)s RETURNING id", {"id": gone})
    acknowledger = make_acknowledger(one(s))
    refused_for = 0.0
    try:
        started = time.monotonic()
        with pytest.raises(AckError, match="refused 1 of 2"):
            await drain_adapter(engine, NAME, acknowledger, limit=100)
        async with asyncio.timeout(15):
            while True:
                try:
                    await drain_adapter(engine, NAME, acknowledger, limit=100)
                    break
                except AckError:
                    refused_for = time.monotonic() - started
                    await asyncio.sleep(0.2)
    finally:
        await acknowledger.close()
    assert refused_for >= 2.5  # owed, and retried, for most of three 1 s timeouts first
    assert scalar(db_url, "SELECT count(*) FROM inbox WHERE ack_state = 'acked'") == 2
    assert counts(sqs, url) == (0, 0, 0)


async def test_a_refused_delete_holds_back_no_other(
    db_url: str, redis_url: str, sqs_endpoint: str, sqs: Any, engine: AsyncEngine
) -> None:
    """The acker's loop with a minute of backoff: a delete the queue keeps
    refusing does not back the adapter off, so messages stored after it are
    deleted at the poll's pace, not a backoff later."""
    queue = unique("refused")
    url = create_queue(sqs, queue, visibility_timeout_s=300)
    s = settings(db_url, redis_url, table(sqs_endpoint, queue, ack_wait_ms=300_000))
    send(sqs, url, bodies(3))
    async with pipeline(s, acker=False):
        await wait_until(lambda: scalar(db_url, "SELECT count(*) FROM inbox") == 3)
    query(
        db_url, "UPDATE inbox SET ack_entry_id = 'gone' WHERE id = (SELECT min(id) FROM inbox) RETURNING id"
    )
    acknowledger = make_acknowledger(one(s))
    slow = s.acker.__class__(poll_interval_ms=100, backoff_initial_ms=60_000, backoff_max_ms=60_000)
    stop, wake = asyncio.Event(), asyncio.Event()
    loop = asyncio.create_task(drain_loop(engine, {NAME: acknowledger}, slow, wake, stop))
    try:
        await wait_until(lambda: scalar(db_url, "SELECT count(*) FROM inbox WHERE ack_state = 'acked'") == 2)
        send(sqs, url, bodies(3, start=3))
        # The ingester beside the acker's loop (pipeline() would count the
        # loop's own tasks as the ingester's leftovers).
        stop_ingest = asyncio.Event()
        ingesting = asyncio.create_task(run_ingester(s, stop_ingest))
        try:
            await wait_until(lambda: scalar(db_url, "SELECT count(*) FROM inbox") == 6)
        finally:
            stop_ingest.set()
            await ingesting
        await wait_until(lambda: scalar(db_url, "SELECT count(*) FROM inbox WHERE ack_state = 'acked'") == 5)
    finally:
        stop.set()
        await loop
        await acknowledger.close()
    assert scalar(db_url, "SELECT ack_entry_id FROM inbox WHERE ack_state = 'pending'") == "gone"
    assert counts(sqs, url) == (0, 1, 0)


async def test_a_receive_a_stop_cancels_is_answered_and_released(
    db_url: str, redis_url: str, sqs_endpoint: str, sqs: Any
) -> None:
    """A stop cancels the read while its long poll waits; messages sent
    then are still handed to that request by the queue (SQS, like the
    emulator, does not know the client left). The adapter waits for that
    answer at its close and releases them, instead of leaving them invisible
    for the visibility timeout (the first cut of this adapter did)."""
    queue = unique("stopped")
    url = create_queue(sqs, queue, visibility_timeout_s=300)
    cfg = one(settings(db_url, redis_url, table(sqs_endpoint, queue, block_ms=3000, ack_wait_ms=300_000)))
    adapter = make_adapter(cfg, ledger=None)
    await adapter.start()
    reading = asyncio.create_task(adapter.read(10))
    await asyncio.sleep(0.5)  # the long poll under way at the server
    reading.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reading
    await asyncio.to_thread(send, sqs, url, bodies(3))
    await adapter.close()
    assert counts(sqs, url) == (3, 0, 0)


async def test_an_aws_profile_that_does_not_exist_is_a_broker_error_naming_it(
    db_url: str, redis_url: str, sqs_endpoint: str, sqs: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """AWS's chain refuses a profile its files do not have before it looks
    at the keys: said as the adapter's broker error (backed off, logged
    without a traceback), not a crash of the poll step."""
    monkeypatch.setenv("AWS_PROFILE", "no-such-profile")
    adapter = make_adapter(one(settings(db_url, redis_url, table(sqs_endpoint, "orders"))), ledger=None)
    with pytest.raises(BrokerError, match=r"creating the sqs client .*config profile \(no-such-profile\)"):
        await adapter.start()
    await adapter.close()


async def test_deletes_go_only_to_the_adapters_own_queue(
    db_url: str, redis_url: str, sqs_endpoint: str, sqs: Any
) -> None:
    """Issue 43: an intent's queue and receipt handle are a row's data,
    which any login that may write the row can point elsewhere. An intent
    naming another queue is not deleted, not returned as refused (it would
    stay owed forever), and named in one error line; the adapter's own
    intent in the same batch is deleted."""
    queue, other = unique("orders"), unique("billing")
    url, other_url = create_queue(sqs, queue), create_queue(sqs, other, visibility_timeout_s=1)
    send(sqs, url, bodies(1))
    send(sqs, other_url, bodies(1, tag="billing"))
    (mine,) = receive(sqs, url)
    (theirs,) = receive(sqs, other_url)
    claims = [
        AckClaim(1, NAME, "sqsdel", queue, None, mine["ReceiptHandle"], 1, None),
        AckClaim(2, NAME, "sqsdel", other, None, theirs["ReceiptHandle"], 1, None),
        AckClaim(3, NAME, "sqsdel", other_url, None, theirs["ReceiptHandle"], 1, None),
    ]
    acknowledger = make_acknowledger(one(settings(db_url, redis_url, table(sqs_endpoint, queue))))
    try:
        with capture_logs() as logs:
            refused = await acknowledger.ack(claims)
    finally:
        await acknowledger.close()
    assert refused == []
    assert counts(sqs, url) == (0, 0, 0)  # the adapter's own: deleted
    # The other queue's message is still there: received again once its
    # visibility lapses.
    (again,) = receive(sqs, other_url, wait_time_s=5)
    assert (again["MessageId"], again["Body"]) == (theirs["MessageId"], theirs["Body"])
    (line,) = [e for e in logs if e["event"] == "ack_target_refused"]
    assert (line["log_level"], line["adapter"], line["inbox_ids"]) == ("error", NAME, [2, 3])
    assert line["targets"] == sorted([f"sqsdel {other}", f"sqsdel {other_url}"])
    assert not any(theirs["ReceiptHandle"] in str(e) for e in logs)  # no handle in the logs


async def test_a_row_repointed_at_another_queue_is_marked_acked_without_a_delete(
    db_url: str, redis_url: str, sqs_endpoint: str, sqs: Any, engine: AsyncEngine
) -> None:
    """The finding (issue 43), through the acker's drain: a stored row's
    ack_key and handle pointed at another application's queue. The drain
    raises nothing (the row is not owed), marks every row acked, deletes
    the adapter's other message, and the other queue keeps its own."""
    queue, other = unique("orders"), unique("billing")
    url, other_url = create_queue(sqs, queue), create_queue(sqs, other, visibility_timeout_s=1)
    s = settings(db_url, redis_url, table(sqs_endpoint, queue))
    send(sqs, url, bodies(2))
    send(sqs, other_url, bodies(1, tag="billing"))
    async with pipeline(s, acker=False):
        await wait_until(lambda: scalar(db_url, "SELECT count(*) FROM inbox") == 2)
    (theirs,) = receive(sqs, other_url)
    query(
        db_url,
        "UPDATE inbox SET ack_key = %(q)s, ack_entry_id = %(h)s WHERE id = (SELECT min(id) FROM inbox)"
        " RETURNING id",
        {"q": other, "h": theirs["ReceiptHandle"]},
    )
    acknowledger = make_acknowledger(one(s))
    try:
        assert await drain_adapter(engine, NAME, acknowledger, limit=100) == 2
        assert await drain_adapter(engine, NAME, acknowledger, limit=100) == 0
    finally:
        await acknowledger.close()
    assert query(db_url, "SELECT DISTINCT ack_state FROM inbox") == [("acked",)]
    # The repointed row's own message was not deleted either (its row names
    # another queue now): it stays in flight until its visibility lapses.
    assert counts(sqs, url) == (0, 1, 0)
    (again,) = receive(sqs, other_url, wait_time_s=5)
    assert again["MessageId"] == theirs["MessageId"]
