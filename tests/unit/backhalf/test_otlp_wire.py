"""backhalf.otlp_wire: the bytes it writes for an export are the SDK's
encoder's, byte for byte, whatever the spans hold (what it does not write
itself it takes from the SDK's encoder); and its exporter delivers them to a
real OTLP/HTTP endpoint over loopback (the suite's collector, which decodes
them with OpenTelemetry's own protobuf classes)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import (
    Link,
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    TraceState,
    set_span_in_context,
)

from backhalf import otlp_wire, tracing
from ingest.embedded.otlp_collector import Collector, decode

TRACE, SPAN = 0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7


def _provider(service: str) -> tuple[TracerProvider, InMemorySpanExporter]:
    kept = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": service, "n": 1}))
    provider.add_span_processor(SimpleSpanProcessor(kept))
    return provider, kept


def _remote_parent(state: Sequence[tuple[str, str]] = ()) -> Any:
    context = SpanContext(
        TRACE, SPAN, is_remote=True, trace_flags=TraceFlags(1), trace_state=TraceState(state)
    )
    return set_span_in_context(NonRecordingSpan(context))


def _assert_the_sdks(spans: Sequence[ReadableSpan]) -> None:
    assert otlp_wire.encoded(spans) == encode_spans(spans).SerializePartialToString()


def _varied_spans() -> list[ReadableSpan]:
    """Switchboard's spans as its tracing makes them, and a handler's."""
    ours, ours_kept = _provider("switchboard-worker")
    theirs, theirs_kept = _provider("orders")
    tracer = ours.get_tracer("switchboard")
    for attempt, outcome in ((1, "done"), (3, "failed")):
        span = tracer.start_span(
            "switchboard run",
            context=_remote_parent([("rojo", "00f067aa0ba902b7"), ("congo", "t61rcWkgMzE")]),
            kind=SpanKind.CONSUMER,
            attributes={"messaging.destination.name": "orders", "messaging.message.id": "42",
                        "switchboard.todo.attempt": attempt},
        )  # fmt: skip
        span.set_attribute("switchboard.run.outcome", outcome)
        if outcome == "failed":
            span.add_event("exception", {"exception.type": "KeyError", "exception.message": "'sku' " * 60})
            span.set_status(Status(StatusCode.ERROR, "KeyError"))
        span.end()
    links = [Link(SpanContext(TRACE + i, SPAN + i, is_remote=True)) for i in range(3)]
    tracer.start_span(
        "switchboard ingest", links=links, attributes={"messaging.batch.message_count": 3}
    ).end()
    receive = tracer.start_span(
        "switchboard receive", kind=SpanKind.SERVER, attributes={"url.path": "/hooks/é"}
    )
    receive.set_status(Status(StatusCode.OK))
    receive.end()
    handler = theirs.get_tracer("orders.handler", "2.1", schema_url="https://opentelemetry.io/schemas/1.26.0")
    with handler.start_as_current_span(
        "charge", attributes={"amount": 12.5, "retried": False, "ok": True}
    ) as span:
        span.add_event("", {})
        span.add_link(SpanContext(TRACE, SPAN + 9, is_remote=False), {"why": "retry of", "n": -7})
    return [*ours_kept.get_finished_spans(), *theirs_kept.get_finished_spans()]


def test_the_bytes_are_the_sdks_for_switchboards_spans_and_a_handlers() -> None:
    spans = _varied_spans()
    _assert_the_sdks(spans)
    _assert_the_sdks(spans[::-1])  # groups in the order first seen
    _assert_the_sdks(spans[:1])


def test_a_span_holding_what_the_module_does_not_write_is_the_sdks_own_encoding() -> None:
    provider, kept = _provider("orders")
    tracer = provider.get_tracer("orders.handler")
    tracer.start_span("plain", attributes={"a": "b"}).end()
    tracer.start_span("arrays", attributes={"skus": ("a", "b"), "sizes": (1, 2), "raw": b"\x00\x01"}).end()
    tracer.start_span("beyond int64", attributes={"n": 2**64}).end()  # the SDK drops it, and logs
    _assert_the_sdks(kept.get_finished_spans())


scalars = st.one_of(
    st.text(max_size=300),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(allow_nan=False),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.text(max_size=200),
    kind=st.sampled_from(list(SpanKind)),
    attributes=st.dictionaries(st.text(min_size=1, max_size=150), scalars, max_size=6),
    event_attributes=st.dictionaries(st.text(min_size=1, max_size=20), scalars, max_size=3),
    status=st.sampled_from(
        [None, Status(StatusCode.OK), Status(StatusCode.ERROR, "boom ✗"), Status(StatusCode.ERROR)]
    ),
    remote=st.booleans(),
)
def test_any_spans_scalars_are_written_as_the_sdk_writes_them(
    name: str,
    kind: SpanKind,
    attributes: dict[str, Any],
    event_attributes: dict[str, Any],
    status: Status | None,
    remote: bool,
) -> None:
    provider, kept = _provider("orders")
    parent = _remote_parent() if remote else None
    span = provider.get_tracer("t").start_span(name, context=parent, kind=kind, attributes=attributes)
    span.add_event("e", event_attributes)
    if status is not None:
        span.set_status(status)
    span.end()
    _assert_the_sdks(kept.get_finished_spans())


def test_a_nan_attribute_is_written_as_the_sdk_writes_it() -> None:
    provider, kept = _provider("orders")
    provider.get_tracer("t").start_span("n", attributes={"nan": math.nan, "inf": -math.inf}).end()
    _assert_the_sdks(kept.get_finished_spans())


@pytest.fixture
def collector() -> Iterator[Collector]:
    with Collector() as running:
        yield running


@pytest.fixture
def exporters() -> Iterator[Callable[..., otlp_wire.SpanExporter]]:
    """Exporters made as the test asks, shut down after it."""
    made: list[otlp_wire.SpanExporter] = []

    def make(endpoint: str, **settings: Any) -> otlp_wire.SpanExporter:
        made.append(otlp_wire.SpanExporter(endpoint=f"{endpoint}/v1/traces", **settings))
        return made[-1]

    yield make
    for exporter in made:
        exporter.shutdown()  # type: ignore[no-untyped-call]  # the SDK's, unannotated


def test_the_exporter_delivers_the_spans_to_a_real_collector(
    collector: Collector, exporters: Callable[..., otlp_wire.SpanExporter]
) -> None:
    spans = _varied_spans()
    exporter = exporters(collector.endpoint)
    assert exporter._wired  # the SDK's client, as this module relies on it
    assert exporter.export(spans) is SpanExportResult.SUCCESS
    received = collector.wait_for(lambda got: len(got) == len(spans), timeout_s=10)
    assert received == decode(encode_spans(spans).SerializePartialToString())


def test_without_the_sdks_client_the_sdk_exports(
    collector: Collector, exporters: Callable[..., otlp_wire.SpanExporter]
) -> None:
    spans = _varied_spans()
    exporter = exporters(collector.endpoint)
    exporter._wired = False  # as if a release had moved what this module relies on
    assert exporter.export(spans) is SpanExportResult.SUCCESS
    assert collector.wait_for(lambda got: len(got) == len(spans), timeout_s=10)


def test_a_request_over_the_size_limit_is_dropped_as_the_sdk_drops_it(
    collector: Collector, exporters: Callable[..., otlp_wire.SpanExporter]
) -> None:
    exporter = exporters(collector.endpoint, max_request_size=64)
    assert exporter.export(_varied_spans()) is SpanExportResult.FAILURE
    assert collector.exports == 0


def test_a_collector_that_refuses_is_a_failed_export(
    collector: Collector, exporters: Callable[..., otlp_wire.SpanExporter]
) -> None:
    exporter = exporters(f"{collector.endpoint}/elsewhere", timeout=2)  # a 404
    assert exporter.export(_varied_spans()) is SpanExportResult.FAILURE
    assert collector.exports == 0


def test_tracing_exports_with_this_exporter(monkeypatch: pytest.MonkeyPatch, collector: Collector) -> None:
    for key, value in collector.env().items():
        monkeypatch.setenv(key, value)
    provider = tracing._provider("worker", collector.env())
    try:
        processors = provider._active_span_processor._span_processors
        assert [type(p._batch_processor._exporter) for p in processors] == [otlp_wire.SpanExporter]
    finally:
        provider.shutdown()


def test_switchboards_spans_and_a_handlers_scalars_are_written_here(monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(span: ReadableSpan) -> bytes:
        raise AssertionError(f"{span.name}: encoded by the SDK, not written here")

    monkeypatch.setattr(otlp_wire, "_sdk_span", refused)
    _assert_the_sdks(_varied_spans())
