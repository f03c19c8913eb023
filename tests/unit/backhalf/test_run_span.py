"""backhalf.run_span: a run span made without the SDK tracer's machinery is
exported exactly as the SDK tracer's span would be (the same OTLP request,
clock and ids held equal), whatever the sampler, the todo's context, the
run's outcome or what the handler does with the current span; and where it
cannot be told apart no longer (a processor added to the provider, span
limits that cut values), the SDK's tracer makes the span."""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk import trace as sdk_trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_OFF,
    ALWAYS_ON,
    DEFAULT_ON,
    Decision,
    Sampler,
    SamplingResult,
    TraceIdRatioBased,
)
from opentelemetry.trace import StatusCode

from backhalf import run_span, tracing

TRACE, SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
SAMPLED = f'{{"traceparent": "00-{TRACE}-{SPAN}-01"}}'
UNSAMPLED = f'{{"traceparent": "00-{TRACE}-{SPAN}-00"}}'
WITH_STATE = f'{{"traceparent": "00-{TRACE}-{SPAN}-01", "tracestate": "rojo=00f067aa0ba902b7,congo=t61"}}'
CONTEXTS = {"sampled": SAMPLED, "unsampled": UNSAMPLED, "tracestate": WITH_STATE, "none": None}


class _Counting(IdGenerator):
    """Ids in sequence, so that the two ways of making a span get the same ones."""

    def __init__(self, random: bool) -> None:
        self._next, self._random = itertools.count(1), random

    def generate_span_id(self) -> int:
        return next(self._next)

    def generate_trace_id(self) -> int:
        return next(self._next) << 64

    def is_trace_id_random(self) -> bool:
        return self._random


class _Annotating(Sampler):
    """A sampler that adds an attribute of its own (and one the SDK refuses)."""

    def should_sample(
        self, parent_context: Any, trace_id: int, name: str, *args: Any, **kwargs: Any
    ) -> SamplingResult:
        attributes = dict(kwargs.get("attributes") or args[1] or {})
        attributes |= {"sampler.said": "yes", "sampler.refused": object()}
        return SamplingResult(Decision.RECORD_AND_SAMPLE, attributes)

    def get_description(self) -> str:
        return "annotating"


SAMPLERS: dict[str, Sampler] = {
    "parent-based": DEFAULT_ON,
    "always-on": ALWAYS_ON,
    "always-off": ALWAYS_OFF,
    "ratio": TraceIdRatioBased(0.5),
    "annotating": _Annotating(),
}


def _handler_nothing() -> None:
    pass


def _handler_annotates() -> None:
    current = trace.get_current_span()
    current.set_attribute("order.id", "o-17")
    current.set_attribute("refused", object())  # type: ignore[arg-type]  # the SDK drops it, with a warning
    current.add_event("looked up", {"rows": 3})


def _handler_child_span() -> None:
    with trace.get_tracer("handler").start_as_current_span("handler call") as child:
        child.set_attribute("http.response.status_code", 200)


def _handler_everything() -> None:
    current = trace.get_current_span()
    current.update_name("renamed by the handler")
    current.set_status(StatusCode.OK)
    current.record_exception(ValueError("seen and handled"), {"extra": 1}, timestamp=5)
    current.add_link(trace.SpanContext(7, 8, is_remote=True), {"why": "fan-in"})
    current.set_attributes({"a": 1, "b": 2.5, "c": True})


HANDLERS: dict[str, Callable[[], None]] = {
    "nothing": _handler_nothing,
    "annotates": _handler_annotates,
    "child span": _handler_child_span,
    "everything": _handler_everything,
}


_CLOCK = [itertools.count()]


@pytest.fixture
def fixed_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """One clock for the SDK's spans and the run spans, each reading a step
    on, from the same time at each run's start (:func:`_run`)."""
    monkeypatch.setattr(sdk_trace, "time_ns", lambda: next(_CLOCK[0]))
    monkeypatch.setattr(run_span, "time_ns", lambda: next(_CLOCK[0]))


