"""The Redis stream adapter against a real server: group creation and its
recorded start, the own-PEL re-read, the claim sweep of a dead consumer's
entries, NOGROUP, deleted entries."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence

import pytest
import redis
from sqlalchemy.ext.asyncio import AsyncEngine
from structlog.testing import capture_logs

from backhalf.errors import StoreError
from backhalf.records import AckClaim, AckTarget, InboxRecord, Provenance, StoreBatch
from backhalf.writes.normalize import FieldMap
from backhalf.writes.store import store
from backhalf.writes.stream_groups import GroupStartLedger, StreamGroup
from ingest.adapters.redis.streams import StreamAcknowledger, StreamAdapter
from ingest.config import AdapterConfig, from_mapping
from ingest.errors import AckError, BrokerError, GroupMissing
from ingest.processes.ack.acker import drain_adapter
from ingest.processes.intake import to_record
from tests.support.acl import acl_rules
from tests.support.db import query
from tests.support.servers import as_redis_user

STREAM, GROUP = "orders", "switchboard"


def _recorded(db_url: str) -> list[tuple[str, ...]]:
    return [
        tuple(row)
        for row in query(
            db_url,
            "SELECT adapter, broker, stream, group_name, start_id FROM stream_groups ORDER BY created_at",
        )
    ]


class _FailingOnce:
    """A ledger whose first record fails, as a database away for a moment would."""

    def __init__(self, ledger: GroupStartLedger) -> None:
        self._ledger, self._failed = ledger, False

    async def recorded(self, group: StreamGroup, *, adapter: str) -> str | None:
        return await self._ledger.recorded(group, adapter=adapter)

    async def stored_before(self, adapter: str) -> bool:
        return await self._ledger.stored_before(adapter)

    async def record(self, group: StreamGroup, start_id: str, *, adapter: str) -> str:
        if not self._failed:
            self._failed = True
            raise StoreError(f"adapter {adapter}: recording start {start_id}: the database is away")
        return await self._ledger.record(group, start_id, adapter=adapter)

    async def acks_owed(self, adapter: str, keys: Sequence[str]) -> set[str]:
        return await self._ledger.acks_owed(adapter, keys)

    async def settle_acks(self, adapter: str, consumer: str, session: str) -> int:
        return await self._ledger.settle_acks(adapter, consumer, session)


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
def ledger(engine: AsyncEngine) -> GroupStartLedger:
    return GroupStartLedger(engine, deadline_ms=10_000)


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
    assert d.ack_ref == d.message_id


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
    assert sorted((d.message_id for d in claimed), key=str) == ids  # key: message_id is str | None
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
    assert isinstance(d.body, FieldMap)
    assert d.body == {b"order": b"7", b"sku": b"A"}


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
    wrong_type = StreamAcknowledger(cfg(source="not-a-stream"))
    try:
        await acker.ack([AckClaim(1, "orders", "xack", STREAM, GROUP, entry, 1, None)])
        with pytest.raises(AckError) as info:
            await wrong_type.ack([AckClaim(2, "orders", "xack", "not-a-stream", GROUP, entry, 1, None)])
    finally:
        await acker.close()
        await wrong_type.close()
    assert "XACK not-a-stream switchboard (1 ids)" in str(info.value)
    assert isinstance(info.value.__cause__, redis.ResponseError)


async def test_acks_go_only_to_the_adapters_own_stream_and_group(cfg, r, adapters) -> None:  # type: ignore[no-untyped-def]
    """Issue 43: an intent's target is a row's data, which any login that may
    write the row can point elsewhere. Intents naming another group of the
    stream, another stream, or no entry id are not XACKed, and not returned
    as refused (they would stay owed forever): the other groups' PELs keep
    their entries, one error line names them, and the adapter's own intent
    in the same batch is acked."""
    mine = r.xadd(STREAM, {"body": b"{}"}).decode()
    a = StreamAdapter(cfg())
    adapters.append(a)
    await a.read(10)
    # Another application's group on the same stream, holding the same entry,
    # and another stream whose group has the adapter's group's name.
    r.xgroup_create(STREAM, "billing", id="0")
    r.xreadgroup("billing", "b1", {STREAM: ">"})
    theirs = r.xadd("payments", {"body": b"{}"}).decode()
    r.xgroup_create("payments", GROUP, id="0")
    r.xreadgroup(GROUP, "p1", {"payments": ">"})
    claims = [
        AckClaim(1, "orders", "xack", STREAM, GROUP, mine, 1, None),
        AckClaim(2, "orders", "xack", STREAM, "billing", mine, 1, None),
        AckClaim(3, "orders", "xack", "payments", GROUP, theirs, 1, None),
        AckClaim(4, "orders", "xack", STREAM, GROUP, "not-an-id", 1, None),
        AckClaim(5, "orders", "lrem", STREAM, GROUP, mine, 1, b"{}"),  # not this mode's kind
    ]
    acker = StreamAcknowledger(cfg())
    try:
        with capture_logs() as logs:
            refused = await acker.ack(claims)
        await acker.acked(claims)
    finally:
        await acker.close()
    assert refused == []
    assert r.xpending(STREAM, GROUP)["pending"] == 0  # the adapter's own: acked
    assert [p["message_id"].decode() for p in r.xpending_range(STREAM, "billing", "-", "+", 10)] == [mine]
    assert [p["message_id"].decode() for p in r.xpending_range("payments", GROUP, "-", "+", 10)] == [theirs]
    (line,) = [e for e in logs if e["event"] == "ack_target_refused"]
    assert (line["log_level"], line["adapter"], line["inbox_ids"]) == ("error", "orders", [2, 3, 4, 5])
    assert line["targets"] == [
        f"lrem {STREAM} {GROUP} {mine}",
        f"xack {STREAM} billing {mine}",
        f"xack {STREAM} {GROUP} not-an-id",
        f"xack payments {GROUP} {theirs}",
    ]


async def test_after_a_group_is_renamed_the_old_groups_intents_are_not_acked(cfg, r, adapters) -> None:  # type: ignore[no-untyped-def]
    """The config names one group: an intent stored under the name it had
    before is refused like any other group's (its entry stays in the old
    group's PEL, which nothing reads any more)."""
    entry = r.xadd(STREAM, {"body": b"{}"}).decode()
    old = StreamAdapter(cfg())
    adapters.append(old)
    await old.read(10)
    renamed = StreamAcknowledger(cfg(group="switchboard-v2"))
    try:
        assert await renamed.ack([AckClaim(1, "orders", "xack", STREAM, GROUP, entry, 1, None)]) == []
    finally:
        await renamed.close()
    assert r.xpending(STREAM, GROUP)["pending"] == 1


