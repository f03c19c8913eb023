"""Traces (DESIGN.md section 14): the producer's trace carried through the
store to the handler's own spans, with OpenTelemetry.

OpenTelemetry is the ``[otel]`` install extra, configured only by the
standard ``OTEL_*`` environment variables. A process switches tracing on
once at start (:func:`switch_on`); until then, and for good when the
variables ask for no exporter or the extra is not installed, nothing of
OpenTelemetry is imported, no context is read or stored, and each hot path
pays one global read (:func:`on`) per batch or run, as ``backhalf.metrics``
does.

What a trace holds:

* ``switchboard ingest``: one span per stored batch (a consumer span),
  linked to each message's context;
* ``switchboard receive``: one span per webhook delivery (a server span), a
  child of the sender's context;
* ``switchboard run``: one span per handler run (a consumer span), a child
  of the context its todo carries (``todos.trace_context``), with the todo
  id, queue, attempt and outcome; the handler's own spans are its children.

A context is W3C Trace Context: ``traceparent`` and ``tracestate``. A
``traceparent`` that is not one (:func:`carried`) is ignored and counted,
never an error for its message; a ``tracestate`` that is not one is dropped
alone, as the recommendation says. A todo keeps its message's context as
JSON (``{"traceparent": ..., "tracestate": ...}``), so a run days later,
after a crash or a retry, joins the same trace.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import structlog

log = structlog.get_logger(__name__)

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"

# W3C Trace Context, level 1: version, trace id, parent id, flags, all
# lowercase hex. A version above 00 may carry more after a dash; ff is none.
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-[!-~]*)?")
_ZERO_TRACE, _ZERO_SPAN = "0" * 32, "0" * 16
# tracestate: at most 32 list members, 512 characters is what a vendor must
# keep; printable ASCII, members split by commas.
_TRACESTATE = re.compile(r"[ -~]{0,512}")
_TRACESTATE_MEMBERS = 32

# What the variables may name (the extra ships OTLP over HTTP).
EXPORTERS = ("otlp", "console", "none")
PROTOCOLS = ("http/protobuf",)

# The span's outcome attribute of a run: what its end asked for.
OUTCOMES = ("done", "retry", "failed")


class TracingConfigError(ValueError):
    """The OTEL_* variables ask for what Switchboard cannot do."""


def carried(traceparent: str | None, tracestate: str | None = None) -> str | None:
    """The context to keep for a message, as ``todos.trace_context``'s JSON
    text: None when it carries none. Raises ValueError for a
    ``traceparent`` that is not W3C Trace Context (the caller counts it and
    goes on without); a bad ``tracestate`` is dropped alone."""
    if traceparent is None:
        return None
    traceparent = traceparent.strip()
    match = _TRACEPARENT.fullmatch(traceparent)
    if match is None:
        raise ValueError("traceparent is not version-traceid-parentid-flags in lowercase hex")
    version, trace_id, span_id, _flags, rest = match.groups()
    if version == "ff" or (version == "00" and rest is not None):
        raise ValueError(f"traceparent version {version} does not allow this form")
    if trace_id == _ZERO_TRACE or span_id == _ZERO_SPAN:
        raise ValueError("traceparent holds an all-zero id")
    # Written by hand: the traceparent is hex and dashes, nothing to escape
    # (json.dumps cost 2.7 us a message, the whole check 0.5 us).
    text = _PREFIX + traceparent[:55]
    state = (tracestate or "").strip()
    if state and _TRACESTATE.fullmatch(state) and state.count(",") < _TRACESTATE_MEMBERS:
        return f'{text}","{TRACESTATE}":{json.dumps(state)}}}'
    return text + '"}'


# What carried() writes first, and what PostgreSQL's jsonb prints of it
# without a tracestate: the traceparent is then read by slicing.
_PREFIX = '{"traceparent":"'
_PRINTED_PREFIX = '{"traceparent": "'


def _traceparent_of(text: str) -> str | None:
    """The traceparent of a kept context without parsing its JSON, when it
    holds nothing else; None otherwise (read it as JSON)."""
    for prefix in (_PREFIX, _PRINTED_PREFIX):
        if text.startswith(prefix) and len(text) == len(prefix) + 57:
            return text[len(prefix) : len(prefix) + 55]
    return None


def wanted(env: Mapping[str, str]) -> bool:
    """The variables ask for traces: an exporter named, or an OTLP endpoint
    given, and the SDK not disabled. Raises TracingConfigError for what the
    extra cannot do (a gRPC endpoint, an unknown exporter)."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporters = [e.strip().lower() for e in env.get("OTEL_TRACES_EXPORTER", "").split(",") if e.strip()]
    unknown = sorted(set(exporters) - set(EXPORTERS))
    if unknown:
        raise TracingConfigError(
            f"OTEL_TRACES_EXPORTER={','.join(exporters)}: Switchboard exports traces by otlp or console"
            f" (or none), not {unknown[0]}"
        )
    endpoint = bool(env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT"))
    on = any(e != "none" for e in exporters) if exporters else endpoint
    if not on or "otlp" not in (exporters or ["otlp"]):
        return on
    protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
    protocol = (protocol or PROTOCOLS[0]).strip()
    if protocol not in PROTOCOLS:
        raise TracingConfigError(
            f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol}: the [otel] extra sends OTLP over HTTP"
            " (http/protobuf): point it at the collector's HTTP port (4318), or unset the protocol"
        )
    return True