def _run(
    lean: bool,
    sampler: Sampler,
    context: str | None,
    handler: Callable[[], None],
    outcome: tuple[str, str | None, str | None],
    random_ids: bool = True,
    limits: SpanLimits | None = None,
) -> tuple[list[ReadableSpan], Any, bool]:
    """One traced run on a provider of its own; what it exported, the span
    the handler saw as current and whether it was recording then."""
    _CLOCK[0] = itertools.count(1_700_000_000_000_000_000, 1000)
    exporter = InMemorySpanExporter()
    provider = TracerProvider(
        sampler=sampler,
        resource=Resource.create({"service.name": "test"}),
        id_generator=_Counting(random_ids),
        span_limits=limits or SpanLimits(),
    )
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    made = tracing._Tracing(provider)
    if not lean:
        made.run_spans = None
    seen: list[Any] = []
    saved, tracing._tracing = tracing._tracing, made
    # The handler's own tracer is the global provider's: this one, for the run.
    saved_provider = trace._TRACER_PROVIDER
    trace._TRACER_PROVIDER = provider
    try:
        with tracing.run_span(todo_id=41, queue="orders", attempt=2, context=context) as run:
            current = trace.get_current_span()
            seen.append((current, current.is_recording()))
            handler()
            run.ended(*outcome)
    finally:
        tracing._tracing = saved
        trace._TRACER_PROVIDER = saved_provider
        provider.shutdown()
    return list(exporter.get_finished_spans()), *seen[0]


def _request(spans: list[ReadableSpan]) -> bytes:
    request: bytes = encode_spans(spans).SerializePartialToString()
    return request


OUTCOMES = {
    "done": ("done", None, None),
    "retry": ("retry", "ValueError", "ValueError: boom"),
}


@pytest.mark.parametrize("outcome", OUTCOMES)
@pytest.mark.parametrize("handler", HANDLERS)
@pytest.mark.parametrize("context", CONTEXTS)
@pytest.mark.parametrize("sampler", SAMPLERS)
@pytest.mark.usefixtures("fixed_clock")
def test_a_run_span_is_exported_as_the_sdks_would_be(
    sampler: str, context: str, handler: str, outcome: str
) -> None:
    args = (SAMPLERS[sampler], CONTEXTS[context], HANDLERS[handler], OUTCOMES[outcome])
    sdk, sdk_current, recording = _run(False, *args)
    lean, lean_current, lean_recording = _run(True, *args)
    assert _request(lean) == _request(sdk)
    assert [s.name for s in lean] == [s.name for s in sdk]
    assert lean_current.get_span_context() == sdk_current.get_span_context()
    assert lean_recording == recording
    # The lean span was the one made (not the SDK's, by a fallback), and a
    # handler that touched it made it the SDK's from then on.
    assert isinstance(lean_current, run_span.RunSpan) == recording
    if recording:
        touched = handler in ("annotates", "everything") or outcome == "retry" or sampler == "annotating"
        assert (lean_current._sdk is not None) == touched


@pytest.mark.usefixtures("fixed_clock")
def test_the_run_span_is_the_handlers_spans_parent() -> None:
    spans, current, _ = _run(True, ALWAYS_ON, SAMPLED, _handler_child_span, OUTCOMES["done"])
    child, run = spans
    assert isinstance(current, run_span.RunSpan)
    assert child.parent == run.context
    assert run.parent is not None
    assert (run.parent.trace_id, run.parent.span_id) == (int(TRACE, 16), int(SPAN, 16))
    assert run.attributes == {
        "messaging.destination.name": "orders",
        "messaging.message.id": "41",
        "switchboard.todo.attempt": 2,
        "switchboard.run.outcome": "done",
    }


@pytest.mark.parametrize("random_ids", [True, False])
@pytest.mark.usefixtures("fixed_clock")
def test_a_root_runs_flags_are_the_sdks(random_ids: bool) -> None:
    sdk, sdk_current, _ = _run(False, ALWAYS_ON, None, _handler_nothing, OUTCOMES["done"], random_ids)
    lean, lean_current, _ = _run(True, ALWAYS_ON, None, _handler_nothing, OUTCOMES["done"], random_ids)
    assert lean_current.get_span_context().trace_flags == sdk_current.get_span_context().trace_flags
    assert _request(lean) == _request(sdk)


@pytest.mark.usefixtures("fixed_clock")
def test_a_run_span_ended_is_changed_by_nothing() -> None:
    spans, current, _ = _run(True, ALWAYS_ON, SAMPLED, _handler_nothing, OUTCOMES["done"])
    current.set_attribute("late", 1)
    current.end()
    assert not current.is_recording()
    assert current._sdk is None
    (run,) = spans
    assert "late" not in (run.attributes or {})


@pytest.mark.usefixtures("fixed_clock")
def test_span_limits_that_cut_values_leave_the_span_to_the_sdk() -> None:
    limits = SpanLimits(max_span_attribute_length=3)
    (run,), current, _ = _run(True, ALWAYS_ON, SAMPLED, _handler_nothing, OUTCOMES["done"], limits=limits)
    assert not isinstance(current, run_span.RunSpan)
    assert run.attributes is not None
    assert run.attributes["messaging.destination.name"] == "ord"


