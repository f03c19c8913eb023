"""Randomized kill -9 chaos: two ingesters and an acker killed repeatedly at
random moments and restarted; the oracle holds at the end. The seed is printed
(and can be fixed with SWITCHBOARD_TEST_SEED) so a failure can be replayed."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.chaos import kill9_rounds, seeded
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
    seed, rng = seeded()
    # A short claim_idle_ms, so the survivor claims a dead consumer's entries.
    config = make_config(stream_adapter(STREAM, batch_size=100, claim_idle_ms=1500, claim_interval_ms=500))
    ids = produce(redis_url, STREAM, PER_PHASE)

    def halfway() -> None:
        ids.extend(produce(redis_url, STREAM, PER_PHASE, start=PER_PHASE))

    slots, kills = kill9_rounds(procs, config, rng, ROUNDS, halfway)
    total = len(ids)
    wait_all_acked(
        db_url, redis_url, total, timeout_s=120, what=f"convergence after {kills} kills (seed {seed})"
    )
    for proc in slots.values():
        assert_clean_exit(proc, proc.terminate())
    assert_exactly_once(db_url, redis_url, stream=STREAM, group="switchboard", produced_ids=ids)
    procs.assert_no_secret_logged()
