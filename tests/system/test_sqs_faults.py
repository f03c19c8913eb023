"""SQS's own fault: a FIFO queue's groups stored in their order across
kill -9 chaos, against the suite's SQS-compatible server (moto, with its
FIFO fix). The chaos every transport suffers is test_transport_faults.py.
The run ends with one todo per message, every inbox ack intent discharged
and the queue empty (nothing visible, nothing in flight). The chaos seed
is printed (SWITCHBOARD_TEST_SEED replays it)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ingest.embedded.processes import wait_for
from ingest.embedded.sqs_server import SqsServer
from tests.support.chaos import kill9_rounds, seeded
from tests.support.db import acked, query
from tests.support.oracle import assert_stored_once
from tests.support.processes import Processes, stop_settled
from tests.support.sqs import client, counts, create_queue, owned_sqs, send, use_emulator_credentials

pytestmark = pytest.mark.system
# Small: the emulator's receive slows with the queue's depth.
PER_PHASE = 250
ROUNDS = 8


@pytest.fixture
def sqs_server(monkeypatch: pytest.MonkeyPatch) -> Iterator[SqsServer]:
    use_emulator_credentials(monkeypatch)  # and so every process started here
    with owned_sqs() as server:
        yield server


def sqs_adapter(endpoint: str, queue: str, **overrides: object) -> dict[str, object]:
    # ack_wait: what a killed ingester left undeleted comes back this soon.
    return {
        "name": "orders",
        "transport": "sqs",
        "source": queue,
        "queue": "orders",
        "url": endpoint,
        "region": "us-east-1",
        "batch_size": 50,
        "block_ms": 1000,
        "ack_wait_ms": 3000,
        **overrides,
    }


def bodies(n: int, start: int = 0, **extra: Any) -> list[bytes]:
    return [json.dumps({"order": i, **extra}).encode() for i in range(start, start + n)]


def settled(db_url: str, sqs: Any, url: str, total: int) -> bool:
    return acked(db_url) == total and counts(sqs, url) == (0, 0, 0)


def test_fifo_groups_keep_their_order_across_kill9(
    procs: Processes, make_config: Callable[..., Path], db_url: str, sqs_server: SqsServer
) -> None:
    """A group's next messages are received only once the earlier ones are
    deleted; a killed ingester's unstored messages come back first, after
    their visibility timeout. So within a group, no later message is stored
    (its batch's transaction, ``stored_at``) before an earlier one."""
    seed, rng = seeded()
    sqs = client(sqs_server.url)
    url = create_queue(sqs, "orders.fifo", fifo=True)
    groups = ("a", "b", "c", "d")
    ids: list[str] = []
    for group in groups:
        ids += send(sqs, url, bodies(30, group=group), group=group)
    config = make_config(sqs_adapter(sqs_server.url, "orders.fifo", batch_size=10))

    def halfway() -> None:
        for group in groups:
            ids.extend(send(sqs, url, bodies(30, start=30, group=group), group=group))

    slots, kills = kill9_rounds(procs, config, rng, ROUNDS // 2, halfway)
    what = f"convergence after {kills} kills (seed {seed})"

    def converged() -> bool:
        return settled(db_url, sqs, url, len(ids))

    wait_for(converged, timeout_s=120, interval_s=0.5, what=what)
    stop_settled(slots.values(), converged, what=what)
    assert_stored_once(db_url, [f"sqs:orders.fifo:{i}" for i in ids], queue="orders")
    rows = [(json.loads(bytes(b)), at) for b, at in query(db_url, "SELECT body, stored_at FROM inbox")]
    for group in groups:
        in_order = sorted((m["order"], at) for m, at in rows if m["group"] == group)
        assert [n for n, _ in in_order] == list(range(60))
        times = [at for _, at in in_order]
        assert times == sorted(times), f"group {group} stored out of order (seed {seed})"
    procs.assert_no_secret_logged()
