"""The ingester's start-up checks: the pool the poll loops can use."""

from __future__ import annotations

import pytest
import structlog

from ingest.config import from_mapping
from ingest.processes.pull.ingester import connections_needed, warn_if_pool_small


class _Mode:
    def __init__(self, overlapping: bool) -> None:
        self.overlapping_commits = overlapping


@pytest.mark.parametrize(
    ("streams", "lists", "pool_size", "warned"),
    [(1, 0, 4, False), (2, 0, 4, False), (3, 0, 4, True), (3, 0, 7, False), (1, 3, 2, True)],
)
def test_a_pool_smaller_than_the_loops_can_use_is_warned_of_at_start(
    streams: int, lists: int, pool_size: int, warned: bool
) -> None:
    settings = from_mapping(
        {
            "database": {"url": "postgresql://db/x", "pool_size": pool_size},
            "adapters": [{"name": "a", "source": "a"}],
        },
        {},
    )
    adapters = [_Mode(True)] * streams + [_Mode(False)] * lists
    # A stream adapter: two commits and the loop's own transaction; a list: one and one.
    assert connections_needed(adapters, 2) == 3 * streams + 2 * lists  # type: ignore[arg-type]
    with structlog.testing.capture_logs() as logged:
        warn_if_pool_small(adapters, settings)  # type: ignore[arg-type]
    warnings = [e for e in logged if e["event"] == "pool_smaller_than_needed"]
    assert bool(warnings) == warned
    if warned:
        needed = 3 * streams + 2 * lists
        assert warnings[0]["hint"] == f"set [database] pool_size to at least {needed - 2}"
