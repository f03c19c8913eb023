"""A list named with a hash tag of its own (``{jobs}``, ``queue:{jobs}:in``)
on a real Redis Cluster (three masters of Valkey, ``tests/support/cluster.py``):
the whole pipeline stores its messages, the acker removes them from the
processing list (the guarded LREM, a script over the list and its
removed-marker), and the reaper takes back a dead consumer's processing
list; every key the adapter and the acker touched, by the cluster's own
CLUSTER KEYSLOT, is in the source's slot (DESIGN.md 6b). The untagged name
runs beside them, as before."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from redis.cluster import RedisCluster

from backhalf.db import DatabaseSettings, create_engine
from ingest.adapters.redis.common import _Cluster
from ingest.adapters.redis.lists import ListAdapter, key_base, processing_key
from ingest.embedded.valkey_cluster import ValkeyCluster
from ingest.processes.pull.poll import ledger_for
from tests.support.cluster import cluster_client, owned_cluster
from tests.support.db import query, scalar
from tests.support.in_process import JOBS, list_adapter, pipeline, settings, wait_until


@pytest.fixture(scope="module")
def cluster() -> Iterator[ValkeyCluster]:
    with owned_cluster(masters=3) as running:
        yield running


@pytest.fixture
def broker(cluster: ValkeyCluster) -> Iterator[RedisCluster]:
    client = cluster_client(cluster)
    client.flushall(target_nodes=RedisCluster.PRIMARIES)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def touched(monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """Every key the process's cluster clients (the adapters' and the
    acker's, never the test's own) route a command by: redis-py asks
    ``keyslot`` of each key of each command, in a pipeline or a script too."""
    keys: set[str] = set()
    keyslot = _Cluster.keyslot

    def recording(self: _Cluster, key: Any) -> int:
        keys.add(key.decode() if isinstance(key, bytes) else str(key))
        return keyslot(self, key)

    monkeypatch.setattr(_Cluster, "keyslot", recording)
    return keys


@pytest.mark.parametrize(
    ("source", "dead_list", "c1_list"),
    [
        ("{jobs}", "{jobs}:processing:dead", "{jobs}:processing:c1"),
        ("queue:{jobs}:in", "queue:{jobs}:in:processing:dead", "queue:{jobs}:in:processing:c1"),
        ("jobs", "{jobs}:processing:dead", "{jobs}:processing:c1"),  # the name wrapped, as before
    ],
)
async def test_a_hash_tagged_list_stores_acks_and_reaps_in_its_own_slot(
    db_url: str,
    cluster: ValkeyCluster,
    broker: RedisCluster,
    touched: set[str],
    source: str,
    dead_list: str,
    c1_list: str,
) -> None:
    assert (processing_key(source, "dead", cluster=True), processing_key(source, "c1", cluster=True)) == (
        dead_list,
        c1_list,
    )
    table = list_adapter(source=source, url=cluster.url, cluster=True, batch_size=5, reap_interval_ms=100)
    s = settings(db_url, "redis://127.0.0.1:1/0", table)
    abandoned = [json.dumps({"abandoned": i}).encode() for i in range(3)]
    fresh = [json.dumps({"job": i}).encode() for i in range(12)]

    # A consumer that moved three items onto its processing list and died
    # before it stored them: its heartbeat lapses.
    broker.lpush(source, *abandoned)
    engine = create_engine(DatabaseSettings(url=db_url))
    dead = ListAdapter(settings(db_url, "redis://127.0.0.1:1/0", {**table, "consumer": "dead"}).adapters[0])
    try:
        assert await dead.recover(ledger_for(engine, JOBS)) == []  # its start-up: nothing of its own
        assert len(await dead.read(3)) == 3
    finally:
        await dead.close()
        await engine.dispose()
    assert broker.llen(dead_list) == 3
    broker.delete(f"{key_base(source, cluster=True)}:heartbeat:dead")

    broker.lpush(source, *fresh)
    async with pipeline(s):
        await wait_until(lambda: scalar(db_url, "SELECT count(*) FROM inbox WHERE ack_state = 'acked'") == 15)
        await wait_until(lambda: broker.llen(dead_list) == 0 and broker.llen(c1_list) == 0)
        await wait_until(lambda: not broker.sismember(f"{key_base(source, cluster=True)}:consumers", "dead"))

    assert broker.llen(source) == 0
    assert scalar(db_url, "SELECT count(*) FROM todos") == 15
    by_list = dict(query(db_url, "SELECT ack_key, count(*) FROM inbox GROUP BY ack_key"))
    assert by_list == {dead_list: 3, c1_list: 12}

    # Every kind of key the list mode builds was used (and seen here), and
    # the cluster puts each one in the source's slot.
    base = key_base(source, cluster=True)
    kinds = {
        "source": source in touched,
        "processing list": c1_list in touched,
        "reaped list": dead_list in touched,
        "consumers": f"{base}:consumers" in touched,
        "heartbeat": f"{base}:heartbeat:c1" in touched,
        "recovery lock": f"{base}:recovering:{dead_list}" in touched,
        "removed-marker": any(k.startswith(f"{c1_list}:removed:") for k in touched),
    }
    assert all(kinds.values()), kinds
    slot = broker.cluster_keyslot(source)
    slots = {k: broker.cluster_keyslot(k) for k in touched}
    assert {k: n for k, n in slots.items() if n != slot} == {}
