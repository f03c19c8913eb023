"""store(batch) against real PostgreSQL: one transaction, set-based, deduped."""

from __future__ import annotations

import asyncio
import hashlib

import psycopg
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from backhalf.errors import StoreError
from backhalf.queries import ACK_CHANNEL, TODO_CHANNEL
from backhalf.records import AckTarget, InboxRecord, Provenance, StoreBatch
from backhalf.writes.store import store
from tests.support.db import libpq, listening, query, scalar


@pytest.fixture
def registered() -> tuple[tuple[str, str], ...]:
    return (("orders", "stream"), ("orders-mirror", "stream"))


def rec(entry_id: str, payload: str | None = '{"n": 1}', error: str | None = None) -> InboxRecord:
    return InboxRecord(
        idempotency_key=f"redis:orders:{entry_id}",
        source_message_id=entry_id,
        body=(payload or "raw").encode(),
        payload=payload,
        error=error,
        ack_ref=entry_id,
    )


PULLED = Provenance(family="queue", trust_mode="queue", verified=False, verify_detail="redis acl: deploy-bot")


def batch(*records: InboxRecord, adapter: str = "orders", provenance: Provenance = PULLED) -> StoreBatch:
    return StoreBatch(
        adapter=adapter,
        queue="orders",
        consumer="c1",
        ack_after="store",
        ack=AckTarget("xack", "orders", "switchboard", by_cursor=True),
        provenance=provenance,
        records=records,
    )


async def test_new_messages_become_inbox_event_and_todo_rows(engine: AsyncEngine, db_url: str) -> None:
    async with engine.begin() as conn:
        result = await store(conn, batch(rec("1-0", '{"n": 1}'), rec("2-0", '{"n": 2}')))
    assert (result.new, result.todos_created, result.redelivered, result.rejected) == (2, 2, 0, 0)
    rows = query(
        db_url,
        """SELECT i.idempotency_key, i.source_message_id, i.ack_kind, i.ack_key, i.ack_group, i.ack_entry_id,
                  i.ack_state, i.status, t.payload, t.status, e.family, e.trust_mode, e.verified,
                  e.verify_detail, e.payload = t.payload
           FROM inbox i JOIN todos t ON t.id = i.todo_id JOIN events e ON e.id = i.event_id
           ORDER BY i.id""",
    )
    assert rows == [
        ("redis:orders:1-0", "1-0", "xack", "orders", "switchboard", "1-0", "pending", "stored", {"n": 1},
         "pending", "queue", "queue", False, "redis acl: deploy-bot", True),
        ("redis:orders:2-0", "2-0", "xack", "orders", "switchboard", "2-0", "pending", "stored", {"n": 2},
         "pending", "queue", "queue", False, "redis acl: deploy-bot", True),
    ]  # fmt: skip
    assert scalar(db_url, "SELECT count(*) FROM todo_events WHERE to_status = 'pending'") == 2


async def test_events_carry_the_batchs_family_and_trust_metadata(engine: AsyncEngine, db_url: str) -> None:
    # Bound from the batch, not written into the SQL: a push delivery stored
    # through the same statement says so.
    pushed = Provenance(family="push", trust_mode="hmac", verified=True, verify_detail="key k1")
    async with engine.begin() as conn:
        await store(conn, batch(rec("1-0"), provenance=pushed))
        await store(conn, batch(rec("2-0")))
    assert query(
        db_url, "SELECT idempotency_key, family, trust_mode, verified, verify_detail FROM events ORDER BY id"
    ) == [
        ("redis:orders:1-0", "push", "hmac", True, "key k1"),
        ("redis:orders:2-0", "queue", "queue", False, "redis acl: deploy-bot"),
    ]
    # Each created todo is logged once, by the store.
    assert query(db_url, "SELECT from_status, to_status, detail FROM todo_events") == [
        (None, "pending", "created"),
        (None, "pending", "created"),
    ]


