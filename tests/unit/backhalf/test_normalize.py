"""Normalization rules: what a body becomes as a payload, and what is poison."""

from __future__ import annotations

import hashlib
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from backhalf.errors import PoisonMessage
from backhalf.writes.normalize import (
    MAX_JSON_DEPTH,
    REJECTED_PREFIX_BYTES,
    BodyFormat,
    RawForm,
    body_payload,
    fields_payload,
    raw_body,
    raw_field_map,
    raw_fields,
)

LIMIT = 1024 * 1024


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text().filter(lambda s: "\x00" not in s),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(st.text().filter(lambda s: "\x00" not in s), children, max_size=4)
    ),
    max_leaves=20,
)


@given(json_values)
def test_valid_json_is_accepted_and_means_the_same(value: object) -> None:
    for ensure_ascii in (True, False):
        text = json.dumps(value, ensure_ascii=ensure_ascii)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            continue  # a lone surrogate cannot be sent as UTF-8 at all
        refused: PoisonMessage | None = None
        try:
            payload = body_payload(text.encode(), BodyFormat.JSON, LIMIT)
        except PoisonMessage as exc:
            refused = exc
        if refused is not None:
            # Only (escaped) lone surrogates may be refused among generated values.
            assert refused.reason == "lone_surrogate"
        else:
            assert json.loads(payload) == value


@given(st.binary(max_size=300))
def test_arbitrary_bytes_are_accepted_or_poison_never_crash(body: bytes) -> None:
    for fmt in BodyFormat:
        try:
            payload = body_payload(body, fmt, LIMIT)
        except PoisonMessage:
            continue
        json.loads(payload)  # whatever is accepted is valid JSON text


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"{not json", "invalid_json"),
        (b"NaN", "invalid_json"),
        (b"[Infinity]", "invalid_json"),
        (b"\xff\xfe", "invalid_utf8"),
        (b'"\\ud800 lone"', "lone_surrogate"),
        (b'{"a": "x\\u0000y"}', "nul_character"),
        (b'{"\\u0000": 1}', "nul_character"),
        (b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1), "too_deep"),
        (b"[" * 5000 + b"]" * 5000, "too_deep"),
        (b"1" * 4301, "invalid_json"),
        (b"1e999999", "absurd_number"),
        (b"x" * (LIMIT + 1), "too_large"),
        (b"\xed\xa0\x80", "invalid_utf8"),  # a surrogate encoded as UTF-8
    ],
)
def test_poison_json(body: bytes, reason: str) -> None:
    with pytest.raises(PoisonMessage) as info:
        body_payload(body, BodyFormat.JSON, LIMIT)
    assert info.value.reason == reason


def test_depth_limit_is_inclusive() -> None:
    body = b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH
    assert body_payload(body, BodyFormat.JSON, LIMIT) == body.decode()


def test_json_passes_through_unchanged_for_postgres_to_parse() -> None:
    assert body_payload(b'{"b": 1e400, "a": [1, 2]}', BodyFormat.JSON, LIMIT) == '{"b": 1e400, "a": [1, 2]}'


def test_text_and_bytes_formats() -> None:
    assert json.loads(body_payload("héllo".encode(), BodyFormat.TEXT, LIMIT)) == "héllo"
    with pytest.raises(PoisonMessage):
        body_payload(b"a\x00b", BodyFormat.TEXT, LIMIT)
    assert json.loads(body_payload(b"\x00\xff", BodyFormat.BYTES, LIMIT)) == "AP8="


def test_field_map_payload() -> None:
    assert json.loads(fields_payload({b"order": b"1", b"sku": b"A"}, LIMIT)) == {"order": "1", "sku": "A"}
    with pytest.raises(PoisonMessage) as info:
        fields_payload({b"k": b"\xff"}, LIMIT)
    assert info.value.reason == "invalid_utf8"


# -- the stored form (issue 11, item 9) ----------------------------------------


def test_a_body_within_the_limit_is_kept_whole() -> None:
    assert raw_body(b"x" * 1024, 1024) == RawForm(b"x" * 1024)


def test_a_body_over_the_limit_keeps_a_prefix_its_size_and_digest() -> None:
    body = b"y" * 10_000
    form = raw_body(body, 1024)
    assert form == RawForm(body[:REJECTED_PREFIX_BYTES], 10_000, hashlib.sha256(body).digest())


def test_a_field_map_counts_as_its_json_form() -> None:
    """Control bytes escape to six bytes each: 300 of them are 1,800 stored
    bytes, over a limit of 1,024 that their raw count (600) is within."""
    fields = {f"k{i}".encode(): b"\x01" for i in range(100)}
    form = raw_field_map(fields, 1024)
    whole = raw_fields(fields)
    assert len(whole) > 1024
    assert form == RawForm(whole[:REJECTED_PREFIX_BYTES], len(whole), hashlib.sha256(whole).digest())
    assert raw_field_map(fields, len(whole)) == RawForm(whole)


def test_a_huge_field_map_is_never_kept_whole() -> None:
    fields = {f"field-{i}".encode(): b"\x00\xff" for i in range(50_000)}
    form = raw_field_map(fields, 1024)
    whole = raw_fields(fields)
    assert (form.body, form.size, form.sha256) == (
        whole[:REJECTED_PREFIX_BYTES],
        len(whole),
        hashlib.sha256(whole).digest(),
    )


def test_non_ascii_counts_by_its_utf8_bytes_though_stored_escaped() -> None:
    """400,000 bytes of Cyrillic are within a 1 MiB limit, though the stored
    (ASCII-escaped) form takes 1.2 MB: kept whole, not rejected too_large."""
    fields = {b"text": "я".encode() * 200_000}
    form = raw_field_map(fields, 1024 * 1024)
    assert form == RawForm(raw_fields(fields))
    assert len(form.body) > 1024 * 1024
    assert fields_payload(fields, 1024 * 1024)


def test_the_prefix_and_digest_are_those_of_the_stored_form_even_when_keys_collide() -> None:
    """b"\\xff" decodes to the text of b"\\\\xff": the stored copy keeps one,
    and a prefix's digest must be the digest of exactly that copy."""
    fields = {b"\xff": b"A" * 5000, b"\\xff": b"B" * 5000}
    whole = raw_fields(fields)
    form = raw_field_map(fields, 1024)
    assert (form.size, form.sha256) == (len(whole), hashlib.sha256(whole).digest())
