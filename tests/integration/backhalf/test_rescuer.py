"""The acker's rescuer (backhalf.lifecycle.rescue.Rescuer) against real PostgreSQL:
claims whose lease lapsed put back in batches, oldest lease first, failed
where their attempts are spent, only for the queues it was given; each
logged with where it went."""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncEngine
from structlog.testing import capture_logs

from backhalf.lifecycle.queues import QueueConfig
from backhalf.lifecycle.rescue import Rescuer
from tests.support.db import claim, insert_todos, query

QUEUES = {
    "q": QueueConfig(name="q", handler="m:f", max_attempts=3),
    "last": QueueConfig(name="last", handler="m:f", max_attempts=1),
}


def lapse(db_url: str, todo_id: int, ago_s: float) -> None:
    query(
        db_url,
        "UPDATE todos SET lease_until = now() - make_interval(secs => %(s)s) WHERE id = %(i)s",
        {"s": ago_s, "i": todo_id},
    )


async def test_lapsed_claims_are_put_back_in_batches_oldest_lease_first(
    engine: AsyncEngine, db_url: str
) -> None:
    q1, q2, q3, live = insert_todos(db_url, 4)
    (last,) = insert_todos(db_url, 1, queue="last")
    (other,) = insert_todos(db_url, 1, queue="unserved")
    claim(db_url, ["q", "last", "unserved"])
    for todo_id, ago_s in ((q1, 30), (q2, 50), (q3, 10), (last, 40), (other, 60)):
        lapse(db_url, todo_id, ago_s)
    rescuer = Rescuer(engine, QUEUES, batch_size=2, deadline_ms=10_000)
    with capture_logs() as logs:
        assert await rescuer.rescue_once() == 2
        assert await rescuer.rescue_once() == 2
        assert await rescuer.rescue_once() == 0
    rescued = [(e["todo_id"], e["to_status"]) for e in logs if e["event"] == "todo_rescued"]
    assert sorted(rescued[:2]) == sorted([(q2, "pending"), (last, "failed")])  # the two oldest leases first
    assert sorted(rescued[2:]) == sorted([(q1, "pending"), (q3, "pending")])
    assert dict(query(db_url, "SELECT id, status FROM todos")) == {
        q1: "pending", q2: "pending", q3: "pending", live: "running", last: "failed", other: "running",
    }  # fmt: skip