async def test_redelivery_returns_the_existing_todo_and_counts_the_delivery(
    engine: AsyncEngine, db_url: str
) -> None:
    async with engine.begin() as conn:
        await store(conn, batch(rec("1-0")))
    query(db_url, "UPDATE inbox SET ack_state = 'acked', acked_at = now()")
    query(db_url, "UPDATE todos SET status = 'done'")  # even after the todo finished...
    async with engine.begin() as conn:
        result = await store(conn, batch(rec("1-0"), rec("1-0")))  # ...and twice in one batch
    assert (result.new, result.redelivered, result.todos_created) == (0, 1, 0)
    assert query(db_url, "SELECT count(*) FROM todos") == [(1,)]
    assert query(db_url, "SELECT count(*) FROM events") == [(1,)]
    # deliveries: one more, or the broker's count if that is larger (here the
    # merged batch says 2); the ack is requested again (the entry is pending again).
    assert query(db_url, "SELECT deliveries, ack_state, acked_at FROM inbox") == [(2, "pending", None)]


async def test_a_redelivery_asks_its_ack_with_the_newest_deliverys_ref(
    engine: AsyncEngine, db_url: str
) -> None:
    """A JetStream reply subject (an SQS receipt handle) names one delivery of
    a message: the intent a redelivery asks again is the newest one's."""
    first, newest = "$JS.ACK.ORDERS.sb.1.7.7.100.0", "$JS.ACK.ORDERS.sb.2.7.9.200.0"
    async with engine.begin() as conn:
        await store(conn, batch(rec("7")._replace(ack_ref=first)))
    query(db_url, "UPDATE inbox SET ack_state = 'acked', acked_at = now()")
    async with engine.begin() as conn:
        await store(conn, batch(rec("7")._replace(ack_ref=newest, deliveries=2)))
    assert query(db_url, "SELECT ack_entry_id, ack_state, deliveries FROM inbox") == [(newest, "pending", 2)]


@pytest.mark.parametrize("todo_status", ["pending", "done"])
async def test_a_first_delivery_of_a_stored_entry_is_undone_to_one_todo_and_one_event(
    engine: AsyncEngine, db_url: str, todo_status: str
) -> None:
    # A recreated group delivers stored entries again with a delivery count
    # of 1: the store writes them without asking first, then undoes its event
    # (and the todo it created if the first one had finished).
    async with engine.begin() as conn:
        await store(conn, batch(rec("1-0"), rec("2-0")))
    query(db_url, "UPDATE inbox SET ack_state = 'acked', acked_at = now()")  # as the acker would
    first_xid = scalar(db_url, "SELECT ack_xid FROM inbox WHERE idempotency_key = 'redis:orders:1-0'")
    query(db_url, "UPDATE todos SET status = %(s)s", {"s": todo_status})
    before = query(db_url, "SELECT id, status FROM todos ORDER BY id")
    async with engine.begin() as conn:
        result = await store(conn, batch(rec("1-0"), rec("3-0")))
    assert (result.new, result.redelivered, result.todos_created, result.todos_deduped) == (1, 1, 1, 0)
    assert query(db_url, "SELECT id, status FROM todos ORDER BY id")[:2] == before
    assert query(db_url, "SELECT idempotency_key FROM todos ORDER BY id") == [
        ("redis:orders:1-0",),
        ("redis:orders:2-0",),
        ("redis:orders:3-0",),
    ]
    assert query(db_url, "SELECT idempotency_key FROM events ORDER BY id") == [
        ("redis:orders:1-0",),
        ("redis:orders:2-0",),
        ("redis:orders:3-0",),
    ]
    assert scalar(db_url, "SELECT count(*) FROM todo_events") == 3
    assert query(db_url, "SELECT idempotency_key, deliveries, ack_state FROM inbox ORDER BY id") == [
        ("redis:orders:1-0", 2, "pending"),
        ("redis:orders:2-0", 1, "acked"),
        ("redis:orders:3-0", 1, "pending"),
    ]
    # Both acks owed again through the acker's cursor, not queued: the
    # redelivered row carries this store's transaction id, past the first
    # store's, which the cursor may have passed already.
    assert scalar(db_url, "SELECT count(*) FROM ack_queue") == 0
    owed = "SELECT idempotency_key FROM inbox WHERE ack_xid IS NOT NULL AND ack_state = 'pending' ORDER BY id"
    assert query(db_url, owed) == [("redis:orders:1-0",), ("redis:orders:3-0",)]
    again = scalar(db_url, "SELECT ack_xid FROM inbox WHERE idempotency_key = 'redis:orders:1-0'")
    assert again > first_xid


