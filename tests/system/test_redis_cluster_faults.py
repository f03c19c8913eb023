"""Redis adapters on a Redis Cluster under real faults (issue 29), on Valkey
clusters each test starts itself (``tests/support/cluster.py``): kill -9
of ingesters and the acker over three streams on three masters, and over a
list whose processing lists share its slot; a master killed and its
replica promoted mid-run. Each run ends exactly once for what the cluster
kept, with every PEL and processing list empty. The chaos seed is printed
(SWITCHBOARD_TEST_SEED replays it)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from redis.cluster import RedisCluster

from ingest.adapters.redis.common import as_text
from ingest.adapters.redis.lists import processing_key
from ingest.embedded.processes import WaitTimedOut, wait_for, wait_ready
from ingest.embedded.valkey_cluster import ValkeyCluster
from tests.support.chaos import kill9_rounds, seeded
from tests.support.cluster import cluster_client, owned_cluster
from tests.support.config import stream_adapter
from tests.support.db import acked, query, scalar, unacked
from tests.support.oracle import assert_stored_once
from tests.support.processes import Processes, stop_settled

pytestmark = pytest.mark.system
PER_STREAM = 500  # twice: 3,000 entries over three streams
ROUNDS = 4


@pytest.fixture
def cluster() -> Iterator[ValkeyCluster]:
    with owned_cluster(masters=3) as running:
        yield running


def on_cluster(cluster: ValkeyCluster, adapter: dict[str, object]) -> dict[str, object]:
    return {**adapter, "url": cluster.url, "cluster": True}


def streams_on_every_master(cluster: ValkeyCluster, n: int = 3) -> list[str]:
    """Stream names, one per master (by their slots)."""
    chosen: dict[int, str] = {}
    for i in range(200):
        name = f"orders-{i}"
        chosen.setdefault(cluster.node_of(name), name)
        if len(chosen) == n:
            break
    assert len(chosen) == n, chosen
    return sorted(chosen.values())


def pel_total(client: RedisCluster, streams: list[str]) -> int:
    total = 0
    for s in streams:
        try:
            total += int(client.xpending(s, "switchboard")["pending"])
        except redis.ResponseError:  # no group yet: nothing delivered
            continue
    return total


def test_stream_chaos_over_three_masters(
    procs: Processes, make_config: Callable[..., Path], db_url: str, cluster: ValkeyCluster
) -> None:
    seed, rng = seeded()
    streams = streams_on_every_master(cluster)
    client = cluster_client(cluster)
    ids: list[str] = []

    def produce(start: int) -> None:
        for s in streams:
            for i in range(start, start + PER_STREAM):
                entry = client.xadd(s, {"body": json.dumps({"n": i, "s": s})})
                ids.append(f"redis:{s}:{as_text(entry)}")

    produce(0)
    config = make_config(*(on_cluster(cluster, stream_adapter(s, queue="orders")) for s in streams))
    try:
        slots, kills = kill9_rounds(procs, config, rng, ROUNDS, lambda: produce(PER_STREAM))

        def settled() -> bool:
            return acked(db_url) == len(ids) and pel_total(client, streams) == 0

        what = f"convergence after {kills} kills (seed {seed})"
        wait_for(settled, timeout_s=120, interval_s=0.5, what=what)
        stop_settled(slots.values(), settled, what=what)
    finally:
        client.close()
    assert_stored_once(db_url, ids, queue="orders")
    procs.assert_no_secret_logged()


def test_list_chaos_with_its_processing_lists_in_its_slot(
    procs: Processes, make_config: Callable[..., Path], db_url: str, cluster: ValkeyCluster
) -> None:
    seed, rng = seeded()
    client = cluster_client(cluster)
    sent: list[bytes] = []

    def produce(start: int, n: int = 600) -> None:
        bodies = [json.dumps({"job": i}).encode() for i in range(start, start + n)]
        client.lpush("jobs", *bodies)
        sent.extend(bodies)

    produce(0)
    adapter = {"name": "jobs", "mode": "list", "source": "jobs", "queue": "jobs", "batch_size": 50,
               "block_ms": 200, "heartbeat_ttl_ms": 2000, "reap_interval_ms": 500}  # fmt: skip
    config = make_config(on_cluster(cluster, adapter))
    processing = [processing_key("jobs", c, cluster=True) for c in ("ingester-1", "ingester-2")]
    assert {cluster.node_of(k) for k in processing} == {cluster.node_of("jobs")}
    try:
        slots, kills = kill9_rounds(procs, config, rng, ROUNDS, lambda: produce(600))

        def settled() -> bool:
            return (
                acked(db_url) > 0
                and client.llen("jobs") == 0
                and all(client.llen(k) == 0 for k in processing)
                and {k for (k,) in query(db_url, "SELECT idempotency_key FROM todos")}
                == {f"redis:jobs:{hashlib.sha256(b).hexdigest()}" for b in sent}
            )

        what = f"convergence after {kills} kills (seed {seed})"
        wait_for(settled, timeout_s=120, interval_s=0.5, what=what)
        stop_settled(slots.values(), lambda: settled() and unacked(db_url) == 0, what=what)
    finally:
        client.close()
    keys = [k for (k,) in query(db_url, "SELECT idempotency_key FROM todos")]
    assert len(keys) == len(set(keys)) == len(sent)
    assert unacked(db_url) == 0
    procs.assert_no_secret_logged()


def test_a_master_failover_mid_run_keeps_what_was_replicated(
    procs: Processes, make_config: Callable[..., Path], db_url: str
) -> None:
    """The stream's master is killed once its replica has every entry
    written so far (WAIT-like: replication offsets); the replica is
    promoted, the ingester and acker ride through (broker errors, backed
    off), and every entry the cluster kept is stored once and acked."""
    with owned_cluster(masters=3, replicas=1) as cluster:
        client = cluster_client(cluster)
        ids: list[str] = []

        def produce(start: int, n: int) -> None:
            for i in range(start, start + n):
                ids.append(f"redis:orders:{as_text(client.xadd('orders', {'body': json.dumps({'n': i})}))}")

        try:
            produce(0, 400)
            config = make_config(on_cluster(cluster, stream_adapter("orders")))
            ingester = procs.start("ingest", config, name="ingester-1")
            acker = procs.start("ack", config, name="acker-1")
            wait_ready(ingester)
            wait_ready(acker)
            wait_for(lambda: acked(db_url) >= 100, timeout_s=60, interval_s=0.1, what="the first acks")
            master = cluster.node_of("orders")
            cluster.wait_replicated(master)
            cluster.failover(master)
            client.close()
            client = cluster_client(cluster)
            produce(400, 400)

            def settled() -> bool:
                return acked(db_url) == len(ids) and pel_total(client, ["orders"]) == 0

            wait_for(settled, timeout_s=120, interval_s=0.5, what="convergence after the failover")
            assert ingester.alive()
            assert acker.alive()
            stop_settled((ingester, acker), settled, what="convergence after the failover")
        finally:
            client.close()
        assert_stored_once(db_url, ids, queue="orders")
        procs.assert_no_secret_logged()


def test_an_xack_lost_in_a_failover_comes_back_as_a_deduplicated_redelivery(
    procs: Processes, make_config: Callable[..., Path], db_url: str
) -> None:
    """Replication is asynchronous: XACKs the master took and its replica
    never received (the replica frozen with SIGSTOP while the acker acks)
    are lost when the master dies and the replica is promoted. The entries
    are pending again there (the replica is cut off from its master first:
    a frozen one still finds what was sent in its socket's buffer); the
    claim sweep delivers them again, the
    inbox deduplicates them (one todo each, ``deliveries`` 2), and the
    acker acks them once more: the PEL ends empty."""
    with owned_cluster(masters=3, replicas=1) as cluster:
        client = cluster_client(cluster)
        try:
            ids = [
                f"redis:orders:{as_text(client.xadd('orders', {'body': json.dumps({'n': i})}))}"
                for i in range(50)
            ]
            adapter = stream_adapter("orders", claim_idle_ms=1000, claim_interval_ms=300)
            config = make_config(on_cluster(cluster, adapter))
            ingester = procs.start("ingest", config, name="ingester-1")
            wait_ready(ingester)
            wait_for(lambda: pel_total(client, ["orders"]) == 50, timeout_s=60, interval_s=0.1, what="stored")
            master = cluster.node_of("orders")
            cluster.wait_replicated(master)  # the replica has the entries and their PEL
            (replica,) = cluster.replicas_of(master)
            replica_pid = cluster.node(replica).pid
            # Frozen, and cut off by its master, so nothing the master takes
            # from now on reaches it (not even through its socket's buffer).
            os.kill(replica_pid, signal.SIGSTOP)
            try:
                cluster.node(master).call("CLIENT", "KILL", "TYPE", "replica")
                acker = procs.start("ack", config, name="acker-1")
                wait_for(lambda: acked(db_url) == 50, timeout_s=60, interval_s=0.1, what="the acks")
                assert pel_total(client, ["orders"]) == 0  # on the master; the replica never heard
                cluster.kill(master)
            finally:
                os.kill(replica_pid, signal.SIGCONT)
            cluster.wait_healthy()
            client.close()
            client = cluster_client(cluster)

            def state() -> tuple[int, int, int]:
                redelivered = scalar(db_url, "SELECT count(*) FROM inbox WHERE deliveries > 1")
                return pel_total(client, ["orders"]), int(redelivered), acked(db_url)

            with contextlib.suppress(WaitTimedOut):
                wait_for(lambda: state() == (0, 50, 50), timeout_s=60, interval_s=0.5, what="redeliveries")
            assert state() == (0, 50, 50), "(PEL, rows redelivered, rows acked) after the failover"
            stop_settled((ingester, acker), lambda: state() == (0, 50, 50), what="redeliveries acked")
        finally:
            client.close()
        assert_stored_once(db_url, ids, queue="orders")
        procs.assert_no_secret_logged()
