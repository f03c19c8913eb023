"""``switchboard demo --trace``'s account of a traced order whose batch's
ingest span never reaches the collector (its ingester SIGKILLed before it
exported): the runs are shown, and the missing span is explained, not
reported as a bare timeout. The spans go over real OTLP/HTTP to the demo's
own collector."""

from __future__ import annotations

import pytest
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, set_span_in_context

from ingest.embedded import demo_trace
from ingest.embedded.demo_handlers import FLAKY_FIRST
from ingest.embedded.demo_trace import DemoTrace


def test_a_lost_ingest_span_is_explained_and_the_runs_still_shown(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(demo_trace, "LINK_TIMEOUT_S", 0.5)
    said: list[str] = []
    with DemoTrace(FLAKY_FIRST) as traced:
        endpoint = traced.env()["OTEL_EXPORTER_OTLP_ENDPOINT"]
        provider = TracerProvider(resource=Resource.create({"service.name": "switchboard-worker"}))
        provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=f"{endpoint}/v1/traces")))
        producer = SpanContext(int(traced.trace_id, 16), int(traced.span_id, 16), True, TraceFlags(1))
        parent = set_span_in_context(NonRecordingSpan(producer))
        for outcome in ("retry", "done"):  # the order's two runs; no ingest span linking it
            run = provider.get_tracer("test").start_span("switchboard run", context=parent)
            run.set_attribute("switchboard.run.outcome", outcome)
            run.end()
        provider.shutdown()
        traced.say_spans(said.append)
    text = "\n".join(said)
    assert "ingest span did not come within 0.5 s" in text
    assert "SIGKILLed before its next export" in text
    assert text.count("switchboard run") == 2
    assert "outcome=retry" in text
    assert "outcome=done" in text
