"""The claims of a worker's fetched messages (ingest.processes.worker_claims)
against real PostgreSQL and real dramatiq messages: one batch claimed at
once, a claim waiting in the prefetch has its lease extended before it
runs out, and claims given back unrun."""

from __future__ import annotations

import time

import psycopg
import pytest
from dramatiq.broker import MessageProxy
from dramatiq.message import Message

from backhalf.queues import QueueConfig
from backhalf.state_writer import StateWriter
from backhalf.worker import Claim
from ingest.processes.worker_claims import GIVEN_BACK, FetchClaims
from tests.support.db import insert_todos, libpq, query, scalar

QUEUE = QueueConfig(name="q", handler="x:y", time_limit_ms=10_000, lease_margin_ms=4_000)


@pytest.fixture
def claims(writer: StateWriter) -> FetchClaims:
    return FetchClaims(lambda: writer, {QUEUE.actor_name: QUEUE}, {QUEUE.broker_queue})


def messages(db_url: str, n: int) -> list[MessageProxy]:
    ids = insert_todos(db_url, n)
    return [
        MessageProxy(
            Message(
                queue_name=QUEUE.broker_queue, actor_name=QUEUE.actor_name, args=(i,), kwargs={}, options={}
            )
        )
        for i in ids
    ]


def test_a_fetched_batch_is_claimed_and_each_claim_taken_once(claims: FetchClaims, db_url: str) -> None:
    batch = messages(db_url, 3)
    claims.claim(batch)
    assert scalar(db_url, "SELECT count(*) FROM todos WHERE status = 'running' AND attempts = 1") == 3
    taken = claims.take(batch[0])
    assert taken is not None
    assert taken.started.todo is not None
    assert taken.started.todo.id == batch[0].args[0]
    assert claims.take(batch[0]) is None


def test_a_claim_waiting_past_half_the_margin_has_its_lease_extended(
    claims: FetchClaims, db_url: str
) -> None:
    (message,) = messages(db_url, 1)
    claims.claim([message])
    # As if fetched 3 s ago, behind slow runs: its lease has 11 s left of 14.
    key = id(message)
    claim = claims._claims[key][1]
    claims._claims[key] = (message, Claim(claim.started, claim.at - 3))
    with psycopg.connect(libpq(db_url), autocommit=True) as conn:
        conn.execute("UPDATE todos SET lease_until = now() + interval '11 seconds'")
    claims.refresh()
    lease_left = "SELECT extract(epoch FROM lease_until - now()) FROM todos"
    assert float(scalar(db_url, lease_left)) > 13  # the whole lease again, from now
    refreshed = claims.take(message)
    assert refreshed is not None
    assert time.monotonic() - refreshed.at < 2


def test_claims_given_back_are_dispatched_again_uncounted(claims: FetchClaims, db_url: str) -> None:
    batch = messages(db_url, 2)
    claims.claim(batch)
    claims.give_back(batch)
    assert query(db_url, "SELECT DISTINCT status, attempts FROM todos") == [("dispatched", 0)]
    assert scalar(db_url, "SELECT count(*) FROM todo_events WHERE detail = %(d)s", {"d": GIVEN_BACK}) == 2
    assert claims.take(batch[0]) is None
