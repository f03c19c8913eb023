"""Reliable lists against real Redis and PostgreSQL: body-hash keys, copies,
own recovery and the reaper."""

from __future__ import annotations

import hashlib
import json

import redis
from structlog.testing import capture_logs

from backhalf.db import DatabaseSettings, create_engine
from backhalf.records import AckClaim
from ingest.adapters.redis.lists import ListAcknowledger, ListAdapter, processing_key, removed_marker
from ingest.processes.pull.poll import ledger_for
from tests.support.cluster import cluster_client, owned_cluster
from tests.support.db import query, scalar
from tests.support.in_process import JOBS, list_adapter, pipeline, settings, wait_until


async def test_list_items_become_todos_keyed_by_body_hash_and_leave_both_lists(
    db_url: str, redis_url: str, r: redis.Redis
) -> None:
    bodies = [json.dumps({"job": i}).encode() for i in range(120)]
    r.lpush(JOBS, *bodies)
    async with pipeline(settings(db_url, redis_url, list_adapter(batch_size=25))):
        await wait_until(
            lambda: scalar(db_url, "SELECT count(*) FROM inbox WHERE ack_state = 'acked'") == 120
        )
        await wait_until(lambda: r.llen(processing_key(JOBS, "c1")) == 0)
    assert r.llen(JOBS) == 0
    keys = {k for (k,) in query(db_url, "SELECT idempotency_key FROM todos")}
    assert keys == {f"redis:{JOBS}:{hashlib.sha256(b).hexdigest()}" for b in bodies}
    assert query(db_url, "SELECT DISTINCT source_message_id, ack_kind FROM inbox") == [(None, "lrem")]


async def test_three_copies_before_the_acker_runs_make_one_todo_and_all_leave(
    db_url: str, redis_url: str, r: redis.Redis
) -> None:
    body = b'{"job": "same"}'
    r.lpush(JOBS, body, body, body)
    s = settings(db_url, redis_url, list_adapter(batch_size=10))
    async with pipeline(s, acker=False):
        await wait_until(lambda: scalar(db_url, "SELECT coalesce(sum(ack_copies), 0) FROM inbox") == 3)
    assert r.llen(processing_key(JOBS, "c1")) == 3  # nothing removed before the acker
    assert query(db_url, "SELECT ack_copies, ack_state FROM inbox") == [(3, "pending")]
    assert scalar(db_url, "SELECT count(*) FROM todos") == 1
    async with pipeline(s):
        await wait_until(lambda: scalar(db_url, "SELECT count(*) FROM inbox WHERE ack_state = 'acked'") == 1)
    assert r.llen(processing_key(JOBS, "c1")) == 0
    assert r.llen(JOBS) == 0


async def test_own_recovery_redelivers_only_unstored_copies(
    db_url: str, redis_url: str, r: redis.Redis
) -> None:
    stored, unstored = b'{"job": "stored"}', b'{"job": "lost-in-flight"}'
    r.lpush(JOBS, stored)
    s = settings(db_url, redis_url, list_adapter())
    async with pipeline(s, acker=False):
        await wait_until(lambda: scalar(db_url, "SELECT count(*) FROM todos") == 1)
    # A consumer that moved an item and died before storing it.
    r.lpush(JOBS, unstored)
    r.lmove(JOBS, processing_key(JOBS, "c1"), "RIGHT", "LEFT")
    engine = create_engine(DatabaseSettings(url=db_url))
    adapter = ListAdapter(s.adapters[0])
    try:
        recovered = await adapter.recover(ledger_for(engine, JOBS))
        assert [(d.body, d.ack_copies, d.ack_key) for d in recovered] == [
            (unstored, 1, processing_key(JOBS, "c1"))
        ]
    finally:
        await adapter.close()
        await engine.dispose()
    async with pipeline(s):
        await wait_until(lambda: scalar(db_url, "SELECT count(*) FROM inbox WHERE ack_state = 'acked'") == 2)
    assert scalar(db_url, "SELECT count(*) FROM todos") == 2
    assert r.llen(processing_key(JOBS, "c1")) == 0


