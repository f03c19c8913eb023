"""Randomized kill -9 chaos, as every transport's chaos test runs it: two
ingesters and an acker, one of them killed at a random moment of its work
each round (once it is ready) and most often started again, new messages
produced halfway; at the end every slot running again. The seed is printed (SWITCHBOARD_TEST_SEED
replays it)."""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from pathlib import Path

from ingest.embedded.processes import SwitchboardProcess, wait_ready
from tests.support.processes import Processes

SLOTS = ("ingester-1", "ingester-2", "acker-1")


def seeded() -> tuple[int, random.Random]:
    seed = int(os.environ.get("SWITCHBOARD_TEST_SEED", random.randrange(2**32)))
    print(f"chaos seed: {seed}")
    return seed, random.Random(seed)


def _verb(slot: str) -> str:
    return "ack" if slot.startswith("acker") else "ingest"


def kill9_rounds(
    procs: Processes, config: Path, rng: random.Random, rounds: int, halfway: Callable[[], None]
) -> tuple[dict[str, SwitchboardProcess], int]:
    """Run the rounds (``halfway`` produces the second half of the messages);
    return the running processes, every slot filled and ready, and the
    number of kills."""
    slots: dict[str, SwitchboardProcess] = {s: procs.start(_verb(s), config, name=s) for s in SLOTS}
    kills = 0
    for round_no in range(rounds):
        victim = rng.choice(sorted(slots))
        # At work, not still importing: a process restarted a round ago takes
        # seconds to start, and a full run once found most strikes landing
        # before the victim's first log line, killing nothing that worked.
        wait_ready(slots[victim])
        time.sleep(rng.uniform(0.2, 1.2))  # a random moment to strike, not a wait for an outcome
        slots[victim].kill()
        kills += 1
        if round_no == rounds // 2:
            halfway()
        if rng.random() < 0.7:
            slots[victim] = procs.start(_verb(victim), config, name=victim)
    for name, proc in list(slots.items()):  # every slot running for the finish
        if not proc.alive():
            slots[name] = procs.start(_verb(name), config, name=name)
    for proc in slots.values():
        wait_ready(proc)
    return slots, kills
