"""backhalf.otlp_wire: the bytes it writes for an export are the SDK's
encoder's, byte for byte, whatever the spans hold (what it does not write
itself it takes from the SDK's encoder); and its exporter delivers them to a
real OTLP/HTTP endpoint over loopback (the suite's collector, which decodes
them with OpenTelemetry's own protobuf classes)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader, NumberDataPoint
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.id_generator import IdGenerator
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
keys = st.text(min_size=1, max_size=150)
trace_states = st.lists(
    st.tuples(
        st.from_regex(r"[a-z][a-z0-9_-]{0,8}", fullmatch=True),
        st.from_regex(r"[a-z0-9]{1,8}", fullmatch=True),
    ),
    max_size=3,
    unique_by=lambda member: member[0],
)
ids = st.integers(min_value=1, max_value=2**64 - 1)


class _Counting(IdGenerator):
    """Ids in sequence: a strategy may not draw from ``random``, as the SDK's generator does."""

    def __init__(self) -> None:
        self._next = itertools.count(1)

    def generate_span_id(self) -> int:
        return next(self._next)

    def generate_trace_id(self) -> int:
        return next(self._next)


@st.composite
def spans_made(draw: st.DrawFn) -> list[ReadableSpan]:
    """A batch as providers make them: one or two resources (two equal ones
    whose attributes differ in order among them), a few scopes, spans with
    any scalars, events, links (with trace states), statuses and parents,
    some over their span limits (dropped counts)."""
    limits = SpanLimits(max_attributes=draw(st.sampled_from([None, 2])), max_events=2, max_links=2)
    resources = [Resource({"service.name": "a", "k": "1"}), Resource({"k": "1", "service.name": "a"}),
                 Resource({"service.name": "b"}, schema_url="https://example.com/s")]  # fmt: skip
    kept = InMemorySpanExporter()
    providers = []
    for resource in draw(st.lists(st.sampled_from(resources), min_size=1, max_size=3)):
        provider = TracerProvider(resource=resource, span_limits=limits, id_generator=_Counting())
        provider.add_span_processor(SimpleSpanProcessor(kept))
        providers.append(provider)
    for _ in range(draw(st.integers(min_value=1, max_value=5))):
        provider = draw(st.sampled_from(providers))
        tracer = provider.get_tracer(
            draw(st.sampled_from(["s1", "s2"])), draw(st.sampled_from([None, "1.0"]))
        )
        parent = None
        if draw(st.booleans()):
            state = TraceState(draw(trace_states))
            remote = draw(st.booleans())
            context = SpanContext(
                draw(ids), draw(ids), is_remote=remote, trace_flags=TraceFlags(1), trace_state=state
            )
            parent = set_span_in_context(NonRecordingSpan(context))
        links = []
        for _ in range(draw(st.integers(min_value=0, max_value=3))):
            state = TraceState(draw(trace_states))
            context = SpanContext(draw(ids), draw(ids), is_remote=draw(st.booleans()), trace_state=state)
            links.append(Link(context, draw(st.dictionaries(keys, scalars, max_size=2))))
        span = tracer.start_span(
            draw(st.text(max_size=200)),
            context=parent,
            kind=draw(st.sampled_from(list(SpanKind))),
            attributes=draw(st.dictionaries(keys, scalars, max_size=4)),
            links=links,
        )
        for _ in range(draw(st.integers(min_value=0, max_value=3))):
            span.add_event(draw(st.text(max_size=20)), draw(st.dictionaries(keys, scalars, max_size=3)))
        status = draw(st.sampled_from([None, Status(StatusCode.OK), Status(StatusCode.ERROR, "boom ✗"),
                                       Status(StatusCode.ERROR)]))  # fmt: skip
        if status is not None:
            span.set_status(status)
        span.end()
    return list(kept.get_finished_spans())


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spans=spans_made())
def test_any_batch_of_scalars_is_written_as_the_sdk_writes_it(spans: list[ReadableSpan]) -> None:
    with pytest.MonkeyPatch.context() as patch:  # scalars only: every span written here, none by the SDK
        patch.setattr(otlp_wire, "_unwritten", _refused)
        _assert_the_sdks(spans)


def _refused(span: ReadableSpan) -> ReadableSpan:
    raise AssertionError(f"{span.name!r}: left to the SDK's encoder, not written here")