async def test_same_key_on_another_adapter_dedups_to_the_active_todo(
    engine: AsyncEngine, db_url: str
) -> None:
    async with engine.begin() as conn:
        first = await store(conn, batch(rec("1-0")))
    async with engine.begin() as conn:
        second = await store(conn, batch(rec("1-0"), adapter="orders-mirror"))
    assert (first.todos_created, second.todos_created, second.todos_deduped) == (1, 0, 1)
    assert query(db_url, "SELECT count(*), count(DISTINCT todo_id) FROM inbox") == [(2, 1)]


async def test_poison_is_stored_rejected_without_todo_and_does_not_block_others(
    engine: AsyncEngine, db_url: str
) -> None:
    async with engine.begin() as conn:
        result = await store(conn, batch(rec("1-0", None, "invalid_json: x"), rec("2-0")))
    assert (result.new, result.rejected, result.todos_created) == (2, 1, 1)
    assert query(
        db_url, "SELECT source_message_id, status, error, todo_id IS NULL, ack_state FROM inbox ORDER BY id"
    ) == [
        ("1-0", "rejected", "invalid_json: x", True, "pending"),
        ("2-0", "stored", None, False, "pending"),
    ]
    assert query(db_url, "SELECT inbox_id FROM audit_rejected") == [(1,)]


async def test_nothing_survives_a_rolled_back_transaction(engine: AsyncEngine, db_url: str) -> None:
    async def store_then_crash() -> None:
        async with engine.begin() as conn:
            await store(conn, batch(rec("1-0")))
            raise RuntimeError("crash before commit")

    with pytest.raises(RuntimeError, match="crash before commit"):
        await store_then_crash()
    for table in ("inbox", "events", "todos", "todo_events"):
        assert scalar(db_url, f"SELECT count(*) FROM {table}") == 0


async def test_database_errors_are_wrapped_with_context(engine: AsyncEngine) -> None:
    async def store_unregistered() -> None:
        async with engine.begin() as conn:
            await store(conn, batch(rec("1-0"), adapter="unknown-adapter"))  # FK: not registered

    with pytest.raises(StoreError, match="adapter unknown-adapter: storing 1 messages failed") as info:
        await store_unregistered()
    assert isinstance(info.value.__cause__, psycopg.errors.ForeignKeyViolation)


async def test_notify_reaches_the_acker_only_on_commit(engine: AsyncEngine, db_url: str) -> None:
    async with await psycopg.AsyncConnection.connect(libpq(db_url), autocommit=True) as listener:
        await listener.execute(f"LISTEN {ACK_CHANNEL}")

        async def notified(timeout_s: float) -> list[str]:
            return [n.payload async for n in listener.notifies(timeout=timeout_s, stop_after=1)]

        async with engine.begin() as conn:
            await store(conn, batch(rec("1-0")))
            assert await notified(0.3) == []  # stored, not committed: silence
        assert await notified(5.0) == ["orders"]