class _Tracing:
    """The process's tracer and what it needs of OpenTelemetry, imported
    only once tracing is on."""

    def __init__(self, provider: Any) -> None:
        from opentelemetry import context, trace
        from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, TraceFlags
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.trace = trace
        self.attach, self.detach, self.consumer = context.attach, context.detach, SpanKind.CONSUMER
        self._span_context, self._flags, self._span = SpanContext, TraceFlags, NonRecordingSpan
        self.provider = provider
        # A batch's links: the span limit's (OTEL_SPAN_LINK_COUNT_LIMIT, 128 by default).
        self.max_links: int = provider._span_limits.max_links
        self.tracer = provider.get_tracer("switchboard")
        self.propagator = TraceContextTextMapPropagator()

    def context_of(self, text: str | None) -> Any:
        """The OpenTelemetry context a stored context stands for (None: none)."""
        if text is None:
            return None
        if (traceparent := _traceparent_of(text)) is not None:
            return self.trace.set_span_in_context(self._span(self._from(traceparent)))
        try:
            carrier = json.loads(text)
        except ValueError:
            return None
        return self.propagator.extract(carrier) if isinstance(carrier, dict) else None

    def _from(self, traceparent: str) -> Any:
        """A checked traceparent's span context (carried() checked it)."""
        return self._span_context(
            int(traceparent[3:35], 16),
            int(traceparent[36:52], 16),
            True,
            self._flags(int(traceparent[53:55], 16)),
        )

    def span_context_of(self, text: str | None) -> Any:
        if text is not None and (traceparent := _traceparent_of(text)) is not None:
            return self._from(traceparent)
        context = self.context_of(text)
        if context is None:
            return None
        span_context = self.trace.get_current_span(context).get_span_context()
        return span_context if span_context.is_valid else None


_tracing: _Tracing | None = None


def on() -> bool:
    return _tracing is not None


def switch_on(process: str, env: Mapping[str, str] | None = None) -> bool:
    """Trace from now on if the OTEL_* variables ask for it and the extra is
    installed; True if so. ``process`` (``ingest``, ``receive``, ``worker``)
    is the default ``service.name``'s suffix. ``env`` (the process's own by
    default) decides whether; the SDK reads its settings from the process's
    environment, as it always does. Raises TracingConfigError."""
    global _tracing
    env = os.environ if env is None else env
    if _tracing is not None or not wanted(env):
        return _tracing is not None
    try:
        provider = _provider(process, env)
    except ImportError as exc:
        log.warning(
            "tracing_unavailable",
            error=f"{type(exc).__name__}: {exc}",
            detail="OTEL_* variables ask for traces, but the [otel] extra is not installed"
            " (pip install 'switchboard-ingest[otel]'): nothing is traced",
        )
        return False
    from opentelemetry import trace

    # Global, so that the handlers' own spans (trace.get_tracer) go where ours do.
    trace.set_tracer_provider(provider)
    _tracing = _Tracing(provider)
    log.info("tracing_on", service=provider.resource.attributes.get("service.name"))
    return True


def _provider(process: str, env: Mapping[str, str]) -> Any:
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import SpanLimits, TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    named = env.get("OTEL_SERVICE_NAME") or "service.name=" in env.get("OTEL_RESOURCE_ATTRIBUTES", "")
    attributes = {"switchboard.process": process}
    if not named:
        attributes[SERVICE_NAME] = f"switchboard-{process}"
    provider = TracerProvider(resource=Resource.create(attributes), span_limits=SpanLimits())
    exporters = [e.strip().lower() for e in env.get("OTEL_TRACES_EXPORTER", "otlp").split(",") if e.strip()]
    for name in dict.fromkeys(exporters):
        if name == "console":
            provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
        elif name == "otlp":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    return provider


def shutdown(timeout_ms: int = 5_000) -> None:
    """Export what is still buffered, within ``timeout_ms``; nothing is
    traced after (a process's last step)."""
    global _tracing
    tracing, _tracing = _tracing, None
    if tracing is None:
        return
    try:
        tracing.provider.force_flush(timeout_ms)
        tracing.provider.shutdown()
    except Exception as exc:  # noqa: BLE001 - a collector gone must not fail a process's stop
        log.warning("tracing_not_flushed", error=f"{type(exc).__name__}: {exc}")


