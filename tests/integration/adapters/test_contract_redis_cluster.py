"""The adapter contract (``contract.AdapterContract``) for every Redis mode
on a Redis Cluster (``cluster = true``): three masters of Valkey, started
and bootstrapped by the suite (``tests/support/cluster.py``). A list's
processing lists carry its name as their hash tag, in its slot."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis
from redis.cluster import RedisCluster

from ingest.adapters.base import PullAdapter
from ingest.adapters.redis.lists import processing_key
from ingest.embedded.valkey_cluster import ValkeyCluster
from tests.integration.adapters.contract import SOURCE, AdapterContract
from tests.support.cluster import cluster_client, owned_cluster
from tests.support.in_process import wait_until

GROUP = "switchboard"


@pytest.fixture(scope="module")
def cluster() -> Iterator[ValkeyCluster]:
    with owned_cluster(masters=3) as running:
        yield running


@pytest.fixture
def broker(cluster: ValkeyCluster) -> Iterator[RedisCluster]:
    client = cluster_client(cluster)
    client.flushall(target_nodes=RedisCluster.PRIMARIES)  # each test starts empty, as on one server
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def registered() -> tuple[tuple[str, str], ...]:
    return ()  # the pipeline registers its adapter itself


class _OnCluster(AdapterContract):
    @pytest.fixture(autouse=True)
    def _cluster(self, cluster: ValkeyCluster) -> None:
        self.cluster_url = cluster.url

    def on_cluster(self, **table: Any) -> dict[str, Any]:
        return {"url": self.cluster_url, "cluster": True, **table}


class TestStreamContractOnCluster(_OnCluster):
    backlog_figure = ("stream_length", 7)

    def adapter_table(self) -> dict[str, Any]:
        return self.on_cluster(mode="stream", group=GROUP, consumer="c1")

    async def produce(self, broker: RedisCluster, messages: list[bytes], adapter: PullAdapter | None) -> None:
        for body in messages:
            broker.xadd(SOURCE, {"body": body})

    async def unacked(self, broker: RedisCluster) -> int:
        try:
            return int(broker.xpending(SOURCE, GROUP)["pending"])
        except redis.ResponseError:  # no group yet: nothing delivered
            return 0


class TestListContractOnCluster(_OnCluster):
    native_ids = False
    backlog_figure = ("list_length", 7)

    def adapter_table(self) -> dict[str, Any]:
        return self.on_cluster(mode="list", consumer="c1")

    async def produce(self, broker: RedisCluster, messages: list[bytes], adapter: PullAdapter | None) -> None:
        for body in messages:
            broker.lpush(SOURCE, body)

    async def unacked(self, broker: RedisCluster) -> int:
        return int(broker.llen(processing_key(SOURCE, "c1", cluster=True)))


class TestPubSubContractOnCluster(_OnCluster):
    redelivers = False
    fans_out = True
    acks = False
    native_ids = False
    backlog_figure = ("subscribers", 1)

    def adapter_table(self) -> dict[str, Any]:
        return self.on_cluster(mode="pubsub", delivery="at-most-once")

    async def wait_listening(self, broker: RedisCluster) -> None:
        await wait_until(lambda: _subscribers(broker) >= 1)

    async def produce(self, broker: RedisCluster, messages: list[bytes], adapter: PullAdapter | None) -> None:
        if adapter is not None:
            await adapter.read(1)  # subscribes; nothing published yet
            await self.wait_listening(broker)
        for body in messages:
            broker.publish(SOURCE, body)

    async def unacked(self, broker: RedisCluster) -> int:
        return 0


def _subscribers(broker: RedisCluster) -> int:
    """Subscribers of SOURCE on any node (classic pub/sub: a subscriber sits
    on one node, and a publish reaches every node)."""
    counts: Any = broker.pubsub_numsub(SOURCE, target_nodes=RedisCluster.ALL_NODES)
    per_node = counts.values() if isinstance(counts, dict) else [counts]
    return sum(int(n) for pairs in per_node for _, n in pairs)
