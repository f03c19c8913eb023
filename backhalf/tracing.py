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
import threading
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
# tracestate: at most 32 list members of W3C's grammar (key=value, a key a
# simple or a tenant@system one), 512 characters in all (what a vendor must
# keep). Any member off the grammar drops the whole header: the SDK would
# drop it too, and log the producer's text at every read.
_TRACESTATE_MEMBER = re.compile(
    r"(?:[a-z0-9][_0-9a-z*/-]{0,255}|[a-z0-9][_0-9a-z*/-]{0,240}@[a-z][_0-9a-z*/-]{0,13})"
    r"=[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]"
)
_TRACESTATE_MAX = 512
_TRACESTATE_MEMBERS = 32

# What the variables may name (the extra ships OTLP over HTTP).
EXPORTERS = ("otlp", "console", "none")
PROTOCOLS = ("http/protobuf",)


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
    state = _tracestate(tracestate)
    if state is not None:
        return f'{text}","{TRACESTATE}":{json.dumps(state)}}}'
    return text + '"}'


def _tracestate(header: str | None) -> str | None:
    """``header`` if it is a W3C tracestate (empty members skipped), else None."""
    if not header or len(header) > _TRACESTATE_MAX:
        return None
    members = [m.strip(" \t") for m in header.split(",")]
    members = [m for m in members if m]
    if not members or len(members) > _TRACESTATE_MEMBERS:
        return None
    if not all(_TRACESTATE_MEMBER.fullmatch(m) for m in members):
        return None
    if len({m.partition("=")[0] for m in members}) != len(members):
        return None  # a key twice
    return ",".join(members)


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
        from opentelemetry.trace import (
            NonRecordingSpan,
            SpanContext,
            SpanKind,
            Status,
            StatusCode,
            TraceFlags,
        )
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.trace = trace
        self.attach, self.detach, self.consumer = context.attach, context.detach, SpanKind.CONSUMER
        self.server, self.status, self.error = SpanKind.SERVER, Status, StatusCode.ERROR
        self._empty = context.Context
        self._span_context, self._flags, self._span = SpanContext, TraceFlags, NonRecordingSpan
        self.provider = provider
        # A batch's links: the span limit's (OTEL_SPAN_LINK_COUNT_LIMIT, 128 by default).
        self.max_links: int = provider._span_limits.max_links
        self.tracer = provider.get_tracer("switchboard")
        self.propagator = TraceContextTextMapPropagator()
        from backhalf.run_span import run_spans

        self.run_spans = run_spans(provider, self.tracer)

    def root(self) -> Any:
        """An empty context: a span started in it is a root, whatever the
        thread's current context holds."""
        return self._empty()

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


def check(env: Mapping[str, str]) -> None:
    """What :func:`switch_on` would refuse, found before a process starts
    (``switchboard worker``, whose processes switch on after dramatiq forks
    them): TracingConfigError. Settings the SDK reads itself (span limits)
    are checked where the extra is installed."""
    if not wanted(env):
        return
    try:
        from opentelemetry.sdk.trace import SpanLimits
    except ImportError:
        return  # switch_on says so, once per process, and runs untraced
    _limits(SpanLimits)


def _limits(span_limits: Any) -> Any:
    try:
        return span_limits()
    except ValueError as exc:  # OTEL_SPAN_*_LIMIT not a number, or negative
        raise TracingConfigError(f"OTEL_* span limits: {exc}") from exc


def _provider(process: str, env: Mapping[str, str]) -> Any:
    # Every import first: no processor (and its thread) is started for a
    # provider an ImportError then abandons.
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import SpanLimits, TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    exporters = [e.strip().lower() for e in env.get("OTEL_TRACES_EXPORTER", "otlp").split(",") if e.strip()]
    made: list[Any] = []
    if "otlp" in exporters:
        from backhalf.otlp_wire import SpanExporter

        made.append(SpanExporter)
    if "console" in exporters:
        made.append(ConsoleSpanExporter)
    named = env.get("OTEL_SERVICE_NAME") or "service.name=" in env.get("OTEL_RESOURCE_ATTRIBUTES", "")
    attributes = {"switchboard.process": process}
    if not named:
        attributes[SERVICE_NAME] = f"switchboard-{process}"
    resource = _hashed_once(Resource.create(attributes))
    provider = TracerProvider(resource=resource, span_limits=_limits(SpanLimits))
    for exporter in made:
        provider.add_span_processor(BatchSpanProcessor(exporter()))
    return provider