async def test_a_repointed_row_is_marked_acked_without_an_xack_and_costs_nothing_again(  # type: ignore[no-untyped-def]
    cfg, r, adapters, engine, db_url
) -> None:
    """The finding itself (issue 43): a stored row's ack_group pointed at
    another application's group of the same stream. The acker's drain
    leaves that group's PEL alone, raises nothing (no AcksRefused: the row
    is not owed), marks the row acked, and the next drain finds nothing."""
    entry = r.xadd(STREAM, {"body": b'{"n": 1}'}).decode()
    r.xgroup_create(STREAM, "billing", id="0")
    r.xreadgroup("billing", "b1", {STREAM: ">"})
    config = cfg()
    a = StreamAdapter(config)
    adapters.append(a)
    deliveries = await a.read(10)
    batch = StoreBatch(
        "orders",
        config.queue,
        config.consumer,
        "store",
        a.ack_target,
        Provenance("queue", "queue", False, a.identity),
        [to_record(d, config) for d in deliveries],
    )
    async with engine.begin() as conn:
        await store(conn, batch)
    query(db_url, "UPDATE inbox SET ack_group = 'billing' RETURNING id")
    acker = StreamAcknowledger(config)
    try:
        with capture_logs() as logs:
            assert await drain_adapter(engine, "orders", acker, limit=100) == 1
            assert await drain_adapter(engine, "orders", acker, limit=100) == 0
    finally:
        await acker.close()
    assert query(db_url, "SELECT ack_state FROM inbox") == [("acked",)]
    assert [p["message_id"].decode() for p in r.xpending_range(STREAM, "billing", "-", "+", 10)] == [entry]
    assert [e["inbox_ids"] for e in logs if e["event"] == "ack_target_refused"] == [
        [i for (i,) in query(db_url, "SELECT id FROM inbox")]
    ]
    assert [e for e in logs if e["event"] == "acks_refused"] == []


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


