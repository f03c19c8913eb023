"""A Redis Cluster list named with a hash tag of its own (``{jobs}``,
``queue:{jobs}:in``, the usual way to pin keys together on a cluster) loads,
and its derived keys keep the name, whose tag leads them to its slot
(DESIGN.md 6b: a cluster list's processing lists live in its slot). A name
no form keeps in its slot (a ``}`` and no tag) is refused, and so are two
lists of one broker whose keys would be one (``jobs`` and ``{jobs}`` on a
cluster). On one server nothing changes: the keys are the name's."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from redis.crc import key_slot

from ingest.adapters.redis.lists import is_processing_key, key_base, processing_key, removed_marker
from ingest.adapters.redis.settings import hash_tag
from ingest.config import from_mapping
from ingest.config.adapter import read_adapter
from ingest.errors import ConfigError

REDIS = "redis://127.0.0.1:6379/0"
CLUSTER = "redis://node-1:7000/0"


def clustered_list(source: str, **kw: Any) -> dict[str, Any]:
    return {"name": "a", "mode": "list", "source": source, "cluster": True, **kw}


def derived_keys(source: str, consumer: str) -> list[str]:
    """Every key the list mode builds beside its source (the layout in
    ingest/adapters/redis/lists.py's docstring)."""
    base = key_base(source, cluster=True)
    processing = processing_key(source, consumer, cluster=True)
    return [
        processing,
        f"{base}:consumers",
        f"{base}:heartbeat:{consumer}",
        f"{base}:recovering:{processing}",
        removed_marker(processing, 42),
    ]


@pytest.mark.parametrize(
    ("key", "tag"),
    [
        ("jobs", None),
        ("{jobs}", "jobs"),
        ("queue:{jobs}:in", "jobs"),
        ("{a}{b}", "a"),  # the first one only
        ("{}jobs", None),  # empty: the whole key
        ("{}{jobs}", None),  # the first '{' decides, even before an empty tag
        ("jo{bs", None),  # no '}' after it
        ("jobs}", None),
        ("a}b{c}", "c"),
        ("{{jobs}}", "{jobs"),
    ],
)
def test_hash_tag_is_redis_clusters_rule(key: str, tag: str | None) -> None:
    assert hash_tag(key) == tag
    assert key_slot(key.encode()) == key_slot((tag if tag is not None else key).encode())


@pytest.mark.parametrize(
    ("source", "processing"),
    [
        ("{jobs}", "{jobs}:processing:c1"),
        ("queue:{jobs}:in", "queue:{jobs}:in:processing:c1"),
        ("jobs", "{jobs}:processing:c1"),  # as before: the name wrapped in a tag
        ("jo{bs", "{jo{bs}:processing:c1"),  # no tag of its own: wrapped, hashes as the name
    ],
)
def test_a_clustered_list_with_a_tag_of_its_own_loads_and_keeps_its_name(
    source: str, processing: str
) -> None:
    assert read_adapter(clustered_list(source), REDIS).source == source
    assert processing_key(source, "c1", cluster=True) == processing
    assert {key_slot(k.encode()) for k in derived_keys(source, "c1")} == {key_slot(source.encode())}


@pytest.mark.parametrize("source", ["jobs}", "{}jobs", "{}{jobs}", "a}b"])
def test_a_name_no_form_keeps_in_its_slot_is_refused_naming_the_fix(source: str) -> None:
    with pytest.raises(ConfigError) as info:
        read_adapter(clustered_list(source), REDIS)
    assert str(info.value).startswith(f"adapter 'a': key 'source' = {source!r}: on a cluster")
    assert "give the name a hash tag of its own ('{jobs}', 'queue:{jobs}:in') or no braces" in str(info.value)


@given(
    source=st.text(alphabet="{}j:", min_size=1, max_size=8),
    consumer=st.text(alphabet="{}c:", min_size=1, max_size=4),
)
def test_every_derived_key_of_a_loaded_cluster_list_is_in_its_slot(source: str, consumer: str) -> None:
    try:
        read_adapter(clustered_list(source), REDIS)
    except ConfigError:
        # Refused only where no form could keep the slot: a '}' and no tag.
        assert hash_tag(source) is None
        assert "}" in source
        return
    slot = key_slot(source.encode())
    assert [key_slot(k.encode()) for k in derived_keys(source, consumer)] == [slot] * 5


@given(source=st.text(alphabet="{}j:", min_size=1, max_size=8), consumer=st.text(min_size=1, max_size=4))
def test_on_one_server_the_keys_are_the_names_as_before(source: str, consumer: str) -> None:
    """Stored rows' ack_key must keep matching: no tag is added or kept
    differently without ``cluster``, whatever the name."""
    assert key_base(source) == source
    assert processing_key(source, consumer) == f"{source}:processing:{consumer}"


def test_the_ackers_check_stays_exact_for_a_tagged_name() -> None:
    ours = "{jobs}:processing:c1"
    assert is_processing_key(ours, "{jobs}", cluster=True)
    assert is_processing_key("queue:{jobs}:in:processing:c2", "queue:{jobs}:in", cluster=True)
    for other in [
        "{{jobs}}:processing:c1",  # the name wrapped again: another slot
        "{jobs}:processing:",  # no consumer
        removed_marker(ours, 3),  # a marker, not a list
        "{jobs}:consumers",
        "{jobs}:heartbeat:c1",
        "x{jobs}:processing:c1",  # another list's, in the same slot
        "{jobs}x:processing:c1",
        "queue:{jobs}:processing:c1",  # queue:{jobs}:in's tag, not its name
    ]:
        assert not is_processing_key(other, "{jobs}", cluster=True), other
    assert not is_processing_key("queue:{jobs}:processing:c1", "queue:{jobs}:in", cluster=True)
    # The untagged forms are as before: the wrapped name on a cluster only.
    assert is_processing_key("{jobs}:processing:c1", "jobs", cluster=True)
    assert not is_processing_key("jobs:processing:c1", "jobs", cluster=True)
    assert not is_processing_key("{jobs}:processing:c1", "jobs")


def _adapters(*tables: dict[str, Any]) -> None:
    from_mapping({"database": {"url": "postgresql://u@h/db"}, "adapters": list(tables)}, {})


def test_two_lists_whose_keys_would_be_one_are_refused() -> None:
    """``jobs`` wrapped on a cluster is ``{jobs}``, the very name of the
    list ``{jobs}``: their consumers would share processing lists."""
    plain = {"name": "a", "mode": "list", "source": "jobs", "url": CLUSTER, "cluster": True}
    tagged = {"name": "b", "mode": "list", "source": "{jobs}", "url": CLUSTER, "cluster": True}
    with pytest.raises(ConfigError) as info:
        _adapters(plain, tagged)
    assert str(info.value) == (
        "adapter 'b': key 'source' = '{jobs}': its processing lists would be those of the list 'jobs' of"
        " adapter 'a' on the same broker ({jobs}:processing:...), and each adapter's recovery would take"
        " the other's messages: rename one list"
    )
    # On two brokers, or one server (no wrapping), they are apart.
    _adapters(plain, {**tagged, "url": "redis://node-9:7000/0"})
    _adapters({**plain, "url": REDIS, "cluster": False}, {**tagged, "url": REDIS, "cluster": False})
    # Other tags of one slot are other keys.
    _adapters(plain, {**tagged, "source": "queue:{jobs}:in"})