@pytest.mark.usefixtures("fixed_clock")
def test_a_span_limit_with_no_room_is_kept_by_the_sdks_span() -> None:
    """Three attributes allowed: the outcome is dropped and counted, as the SDK does."""
    limits = SpanLimits(max_span_attributes=3)
    args = (ALWAYS_ON, SAMPLED, _handler_nothing, OUTCOMES["done"])
    sdk, _, _ = _run(False, *args, limits=limits)
    lean, current, _ = _run(True, *args, limits=limits)
    assert isinstance(current, run_span.RunSpan)
    assert current._sdk is not None
    assert lean[0].dropped_attributes == sdk[0].dropped_attributes == 1
    assert _request(lean) == _request(sdk)


@pytest.fixture
def switched_on(monkeypatch: pytest.MonkeyPatch) -> Iterator[TracerProvider]:
    provider = TracerProvider(
        resource=Resource.create({"service.name": "test"}), id_generator=RandomIdGenerator()
    )
    provider.add_span_processor(SimpleSpanProcessor(InMemorySpanExporter()))
    monkeypatch.setattr(tracing, "_tracing", tracing._Tracing(provider))
    yield provider
    provider.shutdown()


def test_a_processor_added_later_gets_the_sdks_spans(switched_on: TracerProvider) -> None:
    """A handler module's own processor is called with the SDK's span at the
    start and its end, as it expects."""
    started: list[Any] = []

    class Watching(SimpleSpanProcessor):
        def on_start(self, span: Any, parent_context: Any = None) -> None:
            started.append(span)

    watched = InMemorySpanExporter()
    switched_on.add_span_processor(Watching(watched))
    with tracing.run_span(todo_id=1, queue="q", attempt=1, context=SAMPLED) as run:
        assert not isinstance(trace.get_current_span(), run_span.RunSpan)
        run.ended("done")
    assert [type(s) for s in started] == [sdk_trace._Span]
    (span,) = watched.get_finished_spans()
    assert span.attributes is not None
    assert span.attributes["switchboard.run.outcome"] == "done"


def test_an_sdk_without_a_part_used_here_makes_every_span(monkeypatch: pytest.MonkeyPatch) -> None:
    """A release that keeps its processors elsewhere, or has no random-id
    flag: the SDK's tracer makes every run span."""
    provider = TracerProvider()
    tracer = provider.get_tracer("switchboard")
    assert run_span.run_spans(provider, tracer) is not None
    monkeypatch.delattr(provider, "_active_span_processor")
    assert run_span.run_spans(provider, tracer) is None
    monkeypatch.undo()
    monkeypatch.delattr(trace.TraceFlags, "RANDOM_TRACE_ID")
    assert run_span.run_spans(provider, tracer) is None


# What a handler may do with the current span beyond Switchboard's own calls
# (a review's findings; each fails on the first version).


def _made(provider: TracerProvider, lean: bool = True) -> tracing._Tracing:
    made = tracing._Tracing(provider)
    if not lean:
        made.run_spans = None
    return made


@pytest.fixture
def traced(monkeypatch: pytest.MonkeyPatch) -> Any:
    """``run(handler, lean, outcome, sampler)``: the exporter and the span
    the handler saw as current, its provider the global one for the run."""
    providers: list[TracerProvider] = []

    def run(
        handler: Any, lean: bool = True, outcome: tuple[Any, ...] = ("done",), sampler: Any = None
    ) -> Any:
        exporter = InMemorySpanExporter()
        kwargs = {"sampler": sampler} if sampler is not None else {}
        provider = TracerProvider(resource=Resource.create({"service.name": "t"}), **kwargs)
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        providers.append(provider)
        monkeypatch.setattr(tracing, "_tracing", _made(provider, lean))
        monkeypatch.setattr(trace, "_TRACER_PROVIDER", provider)
        with tracing.run_span(todo_id=41, queue="orders", attempt=2, context=SAMPLED) as r:
            current = trace.get_current_span()
            with contextlib.suppress(Exception):  # the handler's failure is the run's, not the test's
                handler(current)
            r.ended(*outcome)
        return exporter, current

    yield run
    for provider in providers:
        provider.shutdown()


def test_a_run_span_ended_again_is_exported_once(traced: Any) -> None:
    exporter, current = traced(lambda span: None)
    current.end()
    current.end(123)
    assert len(exporter.get_finished_spans()) == 1  # read after the extra ends, not before


def test_a_span_the_handler_ended_is_exported_as_ended(traced: Any) -> None:
    """Nothing after the end reaches the exported span (its attributes are the exported dict)."""
    (sdk,) = traced(lambda span: span.end(), lean=False)[0].get_finished_spans()
    (lean,) = traced(lambda span: span.end())[0].get_finished_spans()
    assert "switchboard.run.outcome" not in lean.attributes
    assert dict(lean.attributes) == dict(sdk.attributes)


