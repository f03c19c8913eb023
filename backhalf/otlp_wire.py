"""The OTLP/protobuf bytes of an export of finished spans, written straight
to the wire format (docs/decisions/0040-otlp-span-bytes.md).

The SDK's encoder builds a protobuf message object for each span, each of
its attributes and each attribute's value, then serializes them: in a
traced no-op run, its exporter's thread (nearly all of it encoding) was
about half of what tracing added to a worker. The spans Switchboard makes,
and most a handler makes, hold scalar attributes, events and links only;
those are written here as bytes, in the order and form the SDK's encoder
writes them, so the request is byte for byte the one it sends
(``tests/unit/backhalf/test_otlp_wire.py`` holds the two to it). A span
with anything else (an array or bytes value, an int beyond 64 bits) is left
to the SDK's encoder, with its resource's and scopes' ends: one call per
resource and batch, so each is encoded (and any attribute the SDK refuses
logged) as often as the SDK's own export does.

Imported only once tracing is on (``backhalf.tracing``): it needs the
``[otel]`` extra.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from typing import Any

import structlog
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExportResult
from opentelemetry.trace import SpanContext, SpanKind, StatusCode

log = structlog.get_logger(__name__)

# Field tags: (field number << 3) | wire type (0 varint, 1 fixed64, 2 length
# delimited, 5 fixed32), of opentelemetry/proto/trace/v1/trace.proto and
# common/v1/common.proto.
_REQUEST_RESOURCE_SPANS = b"\x0a"
_RESOURCE_SPANS_SCOPE_SPANS = b"\x12"
_SCOPE_SPANS_SPANS = b"\x12"
_TRACE_ID = b"\x0a\x10"  # a span's and a link's, with its length, 16
_SPAN_ID = b"\x12\x08"  # a span's and a link's, with its length, 8
_SPAN_TRACE_STATE = b"\x1a"
_SPAN_PARENT_SPAN_ID = b"\x22\x08"
_SPAN_NAME = b"\x2a"
_SPAN_KIND = b"\x30"
_SPAN_TIMES = struct.Struct("<BQBQ")  # start (7, fixed64), end (8, fixed64)
_SPAN_ATTRIBUTE = b"\x4a"
_SPAN_DROPPED_ATTRIBUTES = b"\x50"
_SPAN_EVENT = b"\x5a"
_SPAN_DROPPED_EVENTS = b"\x60"
_SPAN_LINK = b"\x6a"
_SPAN_DROPPED_LINKS = b"\x70"
_SPAN_STATUS = b"\x7a"
_SPAN_FLAGS = b"\x85\x01"  # field 16, fixed32
_STATUS_MESSAGE = b"\x12"
_STATUS_CODE = b"\x18"
_EVENT_TIME = b"\x09"
_EVENT_NAME = b"\x12"
_EVENT_ATTRIBUTE = b"\x1a"
_EVENT_DROPPED_ATTRIBUTES = b"\x20"
_LINK_ATTRIBUTE = b"\x22"
_LINK_DROPPED_ATTRIBUTES = b"\x28"
_LINK_FLAGS = b"\x35"
_KEY_VALUE_KEY = b"\x0a"
_KEY_VALUE_VALUE = b"\x12"
_STRING_VALUE = b"\x0a"
_BOOL_TRUE, _BOOL_FALSE = b"\x02\x10\x01", b"\x02\x10\x00"  # AnyValue{bool_value}, with its length
_INT_VALUE = b"\x18"
_DOUBLE_VALUE = struct.Struct("<Bd")  # field 4, fixed64

# SpanFlags (trace.proto): whether the parent's (a link's) is_remote is known, and is true.
_HAS_IS_REMOTE, _IS_REMOTE = 0x100, 0x200
_FLAGS = {False: struct.pack("<I", _HAS_IS_REMOTE), True: struct.pack("<I", _HAS_IS_REMOTE | _IS_REMOTE)}
# The proto's kinds are the API's + 1 (0 is its "unspecified").
_KINDS = {kind: _SPAN_KIND + bytes((kind.value + 1,)) for kind in SpanKind}
# A status without a description: its code alone (none for unset).
_STATUSES = {
    code: _SPAN_STATUS + (b"\x00" if not code.value else b"\x02" + _STATUS_CODE + bytes((code.value,)))
    for code in StatusCode
}
_INT64 = (-(2**63), 2**63 - 1)
# Attribute keys and span names recur in every span: their encoded field
# kept, if short (bounded: a handler could name spans after its data).
_KEPT_MAX, _KEPT_LONGEST = 4096, 256


class _Unusual(Exception):
    """A span this module does not write: the SDK's encoder does."""