async def test_reaper_takes_a_dead_consumers_list_never_a_live_ones(
    db_url: str, redis_url: str, r: redis.Redis
) -> None:
    for consumer in ("dead", "alive"):
        r.lpush(processing_key(JOBS, consumer), json.dumps({"owner": consumer}))
        r.sadd(f"{JOBS}:consumers", consumer)
    r.set(f"{JOBS}:heartbeat:alive", "x", px=60_000)
    s = settings(db_url, redis_url, list_adapter(reap_interval_ms=100))
    async with pipeline(s):
        await wait_until(lambda: scalar(db_url, "SELECT count(*) FROM inbox WHERE ack_state = 'acked'") == 1)
        await wait_until(lambda: r.llen(processing_key(JOBS, "dead")) == 0)
        # Forgotten at the next reap that finds its list empty.
        await wait_until(lambda: not r.sismember(f"{JOBS}:consumers", "dead"))
        assert r.lrange(processing_key(JOBS, "alive"), 0, -1) == [b'{"owner": "alive"}']
    assert query(db_url, "SELECT payload FROM todos") == [({"owner": "dead"},)]
    assert r.lrange(processing_key(JOBS, "alive"), 0, -1) == [b'{"owner": "alive"}']
    assert r.sismember(f"{JOBS}:consumers", "alive")


async def test_lrem_goes_only_to_the_adapters_processing_lists(
    db_url: str, redis_url: str, r: redis.Redis
) -> None:
    """Issue 43: an intent's list is a row's data, which any login that may
    write the row can point elsewhere. Any consumer's processing list of the
    source is the adapter's; another application's list, another source's
    processing list, or the Cluster form of the name on an adapter without
    ``cluster`` is not: no LREM there and no marker written, none deleted
    after the commit, and none of them returned as refused (they would stay
    owed forever). One error line names them."""
    body = b'{"job": 1}'
    mine, other_consumer = processing_key(JOBS, "c1"), processing_key(JOBS, "c2")
    foreign = ["other", processing_key("payments", "c1"), processing_key(JOBS, "c1", cluster=True)]
    for key in [mine, other_consumer, *foreign]:
        r.lpush(key, body)
    r.set(removed_marker("other", 3), b"theirs")  # another application's key, named like a marker
    claims = [
        AckClaim(1, JOBS, "lrem", mine, None, None, 1, body),
        AckClaim(2, JOBS, "lrem", other_consumer, None, None, 1, body),
        *[AckClaim(3 + i, JOBS, "lrem", key, None, None, 1, body) for i, key in enumerate(foreign)],
        AckClaim(6, JOBS, "xack", mine, "switchboard", "1-0", 1, None),  # not this mode's kind
    ]
    acker = ListAcknowledger(settings(db_url, redis_url, list_adapter()).adapters[0])
    try:
        with capture_logs() as logs:
            refused = await acker.ack(claims)
        markers = {c.inbox_id: r.get(removed_marker(c.key or "", c.inbox_id)) for c in claims}
        await acker.acked(claims)
    finally:
        await acker.close()
    assert refused == []
    assert (r.llen(mine), r.llen(other_consumer)) == (0, 0)
    assert [r.lrange(key, 0, -1) for key in foreign] == [[body]] * 3
    assert markers == {1: b"1", 2: b"1", 3: b"theirs", 4: None, 5: None, 6: None}
    assert r.get(removed_marker("other", 3)) == b"theirs"
    assert not r.exists(removed_marker(mine, 1), removed_marker(other_consumer, 2))
    (line,) = [e for e in logs if e["event"] == "ack_target_refused"]
    assert (line["log_level"], line["adapter"], line["inbox_ids"]) == ("error", JOBS, [3, 4, 5, 6])
    assert line["targets"] == sorted([*(f"lrem {key}" for key in foreign), f"xack {mine}"])


async def test_a_cluster_adapter_acks_its_hash_tagged_lists_only(db_url: str) -> None:
    """With ``cluster = true`` the processing lists are ``{jobs}:processing:*``,
    all in the list's slot; the plain form is another key, in another slot."""
    body = b'{"job": 2}'
    tagged, plain = processing_key(JOBS, "c1", cluster=True), processing_key(JOBS, "c1")
    with owned_cluster(masters=1) as cluster:
        broker = cluster_client(cluster)
        try:
            broker.lpush(tagged, body)
            broker.lpush(plain, body)
            table = list_adapter(url=cluster.url, cluster=True)
            acker = ListAcknowledger(settings(db_url, "redis://127.0.0.1:1/0", table).adapters[0])
            try:
                claims = [
                    AckClaim(1, JOBS, "lrem", tagged, None, None, 1, body),
                    AckClaim(2, JOBS, "lrem", plain, None, None, 1, body),
                ]
                assert await acker.ack(claims) == []
            finally:
                await acker.close()
            assert (broker.llen(tagged), broker.lrange(plain, 0, -1)) == (0, [body])
        finally:
            broker.close()
