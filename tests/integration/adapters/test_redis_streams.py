"""The Redis stream adapter against a real server: group creation, the own-PEL
re-read, the claim sweep of a dead consumer's entries, NOGROUP, deleted entries."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import pytest
import redis

from backhalf.records import AckClaim
from ingest.adapters.redis.streams import StreamAcknowledger, StreamAdapter
from ingest.config import AdapterConfig, from_mapping
from ingest.errors import AckError, BrokerError, GroupMissing

STREAM, GROUP = "orders", "switchboard"


@pytest.fixture
def cfg(redis_url: str) -> Callable[..., AdapterConfig]:
    def make(**kw: object) -> AdapterConfig:
        raw = {"name": "orders", "source": STREAM, "group": GROUP, "consumer": "c1", "block_ms": 50, **kw}
        return from_mapping(
            {"database": {"url": "postgresql://x@y/z"}, "adapters": [raw]},
            {"SWITCHBOARD_REDIS_URL": redis_url},
        ).adapters[0]

    return make


@pytest.fixture
async def adapters() -> AsyncIterator[list[StreamAdapter]]:
    made: list[StreamAdapter] = []
    yield made
    for a in made:
        await a.close()


async def test_group_is_created_with_mkstream_at_start_id_zero(cfg, r, adapters) -> None:  # type: ignore[no-untyped-def]
    r.xadd(STREAM, {"body": b'{"early": true}'})  # written before the first start
    a = StreamAdapter(cfg())
    adapters.append(a)
    deliveries = await a.read(10)
    assert [d.body for d in deliveries] == [b'{"early": true}']
    assert [g["name"] for g in r.xinfo_groups(STREAM)] == [GROUP.encode()]
    assert a.identity == "redis acl: default"
    d = deliveries[0]
    assert d.idempotency_key == f"redis:{STREAM}:{d.message_id}"
    assert d.ack_entry_id == d.message_id


async def test_missing_stream_is_created_empty(cfg, r, adapters) -> None:  # type: ignore[no-untyped-def]
    a = StreamAdapter(cfg())
    adapters.append(a)
    assert await a.read(10) == []
    assert r.exists(STREAM) == 1


async def test_restart_rereads_own_pel_before_new_entries(cfg, r, adapters) -> None:  # type: ignore[no-untyped-def]
    ids = [r.xadd(STREAM, {"body": f'{{"n": {i}}}'.encode()}).decode() for i in range(5)]
    first = StreamAdapter(cfg())
    adapters.append(first)
    assert [d.message_id for d in await first.read(3)] == ids[:3]  # delivered, never acked
    restarted = StreamAdapter(cfg())  # same consumer name, a new process
    adapters.append(restarted)
    assert [d.message_id for d in await restarted.read(2)] == ids[:2]
    assert [d.message_id for d in await restarted.read(2)] == ids[2:3]
    assert [d.message_id for d in await restarted.read(10)] == ids[3:]
    assert r.xpending(STREAM, GROUP)["pending"] == 5


async def test_rewind_redelivers_what_was_not_stored(cfg, r, adapters) -> None:  # type: ignore[no-untyped-def]
    ids = [r.xadd(STREAM, {"body": b"{}"}).decode() for _ in range(3)]
    a = StreamAdapter(cfg())
    adapters.append(a)
    assert [d.message_id for d in await a.read(10)] == ids
    a.rewind()
    assert [d.message_id for d in await a.read(10)] == ids


async def test_idle_entries_of_a_dead_consumer_are_claimed(cfg, r, adapters) -> None:  # type: ignore[no-untyped-def]
    ids = [r.xadd(STREAM, {"body": b"{}"}).decode() for _ in range(3)]
    dead = StreamAdapter(cfg(consumer="dead"))
    adapters.append(dead)
    await dead.read(10)
    live = StreamAdapter(cfg(consumer="live", claim_idle_ms=1))
    adapters.append(live)
    claimed = await live.read(10)
    assert sorted(d.message_id for d in claimed) == ids
    owners = {c["name"]: c["pending"] for c in r.xinfo_consumers(STREAM, GROUP)}
    assert owners[b"live"] == 3
    assert owners[b"dead"] == 0


async def test_deleted_pending_entry_is_reported_lost_not_dropped(cfg, r, adapters) -> None:  # type: ignore[no-untyped-def]
    keep, gone = (r.xadd(STREAM, {"body": b"{}"}).decode() for _ in range(2))
    a = StreamAdapter(cfg())
    adapters.append(a)
    await a.read(10)
    r.xdel(STREAM, gone)
    a.rewind()  # the history re-read returns the deleted entry without fields
    history = {d.message_id: d.lost for d in await a.read(10)}
    assert history == {keep: False, gone: True}
    # The claim sweep finds it deleted too, and delivers it as lost.
    other = StreamAdapter(cfg(consumer="other", claim_idle_ms=1))
    adapters.append(other)
    claimed = {d.message_id: d.lost for d in await other.read(10)}
    assert claimed == {keep: False, gone: True}


async def test_entry_without_body_field_is_its_field_map(cfg, r, adapters) -> None:  # type: ignore[no-untyped-def]
    r.xadd(STREAM, {"order": "7", "sku": "A"})
    a = StreamAdapter(cfg())
    adapters.append(a)
    (d,) = await a.read(10)
    assert d.body is None
    assert d.fields == {b"order": b"7", b"sku": b"A"}


async def test_deleted_group_raises_group_missing_then_recovers(cfg, r, adapters) -> None:  # type: ignore[no-untyped-def]
    a = StreamAdapter(cfg())
    adapters.append(a)
    await a.read(10)
    r.xgroup_destroy(STREAM, GROUP)
    with pytest.raises(GroupMissing):
        await a.read(10)
    r.xadd(STREAM, {"body": b"{}"})
    assert len(await a.read(10)) == 1  # group recreated at start_id 0


async def test_unreachable_redis_is_a_broker_error(cfg, adapters) -> None:  # type: ignore[no-untyped-def]
    a = StreamAdapter(cfg(url="redis://127.0.0.1:1/0"))
    adapters.append(a)
    with pytest.raises(BrokerError) as info:
        await a.read(10)
    assert isinstance(info.value.__cause__, redis.RedisError)


async def test_acknowledger_xacks_per_stream_and_group(cfg, r, adapters) -> None:  # type: ignore[no-untyped-def]
    ids = [r.xadd(STREAM, {"body": b"{}"}).decode() for _ in range(4)]
    a = StreamAdapter(cfg())
    adapters.append(a)
    await a.read(10)
    acker = StreamAcknowledger(cfg())
    try:
        claims = [AckClaim(n, "orders", "xack", STREAM, GROUP, i, 1, None) for n, i in enumerate(ids[:3])]
        await acker.ack(claims)
        await acker.ack(claims)  # idempotent
    finally:
        await acker.close()
    assert r.xpending(STREAM, GROUP)["pending"] == 1


async def test_ack_on_a_vanished_group_passes_another_error_fails(cfg, r, adapters) -> None:  # type: ignore[no-untyped-def]
    """No group, no PEL: nothing is left to acknowledge, and the ack passes
    (Valkey answers 0; a NOGROUP reply would be tolerated the same way). Any
    other error reply fails the ack with AckError, the reply as its cause."""
    entry = r.xadd(STREAM, {"body": b"{}"}).decode()
    a = StreamAdapter(cfg())
    adapters.append(a)
    await a.read(10)
    r.xgroup_destroy(STREAM, GROUP)
    r.set("not-a-stream", "x")
    acker = StreamAcknowledger(cfg())
    try:
        await acker.ack([AckClaim(1, "orders", "xack", STREAM, GROUP, entry, 1, None)])
        with pytest.raises(AckError) as info:
            await acker.ack([AckClaim(2, "orders", "xack", "not-a-stream", GROUP, entry, 1, None)])
    finally:
        await acker.close()
    assert "XACK not-a-stream switchboard (1 ids)" in str(info.value)
    assert isinstance(info.value.__cause__, redis.ResponseError)


async def test_lost_report_survives_a_failed_store(cfg, r, adapters) -> None:  # type: ignore[no-untyped-def]
    gone = r.xadd(STREAM, {"body": b"{}"}).decode()
    first = StreamAdapter(cfg(consumer="first"))
    adapters.append(first)
    await first.read(10)
    r.xdel(STREAM, gone)
    claimer = StreamAdapter(cfg(consumer="claimer", claim_idle_ms=1))
    adapters.append(claimer)
    assert [(d.message_id, d.lost) for d in await claimer.read(10)] == [(gone, True)]
    # Still in the PEL: the report is not only in this process's memory, so a
    # crash before the store cannot lose it; the XACK after the store will.
    assert r.xpending(STREAM, GROUP)["pending"] == 1
    claimer.rewind()  # the store of that batch failed
    assert [(d.message_id, d.lost) for d in await claimer.read(10)] == [(gone, True)]
    assert await claimer.read(10) == []  # stored this time: not reported again


async def test_group_recreated_after_nogroup_starts_from_zero(cfg, r, adapters) -> None:  # type: ignore[no-untyped-def]
    a = StreamAdapter(cfg(start_id="$"))
    adapters.append(a)
    await a.read(10)
    r.delete(STREAM)
    added_meanwhile = r.xadd(STREAM, {"body": b"{}"}).decode()
    with pytest.raises(GroupMissing):
        await a.read(10)
    assert [d.message_id for d in await a.read(10)] == [added_meanwhile]
