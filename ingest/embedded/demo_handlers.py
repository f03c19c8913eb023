"""The demo's handler (``[queues.orders] handler``), run by real dramatiq
workers: it "fulfils" an order, and fails the first attempt of a few orders
so the demo shows a retry that succeeds."""

from __future__ import annotations

from opentelemetry import trace

from backhalf.lifecycle.todos import Todo

# Orders whose first attempt fails (a flaky downstream, once).
FLAKY_EVERY = 500
FLAKY_FIRST = 7  # orders 7, 507, 1007, ...


class FlakyDownstream(Exception):
    """The demo's one planned failure per flaky order."""


def fulfil(todo: Todo) -> None:
    # A span of the handler's own, as an instrumented client library makes:
    # with ``switchboard demo --trace``, a child of the run's span; a no-op
    # otherwise (OpenTelemetry's API without an SDK set up).
    with trace.get_tracer(__name__).start_as_current_span("fulfil order"):
        _fulfil(todo)


def _fulfil(todo: Todo) -> None:
    order_id = int(todo.payload["order_id"])
    if order_id % FLAKY_EVERY == FLAKY_FIRST and todo.attempt == 1:
        raise FlakyDownstream(f"order {order_id}: the warehouse did not answer (attempt {todo.attempt})")