async def test_new_todos_wake_the_workers_of_their_queue_only_on_commit(
    engine: AsyncEngine, db_url: str
) -> None:
    """The store NOTIFYs the workers' channel with the todos' queue as its
    payload, delivered when its transaction commits (their claim reads the
    committed rows); a batch that creates no todo (a redelivery) wakes no
    worker, though its ack is owed again."""
    with listening(db_url, TODO_CHANNEL) as todos_due, listening(db_url, ACK_CHANNEL) as acks_owed:
        async with engine.begin() as conn:
            await store(conn, batch(rec("1-0"), rec("2-0")))
            assert todos_due(0.3) == []  # stored, not committed: silence
        assert todos_due(5, 1) == ["orders"]  # one notification for the batch
        assert todos_due(0.3) == []
        assert acks_owed(5, 1) == ["orders"]
        async with engine.begin() as conn:
            result = await store(conn, batch(rec("1-0")))  # a redelivery: no todo made
        assert result.todos_created == 0
        assert todos_due(0.5) == []
        assert acks_owed(5, 1) == ["orders"]


async def test_a_batch_without_acks_wakes_the_workers_and_not_the_acker(
    engine: AsyncEngine, db_url: str
) -> None:
    """A push (or pub/sub) batch owes no ack, but its todos are due: the
    commit wakes the workers of its queue at once, not at their next poll,
    and leaves the acker be. A batch that creates nothing stays silent."""
    pushed = Provenance(
        family="push", trust_mode="hmac-sha256", verified=True, verify_detail="github secret: S"
    )
    no_ack = StoreBatch(
        adapter="orders-mirror",
        queue="refunds",
        consumer=None,
        ack_after="store",
        ack=AckTarget("none"),
        provenance=pushed,
        records=[rec("1-0")],
    )
    with listening(db_url, TODO_CHANNEL) as todos_due, listening(db_url, ACK_CHANNEL) as acks_owed:
        async with engine.begin() as conn:
            await store(conn, no_ack)
        assert todos_due(5, 1) == ["refunds"]  # the batch's queue, not its adapter
        async with engine.begin() as conn:
            result = await store(conn, no_ack)  # a duplicate: no todo made
        assert result.todos_created == 0
        assert todos_due(0.5) == []
        assert acks_owed(0.3) == []
    assert query(db_url, "SELECT queue, status FROM todos") == [("refunds", "pending")]


async def test_concurrent_stores_of_one_entry_make_one_todo(engine: AsyncEngine, db_url: str) -> None:
    async def one() -> None:
        async with engine.begin() as conn:
            await store(conn, batch(rec("7-0")))

    await asyncio.gather(*(one() for _ in range(4)))
    assert query(db_url, "SELECT count(*) FROM todos") == [(1,)]
    assert query(db_url, "SELECT deliveries FROM inbox") == [(4,)]  # one, then three more


# -- reused entry ids (issue 11, item 2) ----------------------------------------


def other(entry_id: str, payload: str, deliveries: int = 1) -> InboxRecord:
    """A message on ``entry_id`` that is not the one stored there."""
    return rec(entry_id, payload)._replace(deliveries=deliveries)


async def test_another_message_on_a_stored_entry_id_gets_its_own_todo(
    engine: AsyncEngine, db_url: str
) -> None:
    """Redis restored from an older snapshot hands out the lost ids again, as
    first deliveries: the new message is stored under the entry's key plus
    its digest, never dropped as a redelivery; the stored one is untouched."""
    async with engine.begin() as conn:
        await store(conn, batch(rec("1-0", '{"n": 1}'), rec("2-0", '{"n": 2}')))
    async with engine.begin() as conn:
        result = await store(
            conn, batch(other("1-0", '{"n": 10}'), rec("2-0", '{"n": 2}'), rec("3-0", '{"n": 3}'))
        )
    digest = hashlib.sha256(b'{"n": 10}').hexdigest()
    derived = f"redis:orders:1-0:{digest}"
    assert result.reused == (("1-0", derived),)
    assert (result.new, result.redelivered, result.todos_created) == (2, 1, 2)
    assert query(
        db_url,
        """SELECT i.idempotency_key, i.source_message_id, i.body, t.payload, i.ack_entry_id, i.deliveries
           FROM inbox i JOIN todos t ON t.id = i.todo_id ORDER BY i.id""",
    ) == [
        ("redis:orders:1-0", "1-0", b'{"n": 1}', {"n": 1}, "1-0", 1),
        ("redis:orders:2-0", "2-0", b'{"n": 2}', {"n": 2}, "2-0", 2),
        ("redis:orders:3-0", "3-0", b'{"n": 3}', {"n": 3}, "3-0", 1),
        (derived, "1-0", b'{"n": 10}', {"n": 10}, "1-0", 1),
    ]
    assert scalar(db_url, "SELECT count(*) FROM events") == 4
    # Every entry's ack owed, the new message's too (through the acker's cursor).
    assert (
        scalar(db_url, "SELECT count(*) FROM inbox WHERE ack_state = 'pending' AND ack_xid IS NOT NULL") == 4
    )