def _varint(value: int) -> bytes:
    if value < 0x80:
        return _SMALL[value]
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


_SMALL = [bytes((i,)) for i in range(0x80)]


def _field(tag: bytes, payload: bytes) -> bytes:
    return tag + _varint(len(payload)) + payload


def _kept(cache: dict[str, bytes], tag: bytes, text: str) -> bytes:
    """``text``'s field (none for "", as proto3 writes it), written once."""
    encoded = cache.get(text)
    if encoded is None:
        encoded = _field(tag, text.encode()) if text else b""
        if len(text) <= _KEPT_LONGEST:
            if len(cache) >= _KEPT_MAX:
                cache.clear()
            cache[text] = encoded
    return encoded


_keys: dict[str, bytes] = {}
_names: dict[str, bytes] = {}


def _value(value: Any) -> bytes:
    """An attribute's AnyValue message, with its length (the SDK's
    ``_encode_value`` order: bool before str before int before float)."""
    if isinstance(value, bool):
        return _BOOL_TRUE if value else _BOOL_FALSE
    if isinstance(value, str):
        return _field(b"", _field(_STRING_VALUE, value.encode()))
    if isinstance(value, int):
        if not _INT64[0] <= value <= _INT64[1]:
            raise _Unusual
        return _field(b"", _INT_VALUE + _varint(value & 0xFFFFFFFFFFFFFFFF))
    if isinstance(value, float):
        return b"\x09" + _DOUBLE_VALUE.pack(0x21, value)
    raise _Unusual  # None, bytes, a sequence, a mapping: the SDK's encoder


def _attributes(tag: bytes, attributes: Mapping[str, Any] | None) -> list[bytes]:
    """Each attribute's KeyValue field. A short string or a small int, what
    nearly every attribute holds, is written in one step (every length one
    byte); anything else by :func:`_value`."""
    if not attributes:
        return []
    out = []
    for key, value in attributes.items():
        head = _keys.get(key)
        if head is None:
            head = _kept(_keys, _KEY_VALUE_KEY, key)
        kind = type(value)
        if kind is str:
            text = value.encode()
            size = len(head) + len(text) + 4
            if size < 0x80:  # every varint one byte
                # KeyValue.value (0x12), its length; AnyValue.string_value (0x0A), its length
                out.append(tag + _SMALL[size] + head + bytes((0x12, len(text) + 2, 0x0A, len(text))) + text)
                continue
        elif kind is int and 0 <= value < 0x80 and len(head) + 4 < 0x80:
            # KeyValue.value (0x12), its length; AnyValue.int_value (0x18), one byte
            out.append(tag + _SMALL[len(head) + 4] + head + bytes((0x12, 2, 0x18, value)))
            continue
        out.append(_field(tag, head + _KEY_VALUE_VALUE + _value(value)))
    return out


def _count(tag: bytes, count: int) -> bytes:
    return tag + _varint(count) if count else b""


def _trace_state(tag: bytes, trace_state: Any) -> bytes:
    if not trace_state:
        return b""
    return _field(tag, ",".join(f"{key}={value}" for key, value in trace_state.items()).encode())


def _event(event: Any) -> bytes:
    return _field(
        _SPAN_EVENT,
        b"".join((
            _EVENT_TIME + struct.pack("<Q", event.timestamp) if event.timestamp else b"",
            _field(_EVENT_NAME, event.name.encode()) if event.name else b"",
            *_attributes(_EVENT_ATTRIBUTE, event.attributes),
            _count(_EVENT_DROPPED_ATTRIBUTES, event.dropped_attributes),
        )),
    )  # fmt: skip