def test_what_the_sdk_leaves_out_is_left_out() -> None:
    """An empty attribute key, span name or event name (a span made by hand:
    the API refuses an empty key), a link's trace state."""
    state = TraceState([("rojo", "00f067aa0ba902b7")])
    span = ReadableSpan(
        name="",
        context=SpanContext(TRACE, SPAN, is_remote=False),
        attributes={"": "v", "k": ""},
        events=[Event("", {"": 1}, timestamp=5)],
        links=[Link(SpanContext(TRACE, SPAN + 1, is_remote=True, trace_state=state))],
        resource=Resource({}),
        start_time=1,
        end_time=2,
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(otlp_wire, "_unwritten", _refused)
        _assert_the_sdks([span])


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


def _sent_and_counted(
    exporter_class: type[OTLPSpanExporter], endpoint: str, **settings: Any
) -> tuple[SpanExportResult, dict[tuple[str, frozenset[tuple[str, Any]]], float]]:
    """What an exporter answers for a batch, and what its own metrics (the
    SDK's, switched on) then hold: each point's value (a duration's count)."""
    reader = InMemoryMetricReader()
    exporter = exporter_class(
        endpoint=f"{endpoint}/v1/traces", meter_provider=MeterProvider(metric_readers=[reader]), **settings
    )
    try:
        result = exporter.export(_varied_spans())
    finally:
        exporter.shutdown()  # type: ignore[no-untyped-call]  # the SDK's, unannotated
    counted: dict[tuple[str, frozenset[tuple[str, Any]]], float] = {}
    data = reader.get_metrics_data()
    for resource_metrics in data.resource_metrics if data is not None else ():
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                for point in metric.data.data_points:
                    value = point.value if isinstance(point, NumberDataPoint) else point.count
                    # Each exporter is numbered in its name: the rest must match.
                    named = {k: v for k, v in (point.attributes or {}).items() if k != "otel.component.name"}
                    counted[metric.name, frozenset(named.items())] = value
    return result, counted


@pytest.mark.parametrize(
    ("path", "settings"),
    [
        ("", {}),  # sent
        ("", {"max_request_size": 64}),  # over the size limit: dropped
        ("/elsewhere", {"timeout": 2}),  # the collector answers 404
    ],
)
def test_the_exporter_answers_and_counts_as_the_sdks(
    monkeypatch: pytest.MonkeyPatch, collector: Collector, path: str, settings: dict[str, Any]
) -> None:
    monkeypatch.setenv("OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED", "true")
    ours = _sent_and_counted(otlp_wire.SpanExporter, collector.endpoint + path, **settings)
    sdks = _sent_and_counted(OTLPSpanExporter, collector.endpoint + path, **settings)
    assert ours == sdks
    assert ours[1]  # the metrics were on: the comparison compared something
    assert collector.exports == (2 if ours[0] is SpanExportResult.SUCCESS else 0)


def test_a_shut_down_exporter_sends_nothing(
    collector: Collector, exporters: Callable[..., otlp_wire.SpanExporter]
) -> None:
    exporter = exporters(collector.endpoint)
    exporter.shutdown()  # type: ignore[no-untyped-call]  # the SDK's, unannotated
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
    monkeypatch.setattr(otlp_wire, "_unwritten", _refused)
    _assert_the_sdks(_varied_spans())


def test_the_encoding_is_inside_the_sdks_export_metrics(
    monkeypatch: pytest.MonkeyPatch, collector: Collector
) -> None:
    """As the SDK's export counts it: the batch in flight while it is encoded."""
    monkeypatch.setenv("OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED", "true")
    reader = InMemoryMetricReader()
    exporter = otlp_wire.SpanExporter(
        endpoint=f"{collector.endpoint}/v1/traces", meter_provider=MeterProvider(metric_readers=[reader])
    )
    in_flight: list[float] = []
    encode = otlp_wire.encoded

    def counted_then_encoded(spans: Sequence[ReadableSpan]) -> bytes:
        data = reader.get_metrics_data()
        assert data is not None
        in_flight.extend(
            point.value
            for resource_metrics in data.resource_metrics
            for scope_metrics in resource_metrics.scope_metrics
            for metric in scope_metrics.metrics
            if metric.name == "otel.sdk.exporter.span.inflight"
            for point in metric.data.data_points
            if isinstance(point, NumberDataPoint)
        )
        return encode(spans)

    monkeypatch.setattr(otlp_wire, "encoded", counted_then_encoded)
    try:
        spans = _varied_spans()
        assert exporter.export(spans) is SpanExportResult.SUCCESS
    finally:
        exporter.shutdown()  # type: ignore[no-untyped-call]  # the SDK's, unannotated
    assert in_flight == [len(spans)]
