"""The ``switchboard run`` span made without the SDK tracer's per-span
machinery while nothing can tell the difference
(docs/decisions/0041-lean-run-span.md).

The SDK's ``Tracer.start_span`` and ``Span`` cost a no-op handler's run
about 45 us alone (80 in a loaded worker): a lock, a checked attribute
mapping, two bounded lists, a processor's ``on_start`` and ``_on_ending``
for every span, then a second, readable copy at its end. A run span is
started and ended by Switchboard, holds four attributes whose keys and
types it knows, and goes to the provider Switchboard built, whose only
processors are its own batch processors (their ``on_start`` does
nothing). So :class:`RunSpans` makes it the way ``Tracer.start_span``
does (the same sampler, id generator, flags and trace state), hands the
handler a :class:`RunSpan` as the current span, and at the end gives the
processors the ``ReadableSpan`` the SDK's span would have given them: the
same export, byte for byte (``tests/unit/backhalf/test_run_span.py``).

Anything beyond that is the SDK's own span: the first time a handler (or a
failed run's error) touches the run span, it becomes an SDK ``Span`` with
what it holds so far, started at the run's start, and every call from then
on is the SDK's. The SDK's tracer makes the whole span when a processor
other than Switchboard's has been added to the provider, when span limits
would cut a value, or when this SDK release lacks a part used here.

Imported only once tracing is on (``backhalf.tracing``): it needs the
``[otel]`` extra.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from time import time_ns
from typing import Any

import structlog
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, Span
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, TraceFlags

log = structlog.get_logger(__name__)

NAME = "switchboard run"
_KIND = SpanKind.CONSUMER


class _Recorded(Span):
    """The SDK's span, for a run span a handler touched (the SDK's ``_Span``
    is this too: ``Span`` refuses to be made directly)."""


class RunSpans:
    """Run spans for one tracer of one provider (:func:`run_spans` checks
    that the SDK has the parts used here)."""

    def __init__(self, provider: Any, tracer: Any) -> None:
        self._tracer, self._sampler, self._ids = tracer, provider.sampler, provider.id_generator
        self._limits = provider._span_limits
        self._processor = provider._active_span_processor
        # The processors switch_on added: another added since (a handler
        # module's add_span_processor) gets the SDK's spans.
        self._ours = self._processor._span_processors
        self._scope = tracer._instrumentation_scope
        self._flags = {
            (sampled, random): TraceFlags(
                (TraceFlags.SAMPLED if sampled else TraceFlags.DEFAULT)
                | (TraceFlags.RANDOM_TRACE_ID if random else 0)
            )
            for sampled in (False, True)
            for random in (False, True)
        }

    def start(self, parent_context: Any, attributes: dict[str, Any]) -> Any:
        """The run's span, started now, as ``Tracer.start_span`` would make
        it (a ``NonRecordingSpan`` when the sampler drops it); None when the
        SDK's tracer is to make it."""
        if self._processor._span_processors is not self._ours or not self._tracer._is_enabled():
            return None
        parent: SpanContext | None = trace.get_current_span(parent_context).get_span_context()
        if parent is None or not parent.is_valid:
            parent = None
            trace_id = self._ids.generate_trace_id()
            random = self._ids.is_trace_id_random()
        else:
            trace_id, random = parent.trace_id, parent.trace_flags.random_trace_id
        result = self._sampler.should_sample(parent_context, trace_id, NAME, _KIND, attributes, ())
        flags = self._flags[result.decision.is_sampled(), random]
        context = SpanContext(trace_id, self._ids.generate_span_id(), False, flags, result.trace_state)
        if not result.decision.is_recording():
            return NonRecordingSpan(context)
        span = RunSpan(self, context, parent, parent_context, time_ns(), dict(result.attributes))
        limit = self._limits.max_span_attributes
        said = result.attributes
        if (
            len(said) != len(attributes)
            or any(said.get(key) is not value for key, value in attributes.items())
            or (limit is not None and len(attributes) >= limit)
        ):
            span.recorded()  # the sampler's own attributes, or no room left: the SDK's span checks them
        return span

    def _fields(self, span: RunSpan) -> dict[str, Any]:
        """What the SDK's span and its readable copy are both made of."""
        tracer = self._tracer
        return {
            "name": NAME,
            "context": span._context,
            "parent": span._parent,
            "resource": tracer.resource,
            "attributes": span._attributes,
            "kind": _KIND,
            "instrumentation_info": tracer.instrumentation_info,
            "instrumentation_scope": self._scope,
        }

    def _ended(self, span: RunSpan, end_time: int) -> ReadableSpan:
        readable = ReadableSpan(**self._fields(span), start_time=span._start, end_time=end_time)
        self._processor.on_end(readable)
        return readable

    def _recorded(self, span: RunSpan) -> Span:
        made = {"sampler": self._sampler, "span_processor": self._processor, "limits": self._limits}
        recorded = _Recorded(**self._fields(span), **made)
        recorded.start(start_time=span._start, parent_context=span._parent_context)
        return recorded