async def test_group_recreated_after_noledger_at_its_recorded_start(cfg, r, adapters, ledger) -> None:  # type: ignore[no-untyped-def]
    a = StreamAdapter(cfg(start_id="$"), ledger=ledger)
    adapters.append(a)
    await a.read(10)  # no stream yet: created empty, its start recorded as 0-0
    r.delete(STREAM)
    added_meanwhile = r.xadd(STREAM, {"body": b"{}"}).decode()
    with pytest.raises(GroupMissing):
        await a.read(10)
    # Recreated at the record, not at "$" (which would now skip the entry).
    assert [d.message_id for d in await a.read(10)] == [added_meanwhile]


async def test_dollar_start_is_recorded_as_an_entry_id_and_a_destroyed_group_recreated_there(  # type: ignore[no-untyped-def]
    cfg, r, adapters, ledger, db_url
) -> None:
    backlog = [r.xadd(STREAM, {"body": b"{}"}).decode() for _ in range(3)]
    a = StreamAdapter(cfg(start_id="$"), ledger=ledger)
    adapters.append(a)
    assert await a.read(10) == []  # the backlog is excluded
    assert _recorded(db_url) == [("orders", a.broker, STREAM, GROUP, backlog[-1])]
    after = [r.xadd(STREAM, {"body": b"{}"}).decode() for _ in range(2)]
    assert [d.message_id for d in await a.read(10)] == after
    r.xgroup_destroy(STREAM, GROUP)
    with pytest.raises(GroupMissing):
        await a.read(10)
    later = r.xadd(STREAM, {"body": b"{}"}).decode()
    a.rewind()  # as the poll loop does after the failed read
    assert [d.message_id for d in await a.read(10)] == [*after, later]
    assert _recorded(db_url)[0][4] == backlog[-1]  # the recreation recorded nothing new


async def test_a_missing_group_on_record_is_created_at_the_record_at_start_up(  # type: ignore[no-untyped-def]
    cfg, r, adapters, ledger, db_url
) -> None:
    ids = [r.xadd(STREAM, {"body": b"{}"}).decode() for _ in range(4)]
    first = StreamAdapter(cfg(start_id="$"), ledger=ledger)
    adapters.append(first)
    await first.read(10)
    r.xgroup_destroy(STREAM, GROUP)  # while no ingester runs
    more = r.xadd(STREAM, {"body": b"{}"}).decode()
    # A new process, whose config now says "0": the record wins over both.
    restarted = StreamAdapter(cfg(start_id="0"), ledger=ledger)
    adapters.append(restarted)
    assert [d.message_id for d in await restarted.read(10)] == [more]
    assert _recorded(db_url)[0][4] == ids[-1]


async def test_the_first_record_wins_over_a_second_consumer_and_a_changed_config(  # type: ignore[no-untyped-def]
    cfg, r, adapters, ledger, db_url
) -> None:
    first_id = r.xadd(STREAM, {"body": b"{}"}).decode()
    a = StreamAdapter(cfg(start_id="$", consumer="a"), ledger=ledger)
    adapters.append(a)
    await a.read(10)
    r.xadd(STREAM, {"body": b"{}"})
    b = StreamAdapter(cfg(start_id="$", consumer="b"), ledger=ledger)
    adapters.append(b)
    await b.read(10)
    assert [row[4] for row in _recorded(db_url)] == [first_id]


