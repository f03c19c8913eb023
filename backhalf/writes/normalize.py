"""Normalization: a broker message's bytes to the canonical todo payload.

The payload is returned as JSON *text*; PostgreSQL parses it into jsonb, which
normalizes whitespace and key order, so one logical event yields the same todo
whichever mode or family carried it. The rules of DESIGN.md section 5 are
checked here, per message, because one bad message must not fail the batch
(jsonb would refuse ``\\u0000`` and lone surrogates for the whole statement).

Per-message Python work is the throughput budget (issue 5), so each check has
a fast path that proves the common case without walking the document.
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import json
import math
import sys
from array import array
from collections.abc import Iterator, Mapping, Sequence
from decimal import Decimal
from enum import StrEnum
from typing import TYPE_CHECKING, Any, NamedTuple

from backhalf.errors import PoisonMessage

if TYPE_CHECKING:
    from backhalf.writes.body_schema import BodySchema

DEFAULT_MAX_MESSAGE_BYTES = 1024 * 1024
MAX_JSON_DEPTH = 64


class BodyFormat(StrEnum):
    JSON = "json"
    TEXT = "text"
    BYTES = "bytes"


def _reject_constant(name: str) -> Any:
    raise PoisonMessage("invalid_json", f"{name} is not valid JSON (RFC 8259)")


def _check_size(body: bytes, max_message_bytes: int) -> None:
    if len(body) > max_message_bytes:
        raise PoisonMessage("too_large", f"{len(body)} bytes exceeds max_message_bytes={max_message_bytes}")


def _decode_utf8(body: bytes) -> str:
    try:
        # Strict UTF-8 also refuses encoded surrogates (ED A0 80 ...).
        return body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PoisonMessage("invalid_utf8", f"byte {exc.start}: {exc.reason}") from exc


def _check_string(s: str) -> None:
    if "\x00" in s:
        raise PoisonMessage("nul_character", "NUL (\\u0000) cannot be stored in jsonb")
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise PoisonMessage("lone_surrogate", f"unpaired surrogate at {exc.start}") from exc


def _walk(value: Any, check_strings: bool) -> None:
    # Iterative, so a deep document cannot exhaust the interpreter's stack.
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            if depth > MAX_JSON_DEPTH:
                raise PoisonMessage("too_deep", f"nesting exceeds {MAX_JSON_DEPTH}")
            for k, v in item.items():
                if check_strings:
                    _check_string(k)
                stack.append((v, depth + 1))
        elif isinstance(item, list):
            if depth > MAX_JSON_DEPTH:
                raise PoisonMessage("too_deep", f"nesting exceeds {MAX_JSON_DEPTH}")
            stack.extend((v, depth + 1) for v in item)
        elif check_strings and isinstance(item, str):
            _check_string(item)


MAX_NUMBER_CHARS = 1000
MAX_EXPONENT = 1000


def _check_float(s: str) -> str:
    # The value is not needed in Python, and float() would turn 1e400 into inf;
    # PostgreSQL's numeric keeps it exactly, within limits an absurd exponent
    # (1e1000000) would break for the whole batch.
    if len(s) > MAX_NUMBER_CHARS:
        raise PoisonMessage("absurd_number", f"number of {len(s)} characters")
    _, e, exponent = s.lower().partition("e")
    if e and abs(int(exponent)) > MAX_EXPONENT:
        # Not quoted: a rejection's text carries nothing of the body (issue 32.6).
        raise PoisonMessage("absurd_number", f"an exponent beyond +-{MAX_EXPONENT}")
    return s


def _checked_number(s: str) -> float | Decimal:
    # For a schema, numbers must be numbers: floats as json.loads would give
    # them, and Decimal where a float would overflow to inf (1e400).
    value = float(_check_float(s))
    return value if math.isfinite(value) else Decimal(s)


# Built once: json.loads with hooks builds a decoder per call, a large share
# of the ingester's per-message Python time (docs/architecture.md).
_DECODER = json.JSONDecoder(parse_constant=_reject_constant, parse_float=_check_float)
_NUMBER_DECODER = json.JSONDecoder(parse_constant=_reject_constant, parse_float=_checked_number)


def _json_payload(text: str, schema: BodySchema | None) -> str:
    decoder = _DECODER if schema is None else _NUMBER_DECODER
    try:
        value = decoder.decode(text)
    except PoisonMessage:
        raise
    except RecursionError as exc:
        raise PoisonMessage("too_deep", f"nesting exceeds {MAX_JSON_DEPTH}") from exc
    except ValueError as exc:  # JSONDecodeError, and int() past 4300 digits
        raise PoisonMessage("invalid_json", str(exc)) from exc
    # Raw control characters are already refused by the strict parser and raw
    # surrogates by the UTF-8 decode, so NUL and lone surrogates can only come
    # from \u escapes; without any, the strings need no walk.
    check_strings = "\\u" in text
    deep_possible = text.count("[") + text.count("{") > MAX_JSON_DEPTH
    if check_strings or deep_possible:
        _walk(value, check_strings)
    if schema is not None:
        schema.check(value)
    return text


def body_payload(
    body: bytes, fmt: BodyFormat, max_message_bytes: int, schema: BodySchema | None = None
) -> str:
    """Decode a whole-message body per the adapter's ``format``; return JSON
    text. A ``schema`` is checked against the decoded value (a ``text`` body
    is a string; config refuses a schema for ``bytes``)."""
    _check_size(body, max_message_bytes)
    if fmt is BodyFormat.BYTES:
        return json.dumps(base64.b64encode(body).decode("ascii"))
    text = _decode_utf8(body)
    if fmt is BodyFormat.TEXT:
        if "\x00" in text:
            raise PoisonMessage("nul_character", "NUL cannot be stored in jsonb")
        if schema is not None:
            schema.check(text)
        return json.dumps(text, ensure_ascii=False)
    return _json_payload(text, schema)


# A field map of more fields than this is refused by its count, before any
# of it is decoded (issue 32.8): each field costs Python work per message
# (about 4 us, decoded, checked and copied), so a 1 MiB entry of 262k
# one-byte fields held the ingester's event loop 1.1 s before its rejection.
# A field map's count is known from the broker's reply before it is made a
# map (the transport's adapter), so such a message is never made one.
MAX_FIELDS = 1024


class FieldMap(dict[bytes, bytes]):
    """A message that came as named fields instead of one body (a stream
    entry without its body field; headers-only messages elsewhere): its
    payload is a JSON object of strings, whatever the adapter's ``format``."""

    __slots__ = ()


