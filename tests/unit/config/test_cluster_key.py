"""``cluster = true`` on a Redis adapter: a boolean, for the Redis modes only,
and a list whose name no derived key can share the slot of is refused (its
derived keys carry the name as their hash tag, which a lone ``}`` would
break; a name's own hash tag is kept: tests/unit/config/test_cluster_hash_tag.py)."""

from __future__ import annotations

import pytest

from ingest.adapters.redis.lists import key_base, processing_key
from ingest.config import Settings, from_mapping
from ingest.config.adapter import read_adapter
from ingest.errors import ConfigError

REDIS = "redis://127.0.0.1:6379/0"


def test_cluster_is_off_by_default_and_a_boolean() -> None:
    assert read_adapter({"name": "a", "source": "s"}, REDIS).options.cluster is False
    assert read_adapter({"name": "a", "source": "s", "cluster": True}, REDIS).options.cluster is True
    with pytest.raises(ConfigError, match=r"adapter 'a': key 'cluster': must be true or false \(got 'yes'\)"):
        read_adapter({"name": "a", "source": "s", "cluster": "yes"}, REDIS)


def test_cluster_applies_to_the_redis_modes_only() -> None:
    with pytest.raises(ConfigError, match="key 'cluster' does not apply to mode = 'jetstream'"):
        read_adapter({"name": "a", "transport": "nats", "source": "S", "cluster": True}, REDIS)


def test_a_clustered_list_whose_name_no_tag_can_keep_is_refused_with_the_fix() -> None:
    with pytest.raises(ConfigError, match=r"give the name a hash tag of its own \('\{jobs\}'"):
        read_adapter({"name": "a", "mode": "list", "source": "jobs}", "cluster": True}, REDIS)
    # Without a cluster, or for a stream (no derived keys), a name is a name.
    assert read_adapter({"name": "a", "mode": "list", "source": "jobs}"}, REDIS).source == "jobs}"
    assert read_adapter({"name": "a", "source": "jobs}", "cluster": True}, REDIS).options.cluster


def test_a_clustered_lists_keys_share_its_slot_and_a_single_servers_keep_their_names() -> None:
    assert processing_key("jobs", "c1") == "jobs:processing:c1"  # unchanged on one server
    assert processing_key("jobs", "c1", cluster=True) == "{jobs}:processing:c1"
    assert key_base("jobs", cluster=True) == "{jobs}"


def _settings(redis: dict[str, object], *adapters: dict[str, object]) -> Settings:
    raw: dict[str, object] = {
        "database": {"url": "postgresql://u@h/db"},
        "redis": redis,
        "adapters": list(adapters),
    }
    return from_mapping(raw, {})


def test_redis_cluster_is_the_default_of_the_adapters_on_its_url_only() -> None:
    s = _settings(
        {"url": "redis://node-1:7000/0", "cluster": True},
        {"name": "a", "source": "a"},
        {"name": "b", "source": "b", "url": "redis://single:6379/0"},
    )
    assert [(a.name, a.options.cluster) for a in s.adapters] == [("a", True), ("b", False)]


def test_a_cluster_default_needs_no_broker_of_dramatiq_beside_it() -> None:
    """The workers' broker is PostgreSQL (DESIGN.md section 7b): a [redis]
    cluster loads with no [dramatiq] url, which once had to name a single
    server of its own."""
    s = _settings({"url": "redis://node-1:7000/0", "cluster": True}, {"name": "a", "source": "a"})
    assert [(a.name, a.options.cluster) for a in s.adapters] == [("a", True)]
    assert s.notices == ()
