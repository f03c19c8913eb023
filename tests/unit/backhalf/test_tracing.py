"""backhalf.tracing's rules that need no process: which W3C contexts are
kept, what the OTEL_* variables may ask, and that with tracing off nothing
of OpenTelemetry is imported (the spans themselves are asserted through real
processes and a real collector: tests/system/test_traces.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator

import pytest
from opentelemetry.sdk import resources
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from backhalf import tracing
from backhalf.lifecycle import todos, worker
from backhalf.lifecycle.queues import QueueConfig

TRACE, SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
GOOD = f"00-{TRACE}-{SPAN}-01"


def test_a_w3c_traceparent_is_kept_with_its_tracestate() -> None:
    kept = tracing.carried(GOOD, "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE")
    assert json.loads(kept or "") == {
        "traceparent": GOOD,
        "tracestate": "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE",
    }
    assert json.loads(tracing.carried(f"  {GOOD} ") or "") == {"traceparent": GOOD}
    assert tracing.carried(None, "rojo=1") is None


def test_a_later_version_is_read_as_its_first_fields() -> None:
    later = f"cc-{TRACE}-{SPAN}-01-what-the-future-adds"
    assert json.loads(tracing.carried(later) or "") == {"traceparent": later[:55]}


@pytest.mark.parametrize(
    "traceparent",
    [
        "",
        "garbage",
        GOOD.upper(),  # hex is lowercase
        f"00-{TRACE}-{SPAN}-01-more",  # version 00 has exactly four fields
        f"ff-{TRACE}-{SPAN}-01",  # version ff is invalid
        f"00-{'0' * 32}-{SPAN}-01",  # all-zero trace id
        f"00-{TRACE}-{'0' * 16}-01",  # all-zero parent id
        f"00-{TRACE[:-1]}-{SPAN}-01",
        f"00-{TRACE}-{SPAN}-1",
        f"00_{TRACE}_{SPAN}_01",
        GOOD + "\x00",
    ],
)
def test_a_malformed_traceparent_is_refused(traceparent: str) -> None:
    with pytest.raises(ValueError, match="traceparent"):
        tracing.carried(traceparent)


@pytest.mark.parametrize(
    "tracestate",
    [
        "x" * 513,
        ",".join(f"k{i}=v" for i in range(33)),
        "bad\x7fstate",
        'junk "\\ here',  # no member of W3C's grammar: the SDK would log it at every read
        "a=1,a=2",  # a key twice
        "Upper=1",
        "a=b=c",
        "rojo=1,junk",  # one bad member drops them all
    ],
)
def test_a_malformed_tracestate_is_dropped_alone(tracestate: str) -> None:
    assert json.loads(tracing.carried(GOOD, tracestate) or "") == {"traceparent": GOOD}


@pytest.mark.parametrize(
    ("env", "wanted"),
    [
        ({}, False),
        ({"OTEL_SERVICE_NAME": "x"}, False),  # no exporter named, no endpoint
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4318/v1/traces"}, True),
        ({"OTEL_TRACES_EXPORTER": "console"}, True),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, True),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}, False),
        ({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp"}, False),
        ({"OTEL_TRACES_EXPORTER": "console", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, True),  # no OTLP asked
    ],
)
def test_what_the_variables_ask(env: dict[str, str], wanted: bool) -> None:
    assert tracing.wanted(env) is wanted


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"OTEL_TRACES_EXPORTER": "zipkin"}, "otlp or console"),
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
            "http/protobuf",
        ),
        (
            {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"},
            "http/protobuf",
        ),
    ],
)
def test_what_the_extra_cannot_do_is_a_clear_error(env: dict[str, str], says: str) -> None:
    with pytest.raises(tracing.TracingConfigError, match=says):
        tracing.wanted(env)


def test_tracing_off_imports_nothing_of_opentelemetrys_traces() -> None:
    """The ingester's, the receiver's and the worker's modules, imported and
    tracing asked for nothing: no tracer, exporter or protobuf in the
    process. (redis-py 8 imports OpenTelemetry's metrics SDK itself when it
    is installed, traced or not: docs/operating.md, "Traces".)"""
    ours = ("opentelemetry.sdk.trace", "opentelemetry.exporter", "opentelemetry.proto", "google.protobuf")
    code = (
        "import sys, ingest.processes.pull.ingester, ingest.processes.push.receiver,"
        " ingest.processes.workers.worker;"
        "from backhalf import tracing;"
        "assert tracing.switch_on('ingest', {}) is False;"
        f"print(sorted(m for m in sys.modules if m.startswith({ours!r})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]"


@pytest.fixture
def exported(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    """Tracing on in this process, the SDK's own in-memory exporter for a
    collector (the OTLP path is the system tests')."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(span_limits=SpanLimits(max_links=3))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "_tracing", tracing._Tracing(provider))
    yield exporter
    provider.shutdown()


def test_a_batch_links_its_messages_up_to_the_span_limit(exported: InMemorySpanExporter) -> None:
    traceparents = [f"00-{i:032x}-{i:016x}-01" for i in range(1, 6)]
    contexts = [tracing.carried(tp) for tp in traceparents] + [None]
    # As PostgreSQL prints it back: the same context.
    contexts[1] = json.dumps(json.loads(contexts[1] or ""))
    with tracing.ingest_span(adapter="orders", system="redis", destination="s", contexts=contexts):
        pass
    (span,) = exported.get_finished_spans()
    assert [(link.context.trace_id, link.context.span_id) for link in span.links] == [(1, 1), (2, 2), (3, 3)]
    assert all(link.context.is_remote and link.context.trace_flags.sampled for link in span.links)
    assert span.attributes is not None
    assert span.attributes["messaging.batch.message_count"] == 6
    assert span.attributes["switchboard.links_omitted"] == 2


def test_a_run_is_a_child_of_its_todos_context_tracestate_and_all(exported: InMemorySpanExporter) -> None:
    kept = f'{{"tracestate": "rojo=1", "traceparent": "{GOOD}"}}'  # as PostgreSQL's jsonb prints it
    with tracing.run_span(todo_id=7, queue="q", attempt=2, context=kept) as run:
        run.ended("retry", "ValueError", "ValueError: boom")
    (span,) = exported.get_finished_spans()
    assert span.parent is not None
    assert (span.parent.trace_id, span.parent.span_id) == (int(TRACE, 16), int(SPAN, 16))
    assert span.context is not None
    assert span.context.trace_id == int(TRACE, 16)
    assert span.context.trace_state.get("rojo") == "1"
    assert span.attributes is not None
    assert (
        dict(span.attributes).items()
        >= {"messaging.message.id": "7", "switchboard.run.outcome": "retry"}.items()
    )
    assert [e.name for e in span.events] == ["exception"]


class Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no text for you")


@pytest.mark.parametrize(
    ("error", "kept"),
    [
        (Unprintable(), "Unprintable: (its message could not be printed)"),
        (ConnectionError("cannot reach postgresql://app:hunter2@db:5432/x"), "ConnectionError: cannot reach"),
    ],
)
def test_a_failed_runs_error_is_the_todos_own_text_and_never_escapes(
    exported: InMemorySpanExporter, error: Exception, kept: str
) -> None:
    """What a handler raised is exported as its todo keeps it (cut, redacted,
    printable: stored_error), no traceback; an error whose text cannot be
    made is no failure of the run's end (the attempt is still the one that
    comes back)."""

    def handler(_todo: todos.Todo) -> None:
        raise error

    claim = todos.Claimed(todos.Todo(7, "q", {}, "k", 1), uuid.uuid4(), tracing.carried(GOOD))
    queue = QueueConfig(name="q", handler="x:y", max_attempts=3)
    assert worker._traced_attempt(handler, claim, queue) is error
    (span,) = exported.get_finished_spans()
    (event,) = span.events
    assert event.attributes is not None
    assert event.attributes["exception.type"] == type(error).__name__
    message = str(event.attributes["exception.message"])
    assert message.startswith(kept)
    assert "hunter2" not in message
    assert "exception.stacktrace" not in event.attributes
    assert span.attributes is not None
    assert span.attributes["switchboard.run.outcome"] == "retry"


def test_span_limits_the_sdk_cannot_read_are_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_SPAN_LINK_COUNT_LIMIT", "lots")
    with pytest.raises(tracing.TracingConfigError, match="span limits"):
        tracing.check({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"})
    tracing.check({})  # not asked for: nothing read


def test_the_processs_resource_is_the_sdks_hashed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The encoder hashes the resource for every span it exports; the SDK's
    hash serializes the attributes each time, ours keeps the first."""
    provider = tracing._provider("worker", {"OTEL_TRACES_EXPORTER": "none"})
    resource = provider.resource
    provider.shutdown()
    created = Resource(dict(resource.attributes), resource.schema_url)
    assert resource.attributes["service.name"] == "switchboard-worker"
    assert resource == created
    assert hash(resource) == hash(created)
    assert {created: "grouped"}[resource] == "grouped"

    def no_serializing(*args: object, **kwargs: object) -> str:
        raise AssertionError("the resource serialized again to be hashed")

    # After a fork the provider merges its resource with the process's own.
    forked = resource.merge(Resource({"process.pid": 2}))
    assert forked.attributes["process.pid"] == 2
    monkeypatch.setattr(resources, "dumps", no_serializing)
    assert hash(resource) == hash(resource)
    assert hash(forked) == hash(forked)
    with pytest.raises(AssertionError, match="serialized again"):
        hash(created)
