"""``switchboard demo --trace``: one order's trace, from its producer to the
handler (DESIGN.md section 14), as a collector receives it.

The demo plays the producer of one order (the last whose first attempt
fails, so its trace shows the retry; sent after the ingester's SIGKILL, whose
unexported spans die with it): it sends the order with a
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

from ingest.embedded.demo_handlers import FLAKY_EVERY, FLAKY_FIRST
from ingest.embedded.otlp_collector import Collector, Span, tree

SPANS_TIMEOUT_S = 30.0
LINK_TIMEOUT_S = 5.0


def traced_order(messages: int) -> int | None:
    """The last of ``messages`` orders whose first attempt fails (demo_handlers)."""
    flaky = range(FLAKY_FIRST, messages, FLAKY_EVERY)
    return flaky[-1] if flaky else None


class DemoTrace:
    def __init__(self, order: int | None) -> None:
        self.order = order
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

        if self.order is None:
            say(f"\n  no order's first attempt fails here: none was traced (try {FLAKY_FIRST + 1}+ messages)")
            return

        def ran(spans: list[Span]) -> bool:
            runs = [s for s in spans if s.trace_id == self.trace_id and s.name == "switchboard run"]
            return len(runs) >= 2

        def linked(spans: list[Span]) -> bool:
            return any((self.trace_id, self.span_id) in s.links for s in spans)

        try:
            spans = self._collector.wait_for(ran, timeout_s=SPANS_TIMEOUT_S)
        except TimeoutError as exc:
            say(f"\n  trace of order {self.order}: {exc}")
            spans = self._collector.spans()
        else:
            try:
                # The batch's span comes with the ingester's next export; an
                # ingester killed before it is gone with it.
                spans = self._collector.wait_for(linked, timeout_s=LINK_TIMEOUT_S)
            except TimeoutError:
                say(
                    f"\n  trace of order {self.order}: its batch's ingest span did not come within"
                    f" {LINK_TIMEOUT_S} s: an ingester SIGKILLed before its next export loses it (order"
                    f" {FLAKY_FIRST} goes before the demo's kill; with {FLAKY_FIRST + FLAKY_EVERY + 1}"
                    " messages or more, a later order is traced, sent after it)"
                )
                spans = self._collector.spans()
        producer = f"the demo its producer, span {self.span_id}"
        say(f"\n  trace {self.trace_id} of order {self.order} ({producer}):")
        for s in spans:
            if (self.trace_id, self.span_id) in s.links:
                say(f"    {_line(s)}   (its own trace, linked to the order's: {s.trace_id[:8]}...)")
        for depth, s in tree(spans, self.trace_id):
            say(f"    {'  ' * depth}{_line(s)}")


def _line(s: Span) -> str:
    keys = ("messaging.message.id", "switchboard.todo.attempt", "switchboard.run.outcome",
            "messaging.system", "messaging.batch.message_count")  # fmt: skip
    said = ", ".join(f"{k.rsplit('.', 1)[-1]}={s.attributes[k]}" for k in keys if k in s.attributes)
    return f"{s.name:<20} [{s.service}] {said}"