class RefusedFieldMap:
    """A field map of more than :data:`MAX_FIELDS` fields, as read: its flat
    ``[field, value, ...]`` list, never decoded nor made a map. It is
    rejected ``too_many_fields`` (:func:`refusal`); the inbox keeps the JSON
    form of its first fields as a prefix, with its bytes as read and their
    digest (:func:`raw_form`)."""

    __slots__ = ("flat", "lengths", "size")

    def __init__(self, flat: Sequence[bytes]) -> None:
        self.flat = flat
        self.lengths = array("Q", map(len, flat))
        self.size = sum(self.lengths)  # its fields' keys and values, as content_size counts them

    @property
    def fields(self) -> int:
        return len(self.flat) // 2


# What a transport hands over as a message's content.
Content = bytes | FieldMap | RefusedFieldMap


def content_size(content: Content) -> int:
    """A message's bytes as read (its body, or its fields' keys and values)."""
    if isinstance(content, RefusedFieldMap):
        return content.size
    if isinstance(content, FieldMap):
        return sum(len(k) + len(v) for k, v in content.items())
    return len(content)


def _too_many_fields(fields: int) -> str:
    return f"{fields} fields exceeds the limit of {MAX_FIELDS}"


def refusal(content: Content) -> str | None:
    """The error of a message refused before it is decoded (a field map of
    more than MAX_FIELDS fields), or None; a delivery's first check, as it
    costs nothing per field."""
    if isinstance(content, RefusedFieldMap):
        return f"too_many_fields: {_too_many_fields(content.fields)}"
    if isinstance(content, FieldMap) and len(content) > MAX_FIELDS:
        return f"too_many_fields: {_too_many_fields(len(content))}"
    return None


