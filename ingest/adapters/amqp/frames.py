"""Frames a producer wrote are data: short strings decoded without trusting
them to be UTF-8.

AMQP 0-9-1's short strings (a message's ``message_id``, ``correlation_id``,
``type``, a routing key, a header table's keys) are bytes on the wire, and
RabbitMQ passes a publisher's through unchecked. pamqp (4.0.1, under
aiormq) decodes them as strict UTF-8: one message whose ``message_id`` is
not UTF-8 fails its whole content-header frame, which ends the connection,
which puts the message back at the head of the queue, where the next
connection meets it again, for good. pamqp already decodes long strings
tolerantly (its pull request 40); pika traps the same error (its pull
request 890). Until pamqp does it for short strings, :func:`install` makes
its short-string decoder keep bytes that are not UTF-8 as
``surrogateescape`` code points (U+DC80 to U+DCFF, one per byte), so the
frame decodes, and the adapter treats the id like any producer's id
(``backhalf.keys``: escaped in the key, made storable in the row).
"""

from __future__ import annotations

import struct

from pamqp import common, decode

_installed = False


def tolerant_short_str(value: bytes) -> tuple[int, str]:
    """pamqp's ``short_str``, with bytes that are not UTF-8 kept as
    surrogate escapes instead of failing the frame."""
    try:
        length = common.Struct.byte.unpack(value[0:1])[0]
    except (struct.error, TypeError) as exc:  # as pamqp's own says it
        raise ValueError("Could not unpack short string value") from exc
    return length + 1, value[1 : length + 1].decode("utf-8", "surrogateescape")


def install() -> None:
    """Make pamqp decode short strings with :func:`tolerant_short_str`:
    through its type table (properties, methods) and by name (field table
    keys). Idempotent; a no-op once done."""
    global _installed
    if _installed:
        return
    decode.METHODS["shortstr"] = tolerant_short_str
    setattr(decode, "short_str", tolerant_short_str)  # noqa: B010 - a function, not an attribute mypy lets us assign
    _installed = True
