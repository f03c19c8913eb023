"""Two live ingesters under one consumer name share a stream consumer's
pending list (or a list's processing list), each taking the other's
unacked messages for its own: the second is told at its start (issue 44).
A restart after a crash is the same process slot, not another: no warning."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from ingest.embedded.processes import wait_for, wait_ready
from tests.support.processes import Processes, assert_clean_exit

pytestmark = pytest.mark.system


def test_a_second_ingester_under_a_consumer_name_in_use_is_warned(
    procs: Processes, make_config: Callable[..., Path]
) -> None:
    config = make_config()
    first = procs.start("ingest", config, name="slot-1")
    wait_ready(first)
    wait_for(lambda: first.events("heartbeat_started"), timeout_s=30, what="the first one's heartbeat")
    second = procs.start("ingest", config, name="slot-1")
    wait_for(lambda: second.events("consumer_name_in_use"), timeout_s=30, what="the warning")
    (warning,) = second.events("consumer_name_in_use")
    assert warning["consumers"] == ["slot-1"]
    assert warning["adapters"] == ["orders"]
    assert warning["other_pid"] == first.pid
    other = procs.start("ingest", config, name="slot-2")
    wait_ready(other)
    assert not other.events("consumer_name_in_use")
    assert not first.events("consumer_name_in_use")
    # Both slot-1 processes crash; their rows are still fresh when the
    # supervisor starts the slot again at once: not a second process.
    first.kill()
    second.kill()
    again = procs.start("ingest", config, name="slot-1")
    wait_ready(again)
    assert not again.events("consumer_name_in_use")
    for proc in (other, again):
        assert_clean_exit(proc, proc.terminate())