def raw_form(content: Content, max_message_bytes: int) -> RawForm:
    """The inbox's copy of a message's content (``raw_body``, ``raw_field_map``
    or, for a map of too many fields, ``refused_field_map``)."""
    if isinstance(content, RefusedFieldMap):
        return refused_field_map(content)
    if isinstance(content, FieldMap):
        if len(content) > MAX_FIELDS:  # built by another transport: refused all the same
            return refused_field_map(RefusedFieldMap(list(itertools.chain.from_iterable(content.items()))))
        return raw_field_map(content, max_message_bytes)
    return raw_body(bytes(content), max_message_bytes)


def content_payload(
    content: Content, fmt: BodyFormat, max_message_bytes: int, schema: BodySchema | None = None
) -> str:
    """The todo's payload (JSON text) of a message's content, or :class:`PoisonMessage`."""
    if isinstance(content, RefusedFieldMap):
        raise PoisonMessage("too_many_fields", _too_many_fields(content.fields))
    if isinstance(content, FieldMap):
        return fields_payload(content, max_message_bytes, schema)
    return body_payload(bytes(content), fmt, max_message_bytes, schema)


def fields_payload(
    fields: Mapping[bytes, bytes], max_message_bytes: int, schema: BodySchema | None = None
) -> str:
    """A stream entry without a body field: its field map as a JSON object of strings."""
    if len(fields) > MAX_FIELDS:
        raise PoisonMessage("too_many_fields", _too_many_fields(len(fields)))
    size = sum(len(k) + len(v) for k, v in fields.items())
    if size > max_message_bytes:
        raise PoisonMessage("too_large", f"{size} bytes exceeds max_message_bytes={max_message_bytes}")
    decoded: dict[str, str] = {}
    for k, v in fields.items():
        key, val = _decode_utf8(k), _decode_utf8(v)
        if "\x00" in key or "\x00" in val:
            raise PoisonMessage("nul_character", "NUL cannot be stored in jsonb")
        decoded[key] = val
    if schema is not None:
        schema.check(decoded)
    return json.dumps(decoded, ensure_ascii=False, separators=(",", ":"))


def _decoded_fields(fields: Mapping[bytes, bytes]) -> dict[str, str]:
    # Kept even when not UTF-8 (backslashreplace); keys that decode alike
    # collapse, as they always have in the inbox's copy.
    lenient = "backslashreplace"
    return {k.decode("utf-8", lenient): v.decode("utf-8", lenient) for k, v in fields.items()}


def raw_fields(fields: Mapping[bytes, bytes]) -> bytes:
    """The inbox's raw copy of a field map, kept even when it is not UTF-8."""
    return json.dumps(_decoded_fields(fields), separators=(",", ":")).encode()


# What the inbox keeps of a message over max_message_bytes: enough to see
# what it was, never the whole (a 50 MiB body would be stored whole, and
# kept). The stored form of any message is then at most max_message_bytes,
# or this prefix.
REJECTED_PREFIX_BYTES = 4096


class RawForm(NamedTuple):
    """The inbox's copy of a message: the whole of it, or, past the limit, its
    first REJECTED_PREFIX_BYTES plus the full length and sha256."""

    body: bytes
    size: int | None = None  # the full length, when ``body`` is a prefix
    sha256: bytes | None = None  # the full form's digest, when ``body`` is a prefix

    @property
    def truncated(self) -> bool:
        return self.size is not None


def raw_body(body: bytes, max_message_bytes: int) -> RawForm:
    if len(body) <= max_message_bytes:
        return RawForm(body)
    return RawForm(body[:REJECTED_PREFIX_BYTES], len(body), hashlib.sha256(body).digest())


