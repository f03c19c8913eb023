"""NATS JetStream under real faults: ingesters and the acker killed with
kill -9 at random moments, and the nats-server itself restarted mid-run
(file storage). Each ends with one todo per message, every message acked
at the server (nothing unacked, nothing undelivered) and no inbox row
pending. The chaos seed is printed (SWITCHBOARD_TEST_SEED replays it)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ingest.embedded.nats_server import NatsServer
from ingest.embedded.processes import wait_for
from tests.support.chaos import kill9_rounds, seeded
from tests.support.db import acked
from tests.support.nats import consumer_figures, create_stream, owned_nats, publish
from tests.support.oracle import assert_stored_once
from tests.support.processes import Processes, assert_clean_exit

pytestmark = pytest.mark.system
STREAM = "ORDERS"
SUBJECT = "ORDERS.new"
GROUP = "switchboard"
PER_PHASE = 1500
ROUNDS = 10


@pytest.fixture
def nats() -> Iterator[NatsServer]:
    with owned_nats() as server:
        create_stream(server.url, STREAM)
        yield server


def nats_adapter(url: str, **overrides: object) -> dict[str, object]:
    # ack_wait: what a killed ingester left unacked comes back this soon.
    return {
        "name": "orders",
        "transport": "nats",
        "mode": "jetstream",
        "source": STREAM,
        "group": GROUP,
        "queue": "orders",
        "url": url,
        "batch_size": 100,
        "block_ms": 200,
        "ack_wait_ms": 3000,
        **overrides,
    }


def bodies(n: int, start: int = 0) -> list[bytes]:
    return [json.dumps({"order": i}).encode() for i in range(start, start + n)]


def keys(sequences: list[int]) -> list[str]:
    return [f"nats:{STREAM}:{seq}" for seq in sequences]


def settled(db_url: str, url: str, total: int) -> bool:
    figures = consumer_figures(url, STREAM, GROUP)
    return acked(db_url) == total and figures == (0, 0)


def test_random_kill9_of_ingesters_and_acker(
    procs: Processes, make_config: Callable[..., Path], db_url: str, nats: NatsServer
) -> None:
    seed, rng = seeded()
    config = make_config(nats_adapter(nats.url))
    sequences = publish(nats.url, SUBJECT, bodies(PER_PHASE))

    def halfway() -> None:
        sequences.extend(publish(nats.url, SUBJECT, bodies(PER_PHASE, start=PER_PHASE)))

    slots, kills = kill9_rounds(procs, config, rng, ROUNDS, halfway)
    total = len(sequences)
    wait_for(
        lambda: settled(db_url, nats.url, total),
        timeout_s=120,
        interval_s=0.5,
        what=f"convergence after {kills} kills (seed {seed})",
    )
    for proc in slots.values():
        assert_clean_exit(proc, proc.terminate())
    assert_stored_once(db_url, keys(sequences), queue="orders")
    procs.assert_no_secret_logged()


def test_a_nats_server_restarted_mid_run_loses_and_doubles_nothing(
    procs: Processes, make_config: Callable[..., Path], db_url: str, nats: NatsServer
) -> None:
    config = make_config(nats_adapter(nats.url))
    sequences = publish(nats.url, SUBJECT, bodies(500))
    ingester = procs.start("ingest", config, name="ingester")
    acker = procs.start("ack", config, name="acker")
    wait_for(lambda: acked(db_url) > 0, timeout_s=60, what="the first acks")
    nats.restart()  # SIGTERM, then a start on the same port and store
    sequences += publish(nats.url, SUBJECT, bodies(500, start=500))
    wait_for(
        lambda: settled(db_url, nats.url, len(sequences)),
        timeout_s=120,
        interval_s=0.5,
        what="convergence after the server's restart",
    )
    # Both processes lived through it: they backed off and reconnected.
    assert ingester.alive()
    assert acker.alive()
    assert ingester.events("broker_error")
    for proc in (ingester, acker):
        assert_clean_exit(proc, proc.terminate())
    assert_stored_once(db_url, keys(sequences), queue="orders")
    procs.assert_no_secret_logged()
