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

from ingest.embedded.processes import SwitchboardProcess, wait_for, wait_ready
from tests.support.processes import Processes, assert_clean_exit

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


def stop_settled(slots: dict[str, SwitchboardProcess], settled: Callable[[], bool], *, what: str) -> None:
    """Stop a converged run as an operator would: the ingesters first (each
    must exit cleanly, its last batch stored), then, once ``settled`` holds
    again, the acker.

    With the ingesters running, ``settled`` can hold for a moment while one
    of them still holds a batch it took over from a killed one, entries the
    acker acked meanwhile. Storing that batch asks their acks again (a
    redelivered message's intent is re-armed: the broker may hold it again,
    and a second ack is harmless), so only a check after the last store
    proves every intent discharged. A CI run once stopped the acker inside
    that window and found 100 intents pending."""
    for name, proc in slots.items():
        if name.startswith("ingester"):
            assert_clean_exit(proc, proc.terminate())
    wait_for(settled, timeout_s=60, interval_s=0.2, what=f"{what}, the ingesters stopped")
    for name, proc in slots.items():
        if not name.startswith("ingester"):
            assert_clean_exit(proc, proc.terminate())