def _ids(context: SpanContext) -> bytes:
    """A span's (or a link's: fields 1 and 2 of both) trace id and span id."""
    return _TRACE_ID + context.trace_id.to_bytes(16, "big") + _SPAN_ID + context.span_id.to_bytes(8, "big")


def _link(link: Any) -> bytes:
    context = link.context
    return _field(
        _SPAN_LINK,
        b"".join((
            _ids(context),
            # No trace_state: the SDK's encoder writes none for a link.
            *_attributes(_LINK_ATTRIBUTE, link.attributes),
            _count(_LINK_DROPPED_ATTRIBUTES, link.dropped_attributes),
            _LINK_FLAGS + _FLAGS[bool(context.is_remote)],
        )),
    )  # fmt: skip


def _status(status: Any) -> bytes:
    if status is None:
        return b""
    message = status.description
    if not message:
        return _STATUSES[status.status_code]
    code = status.status_code.value
    code_field = _STATUS_CODE + _varint(code) if code else b""
    return _field(_SPAN_STATUS, _field(_STATUS_MESSAGE, message.encode()) + code_field)


def _span(span: Any) -> bytes:
    """One span's message, with its tag and length; _Unusual if it holds
    what this module does not write."""
    context = span.get_span_context()
    parent = span.parent
    return _field(
        _SCOPE_SPANS_SPANS,
        b"".join((
            _ids(context),
            _trace_state(_SPAN_TRACE_STATE, context.trace_state),
            _SPAN_PARENT_SPAN_ID + parent.span_id.to_bytes(8, "big") if parent else b"",
            _kept(_names, _SPAN_NAME, span.name),
            _KINDS[span.kind],
            _times(span.start_time, span.end_time),
            *_attributes(_SPAN_ATTRIBUTE, span.attributes),
            _count(_SPAN_DROPPED_ATTRIBUTES, span.dropped_attributes),
            *map(_event, span.events),
            _count(_SPAN_DROPPED_EVENTS, span.dropped_events),
            *map(_link, span.links),
            _count(_SPAN_DROPPED_LINKS, span.dropped_links),
            _status(span.status),
            _SPAN_FLAGS + _FLAGS[parent is not None and parent.is_remote],
        )),
    )  # fmt: skip


def _times(start: int | None, end: int | None) -> bytes:
    if start and end:
        return _SPAN_TIMES.pack(0x39, start, 0x41, end)
    return (b"\x39" + struct.pack("<Q", start) if start else b"") + (
        b"\x41" + struct.pack("<Q", end) if end else b""
    )


def _unwritten(span: Any) -> Any:
    """A span :func:`_span` does not write: kept in its place, for the SDK's
    encoder to write with its group's ends (tests refuse it where every span
    must be written here)."""
    return span


def _resource_spans(resource: Any, scopes: dict[Any, list[Any]]) -> bytes:
    """One resource's ``ResourceSpans`` field. Its resource and scopes, and
    the spans not written here, are the SDK encoder's, from one call per
    resource and batch: a bare span per scope first (whose ends are taken),
    then that scope's unwritten spans, in their order (as many encodings of
    the resource, and as many of its log lines, as the SDK's own)."""
    bare: list[Any] = []
    for scope, entries in scopes.items():
        bare.append(ReadableSpan(name="", context=_BARE, resource=resource, instrumentation_scope=scope))
        bare.extend(entry for entry in entries if not isinstance(entry, bytes))
    resource_spans = encode_spans(bare).resource_spans[0]
    scope_fields = []
    for (_scope, entries), scope_spans in zip(scopes.items(), resource_spans.scope_spans, strict=True):
        by_sdk = iter(scope_spans.spans[1:])  # after the bare span, the unwritten, in order
        written = [
            entry
            if isinstance(entry, bytes)
            else _field(_SCOPE_SPANS_SPANS, next(by_sdk).SerializePartialToString())
            for entry in entries
        ]
        scope_fields.append(_field(_RESOURCE_SPANS_SCOPE_SPANS, b"".join((
            ScopeSpans(scope=scope_spans.scope).SerializePartialToString(),
            *written,
            ScopeSpans(schema_url=scope_spans.schema_url).SerializePartialToString(),
        ))))  # fmt: skip
    return _field(_REQUEST_RESOURCE_SPANS, b"".join((
        ResourceSpans(resource=resource_spans.resource).SerializePartialToString(),
        *scope_fields,
        ResourceSpans(schema_url=resource_spans.schema_url).SerializePartialToString(),
    )))  # fmt: skip


