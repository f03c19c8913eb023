"""backhalf.tracing's rules that need no process: which W3C contexts are
kept, what the OTEL_* variables may ask, and that with tracing off nothing
of OpenTelemetry is imported (the spans themselves are asserted through real
processes and a real collector: tests/system/test_traces.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from backhalf import tracing

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


@pytest.mark.parametrize("tracestate", ["x" * 513, ",".join(f"k{i}=v" for i in range(33)), "bad\x7fstate"])
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
        "import sys, ingest.processes.ingester, ingest.processes.receiver, ingest.processes.worker;"
        "from backhalf import tracing;"
        "assert tracing.switch_on('ingest', {}) is False;"
        f"print(sorted(m for m in sys.modules if m.startswith({ours!r})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]"
