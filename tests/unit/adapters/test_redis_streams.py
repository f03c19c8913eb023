"""XREADGROUP's raw reply, read without redis-py's per-entry dicts, in both
protocols' shapes (the live protocol is covered by the integration tests)."""

from __future__ import annotations

from ingest.adapters.redis.streams import _entries, _field_map, _last_value

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


def test_the_body_field_of_a_long_field_list_is_found_as_a_map_would_keep_it() -> None:
    """An entry of too many fields is never made a map: its body field, if it
    has one, is looked up in the flat list, with the map's last-one-wins."""
    fields = [b"a", b"1", b"body", b"first", b"b", b"2", b"body", b"last"]
    assert _last_value(fields, b"body") == b"last" == _field_map(fields)[b"body"]  # type: ignore[index]
    assert _last_value(fields, b"a") == b"1"
    assert _last_value(fields, b"1") is None  # a value is not a field name
    assert _last_value([], b"body") is None