_BARE = SpanContext(1, 1, is_remote=False)


def encoded(spans: Sequence[Any]) -> bytes:
    """The serialized ``ExportTraceServiceRequest`` of ``spans`` (the SDK's
    ReadableSpans): grouped by resource, then by instrumentation scope, in
    the order first seen, each group's resource and scope the first seen
    of those equal to it, as the SDK's encoder groups them (dict keys)."""
    groups: dict[Any, dict[Any, list[Any]]] = {}
    last_resource = last_scope = bucket = None
    for span in spans:
        resource, scope = span.resource, span.instrumentation_scope or None
        if bucket is None or resource is not last_resource or scope is not last_scope:
            # A batch's spans share one or a few groups: hashed when it changes.
            bucket = groups.setdefault(resource, {}).setdefault(scope, [])
            last_resource, last_scope = resource, scope
        try:
            bucket.append(_span(span))
        except Exception:  # noqa: BLE001 - anything it does not write, the SDK writes (or refuses, as it would)
            bucket.append(_unwritten(span))
    return b"".join(_resource_spans(resource, scopes) for resource, scopes in groups.items())


class SpanExporter(OTLPSpanExporter):
    """The SDK's OTLP/HTTP span exporter (its settings, its HTTP client, its
    retries and its own metrics), sending :func:`encoded`'s bytes; its
    ``export`` step for step, the encoding aside. Without the SDK's parts
    this relies on, the SDK's own ``export``."""

    def __init__(self, **settings: Any) -> None:
        super().__init__(**settings)
        # The SDK exporter's private parts: checked once, so that a release
        # that moves them exports the SDK's way, not broken.
        self._wired = (
            callable(getattr(getattr(self, "_client", None), "export", None))
            and callable(getattr(getattr(self, "_metrics", None), "export_operation", None))
            and isinstance(getattr(self, "_max_request_size", None), int)
            and isinstance(getattr(self, "_shutdown", None), bool)
        )

    def export(self, spans: Sequence[Any]) -> SpanExportResult:
        if self._shutdown or not self._wired:
            return super().export(spans)  # a shut-down exporter: the SDK's warning
        # The encoding inside the SDK's export metrics, as the SDK counts it.
        with self._metrics.export_operation(len(spans)) as result:
            try:
                data = encoded(spans)
            except Exception as exc:  # noqa: BLE001 - what the SDK's encoder refused: a failed export, as the SDK's
                # Its type only: the text can hold a handler's attribute values.
                log.warning("tracing_failed", step="span encoding", error=type(exc).__name__)
                result.error = exc
                return SpanExportResult.FAILURE
            if 0 < self._max_request_size < len(data):
                log.warning("tracing_failed", step="span export", spans=len(spans),
                            error=f"the request is {len(data)} bytes, over max_request_size"
                            f" ({self._max_request_size}): dropped")  # fmt: skip
                result.error = _TooLarge(f"{len(data)} bytes over max_request_size {self._max_request_size}")
                return SpanExportResult.FAILURE
            sent = self._client.export(data)  # retries, backoff and their logs: the SDK's
            if not sent.success:
                result.error = sent.error
                if sent.status_code is not None:
                    result.error_attrs = {"http.response.status_code": sent.status_code}
                return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS


def _too_large() -> type[Exception]:
    """The SDK's error for a request over its size limit, as its metrics name
    it (ValueError if a release moves it)."""
    try:
        from opentelemetry.exporter.otlp.proto.http._common import RequestPayloadTooLargeError
    except ImportError:
        return ValueError
    return RequestPayloadTooLargeError


_TooLarge = _too_large()
