"""The demo's handler (``[queues.orders] handler``), run by real dramatiq
workers: it "fulfils" an order, and fails the first attempt of a few orders
so the demo shows a retry that succeeds."""

from __future__ import annotations

from backhalf.todos import Todo

# Orders whose first attempt fails (a flaky downstream, once).
FLAKY_EVERY = 500


class FlakyDownstream(Exception):
    """The demo's one planned failure per flaky order."""


def fulfil(todo: Todo) -> None:
    order_id = int(todo.payload["order_id"])
    if order_id % FLAKY_EVERY == 7 and todo.attempt == 1:
        raise FlakyDownstream(f"order {order_id}: the warehouse did not answer (attempt {todo.attempt})")
