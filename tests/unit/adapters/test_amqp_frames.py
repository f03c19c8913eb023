"""A producer's properties that pamqp cannot decode no longer end the
connection (issue 43, ingest/adapters/amqp/frames.py)."""

from __future__ import annotations

import datetime

from pamqp import commands, decode, encode

from ingest.adapters.amqp import frames

frames.install()


def test_a_short_string_that_is_not_utf8_is_kept_as_surrogate_escapes() -> None:
    assert decode.by_type(b"\x03\xff\xfeA", "shortstr") == (4, "\udcff\udcfeA")


def test_a_header_key_that_is_not_utf8_decodes_nested_too() -> None:
    inner = encode.field_table({"n": 1})
    raw_key = b"\x02\xff\xfe"
    nested = raw_key + b"F" + inner
    table = len(nested).to_bytes(4, "big") + nested
    consumed, value = decode.by_type(table, "table")
    assert consumed == len(table)
    assert value == {"\udcff\udcfe": {"n": 1}}
    # A well-formed table decodes as pamqp would.
    plain = encode.field_table({"a": "b", "x": [1, 2]})
    assert decode.by_type(plain, "table") == (len(plain), {"a": "b", "x": [1, 2]})


def test_properties_pamqp_cannot_decode_are_dropped_and_marked() -> None:
    moment = datetime.datetime(2020, 1, 1, tzinfo=datetime.UTC)
    marshalled = commands.Basic.Properties(message_id="m-1", timestamp=moment).marshal()
    flags, data = int.from_bytes(marshalled[:2], "big"), marshalled[2:]
    # The timestamp (the last property written): a year past 9999.
    data = data[:-8] + b"\x7f" * 8
    props = commands.Basic.Properties()
    props.unmarshal(flags, data)
    assert props.message_id is None
    assert props.timestamp is None
    assert props.headers is not None
    assert frames.UNDECODABLE in props.headers
    good = commands.Basic.Properties()
    good.unmarshal(flags, marshalled[2:])
    assert (good.message_id, good.timestamp) == ("m-1", moment)