async def test_a_redelivery_of_the_reused_id_message_dedups_to_its_todo(
    engine: AsyncEngine, db_url: str
) -> None:
    async with engine.begin() as conn:
        await store(conn, batch(rec("1-0", '{"n": 1}')))
    async with engine.begin() as conn:
        first = await store(conn, batch(other("1-0", '{"n": 10}')))
    for deliveries in (1, 2):  # as a first delivery (group recreated) and as a redelivery
        async with engine.begin() as conn:
            again = await store(conn, batch(other("1-0", '{"n": 10}', deliveries=deliveries)))
        assert (again.new, again.redelivered, again.todos_created, again.reused) == (0, 1, 0, ())
    async with engine.begin() as conn:
        original = await store(conn, batch(rec("1-0", '{"n": 1}')._replace(deliveries=2)))
    assert len(first.reused) == 1
    assert (original.new, original.reused) == (0, ())
    assert scalar(db_url, "SELECT count(*) FROM todos") == 2
    assert scalar(db_url, "SELECT count(*) FROM events") == 2
    assert scalar(db_url, "SELECT max(deliveries) FROM inbox") == 3


async def test_two_messages_on_one_id_in_one_batch_are_two_messages(engine: AsyncEngine, db_url: str) -> None:
    """A producer's id used twice with different bodies in one batch (AMQP's
    ``message_id`` is the producer's choice): the second is not merged into
    the first as a copy; it is stored under its derived key. A copy of the
    same message in the batch is still one row, counted twice."""
    async with engine.begin() as conn:
        result = await store(
            conn,
            batch(
                rec("1-0", '{"n": 1}'), rec("1-0", '{"n": 2}'), rec("1-0", '{"n": 1}'), rec("2-0", '{"n": 3}')
            ),
        )
    second = hashlib.sha256(b'{"n": 2}').hexdigest()
    derived = f"redis:orders:1-0:{second}"
    assert (result.new, result.todos_created, result.reused) == (3, 3, (("1-0", derived),))
    assert query(db_url, "SELECT idempotency_key, body, deliveries FROM inbox ORDER BY idempotency_key") == [
        ("redis:orders:1-0", b'{"n": 1}', 2),
        (derived, b'{"n": 2}', 1),
        ("redis:orders:2-0", b'{"n": 3}', 1),
    ]


async def test_a_derived_key_conflict_is_that_messages_rejection_not_its_batchs_failure(
    engine: AsyncEngine, db_url: str
) -> None:
    """The review's three messages, with ids taken into keys as they were
    (an id that looks like a derived key): ``1-0``, then ``1-0:<digest of B>``
    holding another body, then ``1-0`` with body B, whose derived key is
    taken. That message alone is rejected, under a key of its own; the rest
    of its batch is stored, and a redelivery of the batch dedups."""
    body_b = '{"n": 20}'
    squatter = f"1-0:{hashlib.sha256(body_b.encode()).hexdigest()}"
    async with engine.begin() as conn:
        await store(conn, batch(rec("1-0", '{"n": 1}'), rec(squatter, '{"n": 666}')))
    for deliveries in (1, 2):
        async with engine.begin() as conn:
            result = await store(
                conn,
                batch(
                    other("1-0", body_b, deliveries), rec("2-0", '{"n": 2}')._replace(deliveries=deliveries)
                ),
            )
        if deliveries == 1:
            assert (result.new, result.rejected, result.todos_created) == (2, 1, 1)
            assert result.rejected_errors[0].startswith("derived_key_conflict:")
            assert result.reused == ()  # rejected, not "stored under its own key"
        else:
            assert (result.new, result.rejected, result.todos_created) == (0, 0, 0)
    rows = query(
        db_url,
        "SELECT idempotency_key, status, body, todo_id IS NOT NULL FROM inbox ORDER BY id",
    )
    assert [(status, body, has_todo) for _, status, body, has_todo in rows] == [
        ("stored", b'{"n": 1}', True),
        ("stored", b'{"n": 666}', True),
        ("stored", b'{"n": 2}', True),
        ("rejected", body_b.encode(), False),
    ]
    assert rows[3][0] == f"redis:orders:{squatter}:{hashlib.sha256(body_b.encode()).hexdigest()}"
    assert scalar(db_url, "SELECT count(*) FROM todos") == 3