def _need() -> _Tracing:
    if _tracing is None:
        raise RuntimeError("tracing is off: ask backhalf.tracing.on() first")
    return _tracing


@contextmanager
def ingest_span(
    *, adapter: str, system: str, destination: str | None, contexts: Sequence[str | None]
) -> Iterator[None]:
    """``switchboard ingest``: one stored batch, linked to its messages'
    contexts, as many as the span's link limit allows (the rest counted in
    ``switchboard.links_omitted``: each link costs its export about 10 us).
    Only while tracing is on."""
    tracing = _need()
    from opentelemetry.trace import Link, SpanKind

    carrying = [c for c in contexts if c is not None]
    kept = carrying[: tracing.max_links]
    links = [Link(sc) for sc in map(tracing.span_context_of, kept) if sc is not None]
    attributes: dict[str, Any] = {
        "messaging.system": system,
        "messaging.operation.type": "receive",
        "messaging.operation.name": "ingest",
        "messaging.batch.message_count": len(contexts),
        "switchboard.adapter": adapter,
    }
    if destination is not None:
        attributes["messaging.destination.name"] = destination
    if len(carrying) > len(kept):
        attributes["switchboard.links_omitted"] = len(carrying) - len(kept)
    with tracing.tracer.start_as_current_span(
        "switchboard ingest", kind=SpanKind.CONSUMER, links=links, attributes=attributes
    ):
        yield


class Delivered:
    """The receive span of one webhook delivery: its context for the todo,
    and the answer's status once known."""

    def __init__(self, tracing: _Tracing, span: Any) -> None:
        self._tracing, self._span = tracing, span

    def context(self) -> str | None:
        """This span's context, kept by the todo (its run becomes this span's child)."""
        carrier: dict[str, str] = {}
        self._tracing.propagator.inject(carrier, self._tracing.trace.set_span_in_context(self._span))
        try:
            return carried(carrier.get(TRACEPARENT), carrier.get(TRACESTATE))
        except ValueError:
            return None

    def answered(self, status: int, message_id: str | None = None) -> None:
        self._span.set_attribute("http.response.status_code", status)
        if message_id is not None:
            self._span.set_attribute("messaging.message.id", message_id)
        if status >= 500:
            from opentelemetry.trace import Status, StatusCode

            self._span.set_status(Status(StatusCode.ERROR, f"answered {status}"))


@contextmanager
def receive_span(*, adapter: str, path: str, sender: str | None) -> Iterator[Delivered]:
    """``switchboard receive``: one webhook delivery, a child of ``sender``
    (the context its headers carried, :func:`carried`'s text; None: a root).
    Only while tracing is on."""
    tracing = _need()
    from opentelemetry.trace import SpanKind

    attributes = {
        "messaging.system": "webhook",
        "messaging.operation.type": "receive",
        "messaging.operation.name": "receive",
        "messaging.destination.name": adapter,
        "switchboard.adapter": adapter,
        "http.request.method": "POST",
        "url.path": path,
    }
    with tracing.tracer.start_as_current_span(
        "switchboard receive",
        context=tracing.context_of(sender),
        kind=SpanKind.SERVER,
        attributes=attributes,
    ) as span:
        yield Delivered(tracing, span)


class Run:
    """The span of one handler run, current while it lasts (its own context
    manager, not the SDK's ``start_as_current_span``: a generator and its
    exception handling cost each run a third more); told its outcome."""

    def __init__(self, tracing: _Tracing, name: str, parent: Any, attributes: dict[str, Any]) -> None:
        self._tracing = tracing
        self._span = tracing.tracer.start_span(
            name, context=parent, kind=tracing.consumer, attributes=attributes
        )
        self._token: Any = None

    def __enter__(self) -> Run:
        tracing = self._tracing
        self._token = tracing.attach(tracing.trace.set_span_in_context(self._span))
        return self

    def __exit__(self, *exc: object) -> None:
        self._tracing.detach(self._token)
        self._span.end()

    def ended(self, outcome: str, error: BaseException | None = None) -> None:
        self._span.set_attribute("switchboard.run.outcome", outcome)
        if error is not None:
            from opentelemetry.trace import Status, StatusCode

            self._span.record_exception(error)
            self._span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}"))


def run_span(*, todo_id: int, queue: str, attempt: int, context: str | None) -> Run:
    """``switchboard run``: one handler run, a child of its todo's ``context``
    (None: a root), current while the handler runs (so its own spans are
    this one's children): a context manager. Only while tracing is on."""
    tracing = _need()
    # As few as say what the run was: each attribute costs the run about
    # 5 us to set and 5 more to export, whatever it holds (a span with none
    # about 35 us): the message is the todo, so its id is messaging.message.id.
    attributes = {
        "messaging.destination.name": queue,
        "messaging.message.id": str(todo_id),
        "switchboard.todo.attempt": attempt,
    }
    return Run(tracing, "switchboard run", tracing.context_of(context), attributes)
