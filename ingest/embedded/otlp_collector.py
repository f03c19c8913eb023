"""A trace collector of our own: OTLP over HTTP (protobuf) on loopback, for
``switchboard demo --trace``, the test suite and ``make bench``.

It decodes what an OpenTelemetry exporter sends to ``/v1/traces`` (an
``ExportTraceServiceRequest``, gzipped or not) into :class:`Span` records
and keeps them in memory, so a test asserts on what really left a
Switchboard process, over the wire, as any collector would receive it. It
answers every export 200 (or 400 for a body it cannot decode, counted in
``refused``) and never stores more than ``max_spans``.
"""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

TRACES_PATH = "/v1/traces"
# The body of one export: an exporter's batch is 512 spans by default.
MAX_BODY_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class Span:
    """One span as the collector received it (ids in lowercase hex)."""

    trace_id: str
    span_id: str
    parent_span_id: str  # "" for a root
    name: str
    kind: int  # OTLP's SpanKind: 2 server, 5 consumer, 1 internal, ...
    attributes: Mapping[str, Any]
    links: tuple[tuple[str, str], ...]  # (trace id, span id)
    status_code: int  # OTLP's: 0 unset, 1 ok, 2 error
    service: str
    events: tuple[str, ...] = field(default=())


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in value.kvlist_value.values}
    return getattr(value, kind) if kind else None


def decode(body: bytes) -> list[Span]:
    """The spans of one export request's body."""
    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    spans = []
    for resource_spans in request.resource_spans:
        resource = {kv.key: _value(kv.value) for kv in resource_spans.resource.attributes}
        service = str(resource.get("service.name", ""))
        for scope_spans in resource_spans.scope_spans:
            for s in scope_spans.spans:
                spans.append(
                    Span(
                        trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(),
                        parent_span_id=s.parent_span_id.hex(),
                        name=s.name,
                        kind=int(s.kind),
                        attributes={kv.key: _value(kv.value) for kv in s.attributes},
                        links=tuple((link.trace_id.hex(), link.span_id.hex()) for link in s.links),
                        status_code=int(s.status.code),
                        service=service,
                        events=tuple(e.name for e in s.events),
                    )
                )
    return spans


class Collector:
    """The collector, serving on ``127.0.0.1`` at :attr:`endpoint` until
    :meth:`close` (or the ``with`` block's end)."""

    def __init__(self, *, port: int = 0, max_spans: int = 1_000_000, decode: bool = True) -> None:
        """``decode=False``: count the exports and keep nothing (``make bench``:
        a collector's decoding is not the exporting process's cost, and here
        it would share that process's cores)."""
        self._decode = decode
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)
        self._spans: list[Span] = []
        self._max_spans = max_spans
        self.exports = 0
        self.refused = 0
        self._server = ThreadingHTTPServer(("127.0.0.1", port), self._handler_class())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-collector", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        """The base URL, for ``OTEL_EXPORTER_OTLP_ENDPOINT``."""
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def env(self, service: str | None = None) -> dict[str, str]:
        """The variables that send a process's traces here, exported quickly."""
        env = {
            "OTEL_EXPORTER_OTLP_ENDPOINT": self.endpoint,
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_BSP_SCHEDULE_DELAY": "100",
        }
        if service is not None:
            env["OTEL_SERVICE_NAME"] = service
        return env

    def spans(self) -> list[Span]:
        with self._lock:
            return list(self._spans)

    def clear(self) -> None:
        with self._lock:
            self._spans.clear()

    def wait_for(self, found: Callable[[list[Span]], bool], *, timeout_s: float) -> list[Span]:
        """The spans once ``found`` says they hold what is awaited; TimeoutError
        after ``timeout_s`` (with what did arrive in its message)."""
        deadline = time.monotonic() + timeout_s
        with self._arrived:
            while not found(list(self._spans)):
                left = deadline - time.monotonic()
                if left <= 0:
                    names = sorted({s.name for s in self._spans})
                    raise TimeoutError(
                        f"the collector did not get the awaited spans within {timeout_s} s"
                        f" ({len(self._spans)} spans arrived: {names})"
                    )
                self._arrived.wait(left)
            return list(self._spans)

    def _received(self, spans: list[Span]) -> None:
        with self._arrived:
            self.exports += 1
            room = self._max_spans - len(self._spans)
            self._spans.extend(spans[: max(room, 0)])
            self._arrived.notify_all()

    def _refused(self) -> None:
        with self._lock:
            self.refused += 1

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                if self.path != TRACES_PATH or not 0 <= length <= MAX_BODY_BYTES:
                    self._answer(404 if self.path != TRACES_PATH else 413, b"")
                    return
                body = self.rfile.read(length)
                if not collector._decode:
                    collector._received([])
                    self._answer(200, ExportTraceServiceResponse().SerializeToString())
                    return
                try:
                    if self.headers.get("Content-Encoding", "").lower() == "gzip":
                        body = gzip.decompress(body)
                    spans = decode(body)
                except Exception:  # noqa: BLE001 - any undecodable body is the sender's: a 400
                    collector._refused()
                    self._answer(400, b"")
                    return
                collector._received(spans)
                self._answer(200, ExportTraceServiceResponse().SerializeToString())

            def _answer(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                """Quiet: a test's output is its own."""

        return Handler

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> Collector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def tree(spans: list[Span], trace_id: str) -> Iterator[tuple[int, Span]]:
    """One trace's spans as (depth, span), each parent before its children
    (a span whose parent is not among them, the producer's, at depth 0)."""
    mine = [s for s in spans if s.trace_id == trace_id]
    ids = {s.span_id for s in mine}
    children: dict[str, list[Span]] = {}
    for s in mine:
        children.setdefault(s.parent_span_id if s.parent_span_id in ids else "", []).append(s)

    def walk(parent: str, depth: int) -> Iterator[tuple[int, Span]]:
        for s in children.get(parent, []):
            yield depth, s
            yield from walk(s.span_id, depth + 1)

    yield from walk("", 0)