class RunSpan(trace.Span):
    """A run's span: its context, its start and Switchboard's attributes,
    until anything else is asked of it; then the SDK's span (:meth:`recorded`)."""

    def __init__(
        self,
        spans: RunSpans,
        context: SpanContext,
        parent: SpanContext | None,
        parent_context: Any,
        start: int,
        attributes: dict[str, Any],
    ) -> None:
        self._spans, self._context, self._parent = spans, context, parent
        self._parent_context, self._start, self._attributes = parent_context, start, attributes
        self._sdk: Span | None = None
        self._done = False
        self._exported: ReadableSpan | None = None
        # Its state changes (made the SDK's, kept, ended) one thread at a
        # time: a handler's threads may hold the current span.
        self._lock = threading.Lock()

    def recorded(self) -> trace.Span:
        """The SDK's span this run span is from now on (made at the first
        call); once ended, a span no call changes, as the SDK's."""
        sdk = self._sdk
        if sdk is not None:
            return sdk
        with self._lock:
            if self._sdk is None:
                if self._done:
                    return NonRecordingSpan(self._context)
                self._sdk = self._spans._recorded(self)
            return self._sdk

    def keep(self, key: str, value: str) -> None:
        """Switchboard's own attribute (a valid key and value, room kept for it at the start)."""
        with self._lock:
            if self._sdk is None:
                if not self._done:
                    self._attributes[key] = value
                return
        self._sdk.set_attribute(key, value)

    def end(self, end_time: int | None = None) -> None:
        with self._lock:
            lean = self._sdk is None and not self._done
            self._done = True
        if lean:
            self._exported = self._spans._ended(self, time_ns() if end_time is None else end_time)
        elif self._sdk is not None:
            self._sdk.end(end_time)

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        # The SDK span's: an escaping error recorded and its status set.
        if exc_val is not None and self.is_recording():
            self.recorded().__exit__(exc_type, exc_val, exc_tb)
        else:
            self.end()

    def __getattr__(self, name: str) -> Any:
        # What else the SDK's span has (its ReadableSpan side: name,
        # attributes, kind, parent, start_time, ...): the SDK span's own, or
        # the exported copy's once ended.
        if name.startswith("__") or name in ("_sdk", "_done", "_exported", "_lock"):
            raise AttributeError(name)
        source = self._sdk or self._exported or self.recorded()
        return getattr(source, name)

    def get_span_context(self) -> SpanContext:
        return self._context

    def is_recording(self) -> bool:
        return self._sdk.is_recording() if self._sdk is not None else not self._done

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        self.recorded().set_attributes(attributes)

    def set_attribute(self, key: str, value: Any) -> None:
        self.recorded().set_attribute(key, value)

    def add_event(self, name: str, attributes: Any = None, timestamp: int | None = None) -> None:
        self.recorded().add_event(name, attributes, timestamp)

    def add_link(self, context: SpanContext, attributes: Any = None) -> None:
        self.recorded().add_link(context, attributes)

    def update_name(self, name: str) -> None:
        self.recorded().update_name(name)

    def set_status(self, status: Any, description: str | None = None) -> None:
        self.recorded().set_status(status, description)

    def record_exception(
        self,
        exception: BaseException,
        attributes: Any = None,
        timestamp: int | None = None,
        escaped: bool = False,
    ) -> None:
        self.recorded().record_exception(exception, attributes, timestamp, escaped)

    def __repr__(self) -> str:
        return f'{type(self).__name__}(name="{NAME}", context={self._context})'


def run_spans(provider: Any, tracer: Any) -> RunSpans | None:
    """Lean run spans for ``tracer``, or None: the SDK's tracer makes them
    all (span limits that would cut a value, or an SDK without the parts
    used here: logged once)."""
    try:
        from opentelemetry.sdk.trace._tracer_metrics import NoOpTracerMetrics

        spans = RunSpans(provider, tracer)
        tracer._is_enabled()
        spans._ids.is_trace_id_random()
        counted = not isinstance(tracer._tracer_metrics, NoOpTracerMetrics)
    except Exception as exc:  # noqa: BLE001 - an SDK release without a part used here: the SDK's spans
        log.info("run_spans_by_sdk", reason=f"{type(exc).__name__}: this SDK lacks a part used here")
        return None
    if counted or spans._limits.max_span_attribute_length is not None:
        return None  # the SDK's own span metrics; or a limit that cuts every value to its length
    return spans