def _hashed_once(resource: Any) -> Any:
    """``resource`` with its hash computed once. The OTLP encoder groups
    every exported span by its resource, a dict key, and the SDK's
    ``Resource.__hash__`` serializes all its attributes to JSON on each
    call: 11% of the exporter thread's samples in a traced run, and
    26.6 -> 21.6 us a span's encoding once kept. A resource's attributes
    are immutable, so its hash can be kept."""

    base: Any = type(resource)  # the SDK's Resource, imported where tracing is on

    class HashedOnce(base):  # type: ignore[misc]
        def __init__(self, attributes: Any, schema_url: str | None = None) -> None:
            super().__init__(attributes, schema_url)
            self._hash = super().__hash__()

        def __hash__(self) -> int:
            return self._hash  # type: ignore[no-any-return]

        def merge(self, other: Any) -> Any:
            # The provider merges its resource after a fork: still hashed once.
            merged = super().merge(other)
            return merged if merged is self else HashedOnce(merged.attributes, merged.schema_url)

    return HashedOnce(resource.attributes, resource.schema_url)


def shutdown(timeout_ms: int = 5_000) -> None:
    """Export what is still buffered, for ``timeout_ms`` at most (in a thread
    of its own: the SDK's flush does not bound its wait on a collector that
    does not answer); nothing is traced after (a process's last step)."""
    global _tracing
    tracing, _tracing = _tracing, None
    if tracing is None:
        return

    def flush() -> None:
        try:
            tracing.provider.shutdown()  # exports what is queued, then stops
        except Exception as exc:  # noqa: BLE001 - a collector gone must not fail a process's stop
            log.warning("tracing_not_flushed", error=f"{type(exc).__name__}: {exc}")

    flusher = threading.Thread(target=flush, name="tracing-flush", daemon=True)
    flusher.start()
    flusher.join(timeout_ms / 1000)
    if flusher.is_alive():
        log.warning("tracing_not_flushed", error=f"the exporter did not finish within {timeout_ms} ms",
                    detail="the spans still queued are dropped")  # fmt: skip


def _failed(what: str, exc: Exception) -> None:
    """A tracing step failed: logged, never the message's or the run's failure."""
    log.warning("tracing_failed", step=what, error=f"{type(exc).__name__}: {str(exc)[:200]}")


@contextmanager
def ingest_span(
    *, adapter: str, system: str, destination: str | None, contexts: Sequence[str | None]
) -> Iterator[None]:
    """``switchboard ingest``: one stored batch, linked to its messages'
    contexts, as many as the span's link limit allows (the rest counted in
    ``switchboard.links_omitted``: each link costs its export about 10 us).
    Nothing while tracing is off."""
    tracing = _tracing
    span = None if tracing is None else _started_ingest(tracing, adapter, system, destination, contexts)
    if tracing is None or span is None:
        yield
        return
    with _current(tracing, span):
        yield


@contextmanager
def _current(tracing: _Tracing, span: Any) -> Iterator[None]:
    """``span`` current for the block, ended after it (an error: its type)."""
    token = tracing.attach(tracing.trace.set_span_in_context(span))
    try:
        yield
    except BaseException as exc:
        _errored(tracing, span, exc)
        raise
    finally:
        tracing.detach(token)
        span.end()


def _started_ingest(
    tracing: _Tracing, adapter: str, system: str, destination: str | None, contexts: Sequence[str | None]
) -> Any:
    try:
        from opentelemetry.trace import Link

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
        kind, root = tracing.consumer, tracing.root()
        return tracing.tracer.start_span(
            "switchboard ingest", context=root, kind=kind, links=links, attributes=attributes
        )
    except Exception as exc:  # noqa: BLE001 - a batch is stored traced or not
        _failed("ingest span", exc)
        return None


def _errored(tracing: _Tracing, span: Any, exc: BaseException) -> None:
    """The span's error: its type only (a store's error text holds SQL and
    message bodies; the log has it, redacted)."""
    try:
        span.set_status(tracing.status(tracing.error, type(exc).__name__))
    except Exception as failed:  # noqa: BLE001
        _failed("span status", failed)


class Delivered:
    """The receive span of one webhook delivery: its context for the todo,
    and the answer's status once known. Without a span (tracing off, or it
    failed to start) every method is a no-op."""

    def __init__(self, tracing: _Tracing | None, span: Any) -> None:
        self._tracing, self._span = tracing, span

    def context(self) -> str | None:
        """This span's context, kept by the todo (its run becomes this span's child)."""
        if self._tracing is None or self._span is None:
            return None
        sc = self._span.get_span_context()
        return carried(f"00-{sc.trace_id:032x}-{sc.span_id:016x}-{int(sc.trace_flags):02x}")

    def answered(self, status: int) -> None:
        if self._tracing is None or self._span is None:
            return
        try:
            self._span.set_attribute("http.response.status_code", status)
            if status >= 500:
                self._span.set_status(self._tracing.status(self._tracing.error, f"answered {status}"))
        except Exception as exc:  # noqa: BLE001 - the answer goes out traced or not
            _failed("receive span", exc)


