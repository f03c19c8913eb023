"""AMQP (RabbitMQ) under the faults only it has, on a broker each test
starts itself (``tests/support/amqp.py``): an ingester killed between its
commit and its ack, and between its ack and the ack's mark (failpoints); a
message that kills the ingester. The kill -9 chaos and the broker's restart
are every transport's (test_transport_faults.py). Each run ends with one
todo per message id (one per distinct body for messages without one), every
ack intent discharged and the queue empty: nothing ready, nothing unacked."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from ingest.embedded.processes import SwitchboardProcess, wait_for, wait_ready
from ingest.embedded.rabbitmq_server import RabbitMqServer
from tests.support.amqp import declare_queue, owned_rabbitmq, publish, queue_counts
from tests.support.amqp_plain import publish_without_ids
from tests.support.db import acked, query, scalar
from tests.support.oracle import assert_stored_once
from tests.support.processes import Processes, assert_clean_exit, switchboard

pytestmark = pytest.mark.system
PER_PHASE = 500  # of each kind: 2,000 messages in all
ROUNDS = 8
QUEUE = "orders"


@pytest.fixture
def rabbit() -> Iterator[RabbitMqServer]:
    with owned_rabbitmq() as server:
        yield server


def amqp_adapter(url: str, queue: str = QUEUE, **overrides: object) -> dict[str, object]:
    return {
        "name": "orders",
        "transport": "amqp",
        "source": queue,
        "queue": "orders",
        "url": url,
        "batch_size": 50,
        "block_ms": 200,
        **overrides,
    }


def bodies(n: int, start: int = 0, **extra: Any) -> list[bytes]:
    return [json.dumps({"order": i, **extra}).encode() for i in range(start, start + n)]


class Produced:
    """What was published, as the keys its messages must be stored under."""

    def __init__(self, url: str, queue: str = QUEUE) -> None:
        self.url, self.queue, self.keys = url, queue, set[str]()

    def with_ids(self, n: int, start: int) -> None:
        ids = [f"m-{i}" for i in range(start, start + n)]
        publish(self.url, self.queue, bodies(n, start, kind="id"), message_ids=ids)
        self.keys |= {f"amqp:{self.queue}:{i}" for i in ids}

    def without_ids(self, n: int, start: int) -> None:
        sent = bodies(n, start, kind="body")
        # Every tenth body twice: one todo per distinct body.
        sent += sent[::10]
        publish_without_ids(self.url, self.queue, sent)
        self.keys |= {f"amqp:{self.queue}:{hashlib.sha256(b).hexdigest()}" for b in sent}


def settled(db_url: str, url: str, produced: Produced) -> bool:
    ready, unacked, _consumers = queue_counts(url, produced.queue)
    return ready == 0 and unacked == 0 and acked(db_url) == len(produced.keys)


@pytest.mark.parametrize("point", ["after_commit", "after_own_ack"])
def test_kill9_between_commit_ack_and_mark_makes_no_second_todo(
    procs: Processes, make_config: Callable[..., Path], db_url: str, rabbit: RabbitMqServer, point: str
) -> None:
    """Killed right after the commit (the ack not sent: the broker requeues
    the batch, whose redelivery dedups) or right after the ack (its mark
    not written: the consumer's next channel settles it): one todo each."""
    declare_queue(rabbit.url, QUEUE)
    produced = Produced(rabbit.url)
    produced.with_ids(40, 0)
    produced.without_ids(40, 0)
    config = make_config(amqp_adapter(rabbit.url, batch_size=20))
    first = procs.start("ingest", config, name="ingester-1", failpoints=f"{point}=kill@1")
    wait_for(lambda: not first.alive(), timeout_s=60, interval_s=0.2, what=f"the kill at {point}")
    stored = scalar(db_url, "SELECT count(*) FROM inbox")
    assert stored > 0, "the failpoint fired before any commit"
    assert scalar(db_url, "SELECT count(*) FROM inbox WHERE ack_state = 'acked'") == 0
    # The broker holds nothing for the dead channel: requeued, or acked.
    wait_for(lambda: queue_counts(rabbit.url, QUEUE)[1] == 0, timeout_s=30, interval_s=0.2, what="requeue")
    again = procs.start("ingest", config, name="ingester-1")
    wait_ready(again)
    wait_for(lambda: settled(db_url, rabbit.url, produced), timeout_s=60, interval_s=0.2, what="convergence")
    assert_clean_exit(again, again.terminate())
    assert_stored_once(db_url, sorted(produced.keys), queue="orders")
    if point == "after_commit":
        # The first batch was delivered twice and stored once.
        assert scalar(db_url, "SELECT max(deliveries) FROM inbox") >= 2
    procs.assert_no_secret_logged()


def test_status_trace_and_an_acker_beside_it_through_the_cli(
    procs: Processes, make_config: Callable[..., Path], db_url: str, rabbit: RabbitMqServer
) -> None:
    """As a user drives it: ``ingest`` and ``ack`` run (the acker skips the
    AMQP adapter: its ingester acks), ``status --json`` shows the queue's
    figures, ``trace`` shows the ack the ingester sent."""
    declare_queue(rabbit.url, QUEUE)
    produced = Produced(rabbit.url)
    config = make_config(amqp_adapter(rabbit.url))
    ingester = procs.start("ingest", config, name="ingester-1")
    acker = procs.start("ack", config, name="acker-1")
    wait_ready(ingester)
    wait_ready(acker)
    produced.with_ids(3, 0)
    wait_for(lambda: settled(db_url, rabbit.url, produced), timeout_s=30, interval_s=0.1, what="acks")
    status = switchboard("--config", str(config), "status", "--json")
    (report,) = json.loads(status.stdout)
    assert report["healthy"] is True, status.stdout
    assert report["ready"] == 0, report
    assert report["consumers"] == 1, report
    assert report["acked_by"] == "ingest", report
    text = switchboard("--config", str(config), "status").stdout
    assert "ack alive              not needed: its ingester acks" in text, text
    trace = switchboard("--config", str(config), "trace", f"amqp:{QUEUE}:m-1")
    assert trace.returncode == 0, trace.stderr
    assert "basic.ack of delivery tag" in trace.stdout, trace.stdout
    assert "acked" in trace.stdout
    for proc in (ingester, acker):
        assert_clean_exit(proc, proc.terminate())
    assert "registered_adapter_skipped" not in acker.raw_log()
    procs.assert_no_secret_logged()


@pytest.mark.parametrize("quorum", [False, True], ids=["classic", "quorum"])
def test_a_message_that_kills_the_ingester_is_rejected_after_max_deliveries(
    procs: Processes, make_config: Callable[..., Path], db_url: str, rabbit: RabbitMqServer, quorum: bool
) -> None:
    """A body that kills the ingester at every store (failpoint): on a
    classic queue, whose ``redelivered`` flag says only "at least twice",
    its redelivery is a suspect at once, stored alone and counted; on a
    quorum queue ``x-delivery-count`` counts. Either way it is rejected past
    ``max_deliveries`` and acked, the others stored once, the queue empty."""
    max_deliveries = 3
    declare_queue(rabbit.url, QUEUE, quorum=quorum)
    produced = Produced(rabbit.url)
    produced.with_ids(30, 0)
    publish(rabbit.url, QUEUE, [b'{"CRASH-ME": true}'], message_ids=["crasher"])
    produced.keys.add(f"amqp:{QUEUE}:crasher")
    produced.with_ids(30, 30)
    config = make_config(amqp_adapter(rabbit.url, batch_size=20, max_deliveries=max_deliveries))

    def crashed_or_done(proc: SwitchboardProcess) -> bool:
        return not proc.alive() or settled(db_url, rabbit.url, produced)

    crashes = 0
    # Play supervisor (systemd's Restart=always): restart the ingester each time it dies.
    for _ in range(max_deliveries + 3):
        ingester = procs.start("ingest", config, name="ingester-1", failpoints="before_store=kill~CRASH-ME")
        wait_for(partial(crashed_or_done, ingester), timeout_s=60, interval_s=0.2, what="a crash or the end")
        if ingester.alive():
            break
        crashes += 1
    assert ingester.alive(), f"still crashing after {crashes} restarts"
    assert_clean_exit(ingester, ingester.terminate())
    rejected = query(
        db_url, "SELECT source_message_id, error, ack_state FROM inbox WHERE status = 'rejected'"
    )
    assert [(m, e.split(":")[0], a) for m, e, a in rejected] == [
        ("crasher", "max_deliveries_exceeded", "acked")
    ]
    assert 2 <= crashes <= max_deliveries
    assert queue_counts(rabbit.url, QUEUE) == (0, 0, 0)
    todos = sorted(k for (k,) in query(db_url, "SELECT idempotency_key FROM todos"))
    assert todos == sorted(produced.keys - {f"amqp:{QUEUE}:crasher"})
