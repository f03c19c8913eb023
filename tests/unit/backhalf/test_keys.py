"""Idempotency keys (the contract of DESIGN.md section 5)."""

from __future__ import annotations

import hashlib

from hypothesis import given
from hypothesis import strategies as st

from backhalf.writes.keys import body_key, native_key


def test_stream_key_is_prefix_stream_entry_id() -> None:
    assert native_key("redis", "orders", "1700000000000-0") == "redis:orders:1700000000000-0"


def test_body_key_is_sha256_hex_of_the_body() -> None:
    body = b'{"order": 1}'
    assert body_key("redis", "jobs", body) == f"redis:jobs:{hashlib.sha256(body).hexdigest()}"


@given(st.binary(max_size=256), st.binary(max_size=256))
def test_body_keys_differ_exactly_when_bodies_differ(a: bytes, b: bytes) -> None:
    assert (body_key("redis", "q", a) == body_key("redis", "q", b)) == (a == b)