def test_an_explicit_end_time_is_kept(traced: Any) -> None:
    exporter, _ = traced(lambda span: span.end(end_time=span._start + 5))
    (span,) = exporter.get_finished_spans()
    assert span.end_time == span.start_time + 5


def test_a_touched_span_ended_is_not_recording(traced: Any) -> None:
    _, current = traced(lambda span: span.set_attribute("a", 1))
    assert isinstance(current, run_span.RunSpan)
    assert current._sdk is not None
    assert not current.is_recording()


def test_a_disabled_tracer_gets_the_sdks_non_recording_span(monkeypatch: pytest.MonkeyPatch) -> None:
    provider = TracerProvider()
    made = _made(provider)
    provider._set_tracer_configurator(tracer_configurator=sdk_trace._disable_tracer_configurator)
    monkeypatch.setattr(tracing, "_tracing", made)
    with tracing.run_span(todo_id=1, queue="q", attempt=1, context=SAMPLED):
        current = trace.get_current_span()
        assert not isinstance(current, run_span.RunSpan)
        assert not current.is_recording()
    provider.shutdown()


def test_sdk_metrics_on_leave_every_run_span_to_the_sdk(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED", "true")
    provider = TracerProvider()
    assert run_span.run_spans(provider, provider.get_tracer("switchboard")) is None
    provider.shutdown()


def test_the_current_span_reads_as_the_sdks(traced: Any) -> None:
    """What a handler may read of the SDK's span: its ReadableSpan properties."""
    seen: dict[str, Any] = {}

    def handler(span: Any) -> None:
        seen.update(name=span.name, attributes=dict(span.attributes), kind=span.kind, parent=span.parent)

    traced(handler)
    assert seen["name"] == "switchboard run"
    assert seen["attributes"]["messaging.message.id"] == "41"


def test_the_current_span_as_a_context_manager_records_the_error(traced: Any) -> None:
    def handler(span: Any) -> None:
        with span:
            raise ValueError("boom")

    (sdk,) = traced(handler, lean=False)[0].get_finished_spans()
    (lean,) = traced(handler)[0].get_finished_spans()
    assert [e.name for e in lean.events] == [e.name for e in sdk.events] == ["exception"]
    assert lean.status.status_code == sdk.status.status_code


def test_a_handler_thread_touching_the_span_while_the_run_fails(
    traced: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The handler's thread makes the SDK span; a preemption before it is kept
    (forced here) lets the run's own error event and status go elsewhere."""
    go, threads = threading.Event(), []
    made = run_span.RunSpans._recorded

    def recorded(self: Any, span: Any) -> Any:
        sdk = made(self, span)
        if threading.current_thread() is not threading.main_thread():
            go.wait(5)
        return sdk

    monkeypatch.setattr(run_span.RunSpans, "_recorded", recorded)

    def handler(span: Any) -> None:
        thread = threading.Thread(target=span.set_attribute, args=("order.id", "o-17"))
        thread.start()
        threads.append(thread)
        raise ValueError("boom")

    original_set_status = run_span.RunSpan.set_status

    def set_status_then_release(self: Any, *args: Any) -> None:  # after Run.ended's event and status
        original_set_status(self, *args)
        go.set()
        threads[0].join()

    outcome = ("retry", "ValueError", "ValueError: boom")
    monkeypatch.setattr(run_span.RunSpan, "set_status", set_status_then_release)
    exporter, current = traced(handler, outcome=outcome)
    (span,) = exporter.get_finished_spans()
    assert span.attributes["switchboard.run.outcome"] == "retry"
    assert span.status.status_code.name == "ERROR"
    assert span.attributes["order.id"] == "o-17"
    assert not current.is_recording()


class _Rewriting(Sampler):
    """The same keys, one value the SDK's attribute check converts."""

    def should_sample(
        self,
        parent_context: Any,
        trace_id: int,
        name: str,
        kind: Any = None,
        attributes: Any = None,
        links: Any = None,
        trace_state: Any = None,
    ) -> SamplingResult:
        refused: Any = {2}  # no attribute value: the SDK's check converts it
        return SamplingResult(Decision.RECORD_AND_SAMPLE, {**attributes, "switchboard.todo.attempt": refused})

    def get_description(self) -> str:
        return "rewriting"


def test_a_sampler_rewriting_a_value_gets_the_sdks_check(traced: Any) -> None:
    (sdk,) = traced(lambda span: None, lean=False, sampler=_Rewriting())[0].get_finished_spans()
    (lean,) = traced(lambda span: None, sampler=_Rewriting())[0].get_finished_spans()
    assert dict(lean.attributes) == dict(sdk.attributes)
