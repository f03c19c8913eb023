"""A field map is refused by its count before it is decoded (issue 32.8):
what the inbox keeps of it, its error, and the bounded work it costs. The
stream adapter's side, against a real Redis and the whole pipeline, is in
tests/integration/adapters/test_redis_stream_field_counts.py."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest

from backhalf.errors import PoisonMessage
from backhalf.writes import normalize
from backhalf.writes.normalize import (
    MAX_FIELDS,
    REJECTED_PREFIX_BYTES,
    BodyFormat,
    FieldMap,
    RefusedFieldMap,
    content_payload,
    content_size,
    fields_payload,
    raw_fields,
    raw_form,
    refusal,
)

LIMIT = 1 << 20


def flat(n: int, value: bytes = b"v") -> list[bytes]:
    return [piece for i in range(n) for piece in (str(i).encode(), value)]


def test_a_map_of_max_fields_is_a_map_and_one_more_is_refused() -> None:
    at_limit = FieldMap(zip(flat(MAX_FIELDS)[0::2], flat(MAX_FIELDS)[1::2], strict=True))
    assert refusal(at_limit) is None
    assert json.loads(content_payload(at_limit, BodyFormat.JSON, LIMIT))["0"] == "v"
    over = FieldMap(zip(flat(MAX_FIELDS + 1)[0::2], flat(MAX_FIELDS + 1)[1::2], strict=True))
    assert refusal(over) == f"too_many_fields: {MAX_FIELDS + 1} fields exceeds the limit of {MAX_FIELDS}"
    with pytest.raises(PoisonMessage) as info:
        content_payload(over, BodyFormat.JSON, LIMIT)
    assert info.value.reason == "too_many_fields"
    with pytest.raises(PoisonMessage, match=r"^too_many_fields: "):
        fields_payload(over, LIMIT)
    assert raw_form(over, LIMIT) == raw_form(RefusedFieldMap(flat(MAX_FIELDS + 1)), LIMIT)


def test_a_refused_map_is_kept_as_a_prefix_with_its_size_and_digest_as_read() -> None:
    fields = flat(262_144)
    refused = RefusedFieldMap(fields)
    assert refused.fields == 262_144
    assert refusal(refused) == f"too_many_fields: 262144 fields exceeds the limit of {MAX_FIELDS}"
    with pytest.raises(PoisonMessage) as info:
        content_payload(refused, BodyFormat.JSON, LIMIT)
    assert str(info.value) == refusal(refused)
    size = sum(map(len, fields))
    assert content_size(refused) == size
    raw = raw_form(refused, LIMIT)
    assert raw.truncated
    assert raw.size == size
    # The prefix is how the map's JSON form (raw_fields) begins: as that of
    # its first thousand fields does, already longer than the prefix.
    leading = raw_fields(dict(zip(fields[0:2000:2], fields[1:2000:2], strict=True)))
    assert len(raw.body) == REJECTED_PREFIX_BYTES < len(leading)
    assert raw.body == leading[:REJECTED_PREFIX_BYTES]
    # The digest is of the bytes as read, with their lengths: the same entry
    # digests alike, one that splits its bytes otherwise does not.
    assert raw_form(RefusedFieldMap(list(fields)), LIMIT).sha256 == raw.sha256
    moved = [b"0v", b"", *fields[2:]]
    assert raw_form(RefusedFieldMap(moved), LIMIT).sha256 != raw.sha256
    assert raw.sha256 != hashlib.sha256(b"".join(fields)).digest()


def test_the_prefix_of_long_and_non_utf8_fields_matches_the_json_form() -> None:
    for value in (b"x" * 100_000, "\u00e9".encode() * 50_000, b"\xff\xfe" * 40_000, b"\x01" * 9_000):
        fields = flat(MAX_FIELDS + 1, value)
        # Its first field alone is longer than the prefix: the map's JSON form
        # begins as that field's does.
        first = raw_fields({fields[0]: fields[1]})
        assert len(first) > REJECTED_PREFIX_BYTES
        assert raw_form(RefusedFieldMap(fields), LIMIT).body == first[:REJECTED_PREFIX_BYTES]


def test_the_refusal_decodes_only_what_its_prefix_shows(monkeypatch: pytest.MonkeyPatch) -> None:
    """The count, not the bytes: nothing of the map is decoded but the few
    first fields its 4 KiB prefix shows, however many it has."""
    decoded: list[int] = []
    real = normalize._lenient

    def counting(piece: bytes) -> str:
        decoded.append(len(piece))
        return real(piece)

    def never(*_args: Any) -> Any:
        raise AssertionError("a refused field map was decoded")

    monkeypatch.setattr(normalize, "_lenient", counting)
    for name in ("_decode_utf8", "_decoded_fields", "raw_fields", "raw_field_map", "fields_payload"):
        monkeypatch.setattr(normalize, name, never)
    refused = RefusedFieldMap(flat(262_144))
    assert refusal(refused) is not None
    raw_form(refused, LIMIT)
    with pytest.raises(PoisonMessage):
        content_payload(refused, BodyFormat.JSON, LIMIT)
    # Each field takes at least 8 bytes of the prefix ("k":"v" and a comma).
    assert 0 < len(decoded) <= 2 * REJECTED_PREFIX_BYTES // 8
    assert max(decoded) <= REJECTED_PREFIX_BYTES + 8
