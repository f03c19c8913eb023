"""The poll loop's commits under way (``ingest.processes.pull.commits.Commits``): which waits
mean what, and how a failure travels from one commit to the next."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
import structlog

from backhalf.errors import StoreError
from ingest.processes.pull.commits import Commit, Commits


def chained(
    gates: list[asyncio.Event], outcome: dict[int, BaseException]
) -> tuple[Callable[[int], Commit], list[int]]:
    """Commits like the poll loop's: each ends when its gate opens, fails if
    ``outcome`` says so, then waits for the one before it to be confirmed.
    Also returns the order in which they were confirmed."""
    order: list[int] = []

    def commit(n: int) -> Commit:
        async def run(after: asyncio.Task[None] | None) -> None:
            await gates[n].wait()
            if n in outcome:
                raise outcome[n]
            if after is not None:
                await after
            order.append(n)

        return run

    return commit, order


async def test_commits_are_confirmed_in_order_and_waited_for_below_a_limit() -> None:
    commits = Commits(structlog.get_logger("t"))
    gates = [asyncio.Event() for _ in range(3)]
    commit, order = chained(gates, {})
    for n in range(3):
        commits.start(commit(n), name=f"commit:{n}")
    gates[2].set()
    gates[1].set()
    await asyncio.sleep(0.01)
    commits.reap_ended()
    assert len(commits) == 3, "the later ones wait for the first to be confirmed"
    waiting = asyncio.create_task(commits.wait_below(2))
    await asyncio.sleep(0.01)
    assert not waiting.done()
    gates[0].set()
    await waiting
    assert len(commits) < 2
    assert order[:2] == [0, 1]
    await commits.wait_all()
    assert order == [0, 1, 2]
    assert len(commits) == 0


async def test_reaping_lets_go_of_ended_commits_and_raises_the_first_failure() -> None:
    commits = Commits(structlog.get_logger("t"))
    boom = StoreError("first failed")
    gates = [asyncio.Event() for _ in range(3)]
    commit, _order = chained(gates, {0: boom})
    for n in range(3):
        commits.start(commit(n), name=f"commit:{n}")
    commits.reap_ended()  # nothing ended yet: no wait, nothing raised
    assert len(commits) == 3
    gates[0].set()
    gates[1].set()
    await asyncio.sleep(0.01)
    with pytest.raises(StoreError) as raised:
        commits.reap_ended()
    assert raised.value is boom
    assert len(commits) == 2, "the failed one is let go of; the one still running stays"
    with structlog.testing.capture_logs() as logged:
        gates[2].set()
        assert await commits.settle(reported=boom)
    assert logged == [], "the later commits failed with the reported failure: logged once, by the caller"


async def test_a_failed_wait_leaves_the_commit_for_settle_which_logs_each_other_failure_once() -> None:
    commits = Commits(structlog.get_logger("t"))
    first, third = StoreError("first failed"), ZeroDivisionError("a bug")
    gates = [asyncio.Event() for _ in range(4)]
    commit, order = chained(gates, {0: first, 2: third})
    for n in range(4):
        commits.start(commit(n), name=f"commit:{n}")
    for gate in gates:
        gate.set()
    with pytest.raises(StoreError):
        await commits.wait_all()
    assert len(commits) == 4
    with structlog.testing.capture_logs() as logged:
        assert await commits.settle(reported=first)
    assert len(commits) == 0
    assert order == []
    # commit 1 re-raised ``first`` (reported), commit 3 re-raised ``third``: logged once.
    assert [(e["event"], e["log_level"], e["error"], e["overlapping"]) for e in logged] == [
        ("store_failed", "error", third, True)
    ]


async def test_settling_without_a_failure_says_so() -> None:
    commits = Commits(structlog.get_logger("t"))
    gates = [asyncio.Event() for _ in range(2)]
    commit, order = chained(gates, {})
    for n in range(2):
        commits.start(commit(n), name=f"commit:{n}")
    for gate in gates:
        gate.set()
    assert not await commits.settle(reported=None)
    assert order == [0, 1]


async def test_cancel_ends_every_commit_under_way() -> None:
    commits = Commits(structlog.get_logger("t"))
    gates = [asyncio.Event() for _ in range(2)]
    commit, order = chained(gates, {})
    for n in range(2):
        commits.start(commit(n), name=f"commit:{n}")
    await asyncio.sleep(0)
    await commits.cancel(timeout_s=1)
    assert len(commits) == 0
    assert order == []
    assert not [t for t in asyncio.all_tasks() if t.get_name().startswith("commit:")]
