"""Randomized kill -9 chaos: two ingesters and an acker killed repeatedly at
random moments and restarted; the oracle holds at the end. The seed is printed
(and can be fixed with SWITCHBOARD_TEST_SEED) so a failure can be replayed."""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from ingest.embedded.processes import SwitchboardProcess, wait_ready
from tests.support.config import stream_adapter
from tests.support.oracle import assert_exactly_once, wait_all_acked
from tests.support.processes import Processes, assert_clean_exit
from tests.support.streams import produce

pytestmark = pytest.mark.system
STREAM = "orders"
ROUNDS = 12
PER_PHASE = 2000


def test_random_kill9_of_ingesters_and_acker(
    procs: Processes, make_config: Callable[..., Path], db_url: str, redis_url: str
) -> None:
    seed = int(os.environ.get("SWITCHBOARD_TEST_SEED", random.randrange(2**32)))
    print(f"chaos seed: {seed}")
    rng = random.Random(seed)
    # A short claim_idle_ms, so the survivor claims a dead consumer's entries.
    config = make_config(stream_adapter(STREAM, batch_size=100, claim_idle_ms=1500, claim_interval_ms=500))
    ids = produce(redis_url, STREAM, PER_PHASE)
    slots: dict[str, SwitchboardProcess] = {
        "ingester-1": procs.start("ingest", config, name="ingester-1"),
        "ingester-2": procs.start("ingest", config, name="ingester-2"),
        "acker-1": procs.start("ack", config, name="acker-1"),
    }
    kills = 0
    for round_no in range(ROUNDS):
        time.sleep(rng.uniform(0.2, 1.2))  # a random moment to strike, not a wait for an outcome
        victim = rng.choice(sorted(slots))
        slots[victim].kill()
        kills += 1
        if round_no == ROUNDS // 2:
            ids += produce(redis_url, STREAM, PER_PHASE, start=PER_PHASE)
        if rng.random() < 0.7:
            verb = "ack" if victim.startswith("acker") else "ingest"
            slots[victim] = procs.start(verb, config, name=victim)
    for name, proc in list(slots.items()):  # every slot running for the finish
        if not proc.alive():
            slots[name] = procs.start("ack" if name.startswith("acker") else "ingest", config, name=name)
    for proc in slots.values():
        wait_ready(proc)
    total = len(ids)
    wait_all_acked(
        db_url, redis_url, total, timeout_s=120, what=f"convergence after {kills} kills (seed {seed})"
    )
    for proc in slots.values():
        assert_clean_exit(proc, proc.terminate())
    assert_exactly_once(db_url, redis_url, stream=STREAM, group="switchboard", produced_ids=ids)
    procs.assert_no_secret_logged()