async def test_a_lost_entry_report_on_a_stored_id_is_a_redelivery(engine: AsyncEngine, db_url: str) -> None:
    """An entry trimmed while pending comes back without its body: nothing
    to compare, so it is the stored entry again (re-acked), not a new one."""
    async with engine.begin() as conn:
        await store(conn, batch(rec("1-0", '{"n": 1}')))
    lost = InboxRecord(
        idempotency_key="redis:orders:1-0",
        source_message_id="1-0",
        body=b"",
        payload=None,
        error="lost_before_ingest: the entry was deleted or trimmed while still pending",
        ack_ref="1-0",
        deliveries=2,
    )
    async with engine.begin() as conn:
        result = await store(conn, batch(lost))
    assert (result.new, result.redelivered, result.reused) == (0, 1, ())
    assert query(db_url, "SELECT body, status FROM inbox") == [(b'{"n": 1}', "stored")]


async def test_a_prefix_stored_message_is_told_apart_by_its_digest(engine: AsyncEngine, db_url: str) -> None:
    """Two oversize messages with the same first bytes: the second is another
    message (its digest differs), a redelivery of the first is not."""

    def oversize(tail: bytes) -> InboxRecord:
        whole = b"x" * 10_000 + tail
        return rec("1-0", None, error="too_large: 10001 bytes exceeds max_message_bytes=1024")._replace(
            body=whole[:4096], body_size=len(whole), body_sha256=hashlib.sha256(whole).digest()
        )

    async with engine.begin() as conn:
        await store(conn, batch(oversize(b"a")))
    async with engine.begin() as conn:
        same = await store(conn, batch(oversize(b"a")._replace(deliveries=2)))
        different = await store(conn, batch(oversize(b"b")))
    assert (same.redelivered, same.reused) == (1, ())
    assert [key for _, key in different.reused] == [
        f"redis:orders:1-0:{hashlib.sha256(b'x' * 10_000 + b'b').hexdigest()}"
    ]
    assert query(db_url, "SELECT length(body), body_size, status FROM inbox ORDER BY id") == [
        (4096, 10_001, "rejected"),
        (4096, 10_001, "rejected"),
    ]


async def test_a_message_kept_whole_then_as_a_prefix_is_one_message(engine: AsyncEngine, db_url: str) -> None:
    """max_message_bytes lowered between two deliveries of one entry: the
    second is a prefix with the whole message's digest, the same message."""
    whole = b"z" * 9000
    async with engine.begin() as conn:
        await store(conn, batch(rec("1-0", None, error="schema_mismatch: at /: x")._replace(body=whole)))
    prefix = rec("1-0", None, error="too_large: 9000 bytes exceeds max_message_bytes=1024")._replace(
        body=whole[:4096], body_size=9000, body_sha256=hashlib.sha256(whole).digest(), deliveries=2
    )
    async with engine.begin() as conn:
        again = await store(conn, batch(prefix))
    assert (again.redelivered, again.reused) == (1, ())
    assert scalar(db_url, "SELECT count(*) FROM inbox") == 1
