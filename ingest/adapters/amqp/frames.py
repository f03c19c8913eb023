"""Frames a producer wrote are data: decoded without trusting them.

A message's properties (``message_id``, ``headers``, ``timestamp``...) are
the publisher's bytes, and RabbitMQ passes them through unchecked. pamqp
(4.0.1, under aiormq) fails a content-header frame on any of them it cannot
decode: a short string or a header table's key that is not UTF-8, a
timestamp past the year 9999. The failed frame ends the connection, which
puts the message back at the head of the queue, where the next connection
meets it again, for good: one message stops the adapter. pamqp already
decodes long strings tolerantly (its pull request 40); pika traps the same
errors (its pull request 890). Until pamqp does it everywhere,
:func:`install` makes it

* decode short strings and table keys that are not UTF-8 as
  ``surrogateescape`` code points (U+DC80 to U+DCFF, one per byte), so an
  odd ``message_id`` is kept (``backhalf.writes.keys`` escapes it in the key and
  makes it storable in the row);
* and, for anything else in the properties it cannot decode, drop the
  properties of that message (all of them: their offsets are lost) and mark
  it with the header :data:`UNDECODABLE`, so the message is stored keyed
  by its body and the adapter logs why, instead of the connection ending.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

from pamqp import base, common, decode

# The header a message whose properties could not be decoded carries (its
# other properties are gone): what failed, for the adapter's log line.
UNDECODABLE = "x-switchboard-undecodable-properties"

_installed = False


def tolerant_short_str(value: bytes) -> tuple[int, str]:
    """pamqp's ``short_str``, keeping bytes that are not UTF-8 as surrogate
    escapes instead of failing the frame."""
    try:
        length = common.Struct.byte.unpack(value[0:1])[0]
    except (struct.error, TypeError) as exc:  # as pamqp's own says it
        raise ValueError("Could not unpack short string value") from exc
    return length + 1, value[1 : length + 1].decode("utf-8", "surrogateescape")


def tolerant_field_table(value: bytes) -> tuple[int, common.FieldTable]:
    """A field table (a 32-bit length, then key, typed value pairs), its
    keys decoded as :func:`tolerant_short_str` does; the values by pamqp."""
    try:
        length = common.Struct.integer.unpack(value[0:4])[0]
    except (struct.error, TypeError) as exc:
        raise ValueError("Could not unpack data") from exc
    end = 4 + length
    if end > len(value):
        raise ValueError("Field table length exceeds available data")
    offset, table = 4, {}
    while offset < end:
        consumed, key = tolerant_short_str(value[offset:end])
        if offset + consumed > end:
            raise ValueError("Field table key length exceeds data")
        offset += consumed
        consumed, table[key] = decode.embedded_value(value[offset:])
        offset += consumed
    return end, table


def _tolerant_unmarshal(original: Callable[[Any, int, bytes], None]) -> Callable[[Any, int, bytes], None]:
    def unmarshal(self: base.BasicProperties, flags: int, data: bytes) -> None:
        try:
            original(self, flags, data)
        except (ValueError, OverflowError, ArithmeticError) as exc:  # UnicodeDecodeError is a ValueError
            for name in self.__slots__:
                setattr(self, name, None)
            setattr(self, "headers", {UNDECODABLE: f"{type(exc).__name__}: {exc}"[:200]})  # noqa: B010

    return unmarshal


def install() -> None:
    """Make pamqp decode a producer's properties as this module says.
    Idempotent; a no-op once done."""
    global _installed
    if _installed:
        return
    decode.METHODS["shortstr"] = tolerant_short_str
    decode.METHODS["table"] = tolerant_field_table
    decode.TABLE_MAPPING[b"F"] = tolerant_field_table  # a table nested in a table
    setattr(decode, "short_str", tolerant_short_str)  # noqa: B010 - a module's function, by name
    setattr(decode, "field_table", tolerant_field_table)  # noqa: B010
    # Basic.Properties inherits it: the content header's properties.
    setattr(base.BasicProperties, "unmarshal", _tolerant_unmarshal(base.BasicProperties.unmarshal))  # noqa: B010
    _installed = True