@contextmanager
def receive_span(*, adapter: str, path: str, sender: str | None) -> Iterator[Delivered]:
    """``switchboard receive``: one webhook delivery, a child of ``sender``
    (the context its headers carried, :func:`carried`'s text; None: a root).
    A no-op while tracing is off."""
    tracing = _tracing
    span = None
    if tracing is not None:
        try:
            attributes = {
                "messaging.system": "webhook",
                "messaging.operation.type": "receive",
                "messaging.operation.name": "receive",
                "messaging.destination.name": adapter,
                "switchboard.adapter": adapter,
                "http.request.method": "POST",
                "url.path": path,
            }
            parent = tracing.context_of(sender) if sender is not None else tracing.root()
            span = tracing.tracer.start_span(
                "switchboard receive", context=parent, kind=tracing.server, attributes=attributes
            )
        except Exception as exc:  # noqa: BLE001 - a delivery is stored traced or not
            _failed("receive span", exc)
    if tracing is None or span is None:
        yield Delivered(None, None)
        return
    with _current(tracing, span):
        yield Delivered(tracing, span)


class Run:
    """The span of one handler run, current while it lasts (its own context
    manager, not the SDK's ``start_as_current_span``: a generator and its
    exception handling cost each run a third more); told its outcome.
    Nothing escapes it into the run: a tracing step that fails is logged.
    The span is ``backhalf.run_span``'s where it can be, else the SDK
    tracer's."""

    def __init__(self, tracing: _Tracing | None, parent: Any, attributes: dict[str, Any]) -> None:
        self._tracing, self._span = tracing, None
        self._token: Any = None
        if tracing is None:
            return
        try:
            if tracing.run_spans is not None:
                try:
                    self._span = tracing.run_spans.start(parent, attributes)
                except Exception as exc:  # noqa: BLE001 - the SDK's tracer makes this one
                    _failed("run span", exc)
            if self._span is None:
                kind = tracing.consumer
                self._span = tracing.tracer.start_span(
                    "switchboard run", context=parent, kind=kind, attributes=attributes
                )
        except Exception as exc:  # noqa: BLE001 - the handler runs traced or not
            _failed("run span", exc)

    def __enter__(self) -> Run:
        if self._tracing is not None and self._span is not None:
            self._token = self._tracing.attach(self._tracing.trace.set_span_in_context(self._span))
        return self

    def __exit__(self, *exc: object) -> None:
        if self._tracing is None or self._span is None:
            return
        try:
            self._tracing.detach(self._token)
            self._span.end()
        except Exception as failed:  # noqa: BLE001
            _failed("run span", failed)

    def ended(self, outcome: str, error_type: str | None = None, error: str | None = None) -> None:
        """The run's outcome; a failed run's error as an ``exception`` event:
        its type and ``error``, the text its todo keeps (cut and redacted:
        backhalf.lifecycle.worker.stored_error), never the traceback."""
        if self._tracing is None or self._span is None:
            return
        try:
            # A lean run span keeps its own attribute unchecked (run_span.RunSpan.keep).
            keep = getattr(self._span, "keep", self._span.set_attribute)
            keep("switchboard.run.outcome", outcome)
            if error_type is not None:
                event = {"exception.type": error_type, "exception.message": error or ""}
                self._span.add_event("exception", event)
                self._span.set_status(self._tracing.status(self._tracing.error, error_type))
        except Exception as exc:  # noqa: BLE001 - the run's end is written traced or not
            _failed("run span", exc)


def run_span(*, todo_id: int, queue: str, attempt: int, context: str | None) -> Run:
    """``switchboard run``: one handler run, a child of its todo's ``context``
    (None: a root), current while the handler runs (so its own spans are
    this one's children): a context manager. A no-op while tracing is off
    (or switched off meanwhile: a stop)."""
    tracing = _tracing
    if tracing is None:
        return Run(None, None, {})
    # As few as say what the run was: each attribute costs the run about
    # 5 us to set and 5 more to export, whatever it holds (a span with none
    # about 35 us): the message is the todo, so its id is messaging.message.id.
    attributes = {
        "messaging.destination.name": queue,
        "messaging.message.id": str(todo_id),
        "switchboard.todo.attempt": attempt,
    }
    try:
        parent = tracing.context_of(context) if context is not None else tracing.root()
    except Exception as exc:  # noqa: BLE001 - a kept context that cannot be read: a root
        _failed("run span", exc)
        parent = tracing.root()
    return Run(tracing, parent, attributes)
