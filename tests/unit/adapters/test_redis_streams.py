"""XREADGROUP's raw reply, read without redis-py's per-entry dicts, in both
protocols' shapes (the live protocol is covered by the integration tests)."""

from __future__ import annotations

from ingest.adapters.redis.streams import _entries, _field_map

ENTRIES = [[b"1-0", [b"body", b"{}"]], [b"2-0", None], [b"3-0", [b"a", b"1", b"b", b"2"]]]


def test_resp3_and_resp2_replies_give_the_same_entries() -> None:
    assert _entries({b"orders": ENTRIES}) == ENTRIES
    assert _entries([[b"orders", ENTRIES]]) == ENTRIES
    assert _entries(None) == []
    assert _entries({}) == []


def test_field_lists_become_maps_and_a_deleted_entry_has_none() -> None:
    assert _field_map([b"a", b"1", b"b", b"2"]) == {b"a": b"1", b"b": b"2"}
    assert _field_map(None) is None
    assert _field_map([]) == {}