def raw_field_map(fields: Mapping[bytes, bytes], max_message_bytes: int) -> RawForm:
    """A field map's copy: its JSON form (``raw_fields``), kept whole if the
    map is within max_message_bytes, where it counts as its JSON text in
    UTF-8 (the payload a todo gets). The stored form escapes non-ASCII, so
    it is at most 6 times the limit: six bytes for a control byte, at most
    three times its UTF-8 bytes for any other character."""
    # Every byte of a key or value takes at least a byte of the JSON text:
    # a map past the limit by that count is never built whole.
    if sum(len(k) + len(v) for k, v in fields.items()) <= max_message_bytes:
        raw = raw_fields(fields)
        if len(raw) <= max_message_bytes or _utf8_json_size(fields) <= max_message_bytes:
            return RawForm(raw)
    prefix = bytearray()
    digest = hashlib.sha256()
    size = 0
    for piece in _raw_fields_pieces(fields):
        digest.update(piece)
        size += len(piece)
        if len(prefix) < REJECTED_PREFIX_BYTES:
            prefix += piece[: REJECTED_PREFIX_BYTES - len(prefix)]
    return RawForm(bytes(prefix), size, digest.digest())


def refused_field_map(refused: RefusedFieldMap) -> RawForm:
    """A refused field map's copy, made without decoding it: the JSON form of
    its first fields (as ``raw_fields`` would begin, duplicate fields kept),
    at most REJECTED_PREFIX_BYTES; its size is its bytes as read (keys and
    values, not the JSON form, which is never built) and its digest the
    sha256 of their lengths (8 bytes each, little-endian) then the bytes
    themselves, so a redelivery of the entry dedups and another entry on its
    id does not."""
    flat = refused.flat
    prefix = bytearray(b"{")
    for n in range(0, len(flat) - 1, 2):
        if len(prefix) >= REJECTED_PREFIX_BYTES:
            break
        # Each byte takes at least a byte of the JSON text: a slice a little
        # longer than the prefix gives the same bytes up to the prefix's end.
        key, value = (_lenient(piece[:_PREFIX_SLICE]) for piece in flat[n : n + 2])
        prefix += (("," if n else "") + json.dumps(key) + ":" + json.dumps(value)).encode()
    lengths = refused.lengths
    if sys.byteorder != "little":  # the same digest on any machine
        lengths = array("Q", lengths)
        lengths.byteswap()
    digest = hashlib.sha256(lengths.tobytes())
    digest.update(b"".join(flat))
    return RawForm(bytes(prefix[:REJECTED_PREFIX_BYTES]), refused.size, digest.digest())


# A multi-byte character cut at the slice's end takes its escapes after the
# prefix's end, never within it.
_PREFIX_SLICE = REJECTED_PREFIX_BYTES + 8


def _lenient(piece: bytes) -> str:
    return piece.decode("utf-8", "backslashreplace")


def _utf8_json_size(fields: Mapping[bytes, bytes]) -> int:
    return len(json.dumps(_decoded_fields(fields), ensure_ascii=False, separators=(",", ":")).encode())


# Characters escaped at a time: an escaped character takes at most six
# bytes, so a piece never exceeds 384 KiB however large the value.
_ESCAPE_CHUNK = 64 * 1024


def _raw_fields_pieces(fields: Mapping[bytes, bytes]) -> Iterator[bytes]:
    """``raw_fields(fields)`` in bounded pieces (the same bytes, joined)."""
    yield b"{"
    for n, (key, value) in enumerate(_decoded_fields(fields).items()):
        yield (("," if n else "") + json.dumps(key) + ':"').encode()
        for at in range(0, len(value), _ESCAPE_CHUNK):
            # Escaping is per character, so slices escape to the whole's bytes.
            yield json.dumps(value[at : at + _ESCAPE_CHUNK])[1:-1].encode()
        yield b'"'
    yield b"}"
