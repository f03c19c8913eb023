"""``switchboard demo --trace``: one order's trace, from its producer to the
handler (DESIGN.md section 14), as a collector receives it.

The demo plays the producer of order :data:`TRACED_ORDER` (one whose first
attempt fails, so its trace shows the retry): it sends the order with a
``traceparent`` of its own making, runs every process with the ``OTEL_*``
variables pointing at the dev kit's collector
(``ingest.embedded.otlp_collector``) and, once the order is done, prints
the spans of its trace, each under its parent, and the ingest span that
links to it.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from types import TracebackType

from ingest.embedded.otlp_collector import Collector, Span, tree

# demo_handlers.FLAKY_EVERY's first flaky order: its first attempt fails.
TRACED_ORDER = 7
SPANS_TIMEOUT_S = 30.0


class DemoTrace:
    def __init__(self) -> None:
        self.trace_id, self.span_id = secrets.token_hex(16), secrets.token_hex(8)
        self.traceparent = f"00-{self.trace_id}-{self.span_id}-01"
        self._collector = Collector()

    def __enter__(self) -> DemoTrace:
        return self

    def __exit__(self, *exc: object | TracebackType) -> None:
        self._collector.close()

    def env(self) -> dict[str, str]:
        """What every process of the demo gets: OTLP to the collector, exported quickly."""
        return self._collector.env()

    def say_spans(self, say: Callable[[str], None]) -> None:

        def arrived(spans: list[Span]) -> bool:
            runs = [s for s in spans if s.trace_id == self.trace_id and s.name == "switchboard run"]
            return len(runs) >= 2 and any((self.trace_id, self.span_id) in s.links for s in spans)

        try:
            spans = self._collector.wait_for(arrived, timeout_s=SPANS_TIMEOUT_S)
        except TimeoutError as exc:
            say(f"\n  trace of order {TRACED_ORDER}: {exc}")
            return
        producer = f"the demo its producer, span {self.span_id}"
        say(f"\n  trace {self.trace_id} of order {TRACED_ORDER} ({producer}):")
        for s in spans:
            if (self.trace_id, self.span_id) in s.links:
                say(f"    {_line(s)}   (its own trace, linked to the order's: {s.trace_id[:8]}...)")
        for depth, s in tree(spans, self.trace_id):
            say(f"    {'  ' * depth}{_line(s)}")


def _line(s: Span) -> str:
    keys = ("switchboard.todo.id", "switchboard.todo.attempt", "switchboard.run.outcome",
            "messaging.system", "messaging.batch.message_count")  # fmt: skip
    said = ", ".join(f"{k.rsplit('.', 1)[-1]}={s.attributes[k]}" for k in keys if k in s.attributes)
    return f"{s.name:<20} [{s.service}] {said}"