async def test_a_group_created_by_someone_else_is_not_recorded_and_recreated_at_0(  # type: ignore[no-untyped-def]
    cfg, r, adapters, ledger, db_url, caplog
) -> None:
    """Where such a group started is unknown: recreated at the stream's start,
    so nothing written since the destroy is lost (what the inbox holds is
    deduplicated there), whatever the configured start_id says."""
    early = r.xadd(STREAM, {"body": b"{}"}).decode()
    r.xgroup_create(STREAM, GROUP, id="0")  # not Switchboard: nothing on record
    a = StreamAdapter(cfg(start_id="$"), ledger=ledger)
    adapters.append(a)
    assert [d.message_id for d in await a.read(10)] == [early]
    assert [row[4] for row in _recorded(db_url)] == ["0-0"]  # unknown: recorded at the stream's start
    r.xgroup_destroy(STREAM, GROUP)
    with pytest.raises(GroupMissing):
        await a.read(10)
    later = r.xadd(STREAM, {"body": b"{}"}).decode()
    assert [d.message_id for d in await a.read(10)] == [early, later]  # not the configured "$"
    assert [row[4] for row in _recorded(db_url)] == ["0-0"]


async def test_a_group_destroyed_before_anything_recorded_its_start_loses_nothing(  # type: ignore[no-untyped-def]
    cfg, r, adapters, ledger, engine, db_url
) -> None:
    """A deployment upgraded from before the stream_groups table whose group
    was destroyed while it was stopped: nothing on record and no group, but
    the inbox holds its entries, so the group existed. Recreated at 0, not at
    the configured "$", which would skip what was written meanwhile."""
    stored = InboxRecord("redis:orders:1-0", "1-0", b"{}", "{}", ack_ref="1-0")
    ack = AckTarget("xack", STREAM, GROUP, by_cursor=True)
    pulled = Provenance("queue", "queue", False, None)
    async with engine.begin() as conn:
        await store(conn, StoreBatch("orders", "orders", "c1", "store", ack, pulled, [stored]))
    written = r.xadd(STREAM, {"body": b"{}"}).decode()  # while it was stopped
    a = StreamAdapter(cfg(start_id="$"), ledger=ledger)
    adapters.append(a)
    assert [d.message_id for d in await a.read(10)] == [written]
    assert [row[4] for row in _recorded(db_url)] == ["0-0"]


async def test_a_failed_record_creates_no_group_and_is_retried(cfg, r, adapters, ledger) -> None:  # type: ignore[no-untyped-def]
    r.xadd(STREAM, {"body": b"{}"})
    failing = _FailingOnce(ledger)
    a = StreamAdapter(cfg(start_id="$"), ledger=failing)
    adapters.append(a)
    with pytest.raises(StoreError, match="adapter orders: recording"):
        await a.read(10)
    # Recorded before created: the failure left no group without a record.
    assert r.xinfo_groups(STREAM) == []
    assert await a.read(10) == []
    assert [g["name"] for g in r.xinfo_groups(STREAM)] == [GROUP.encode()]


async def test_dollar_start_works_under_the_least_privilege_acl_user(  # type: ignore[no-untyped-def]
    cfg, r, adapters, ledger, redis_url
) -> None:
    r.execute_command("ACL", "SETUSER", "least", *acl_rules("switchboard-stream", "pw"))
    try:
        r.xadd(STREAM, {"body": b"{}"})
        a = StreamAdapter(cfg(start_id="$", url=as_redis_user(redis_url, "least", "pw")),
                          ledger=ledger)  # fmt: skip
        adapters.append(a)
        assert await a.read(10) == []  # XINFO STREAM resolved "$"
        later = r.xadd(STREAM, {"body": b"{}"}).decode()
        assert [d.message_id for d in await a.read(10)] == [later]
    finally:
        r.acl_deluser("least")
