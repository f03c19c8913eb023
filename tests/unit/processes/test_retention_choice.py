"""Which retention deletes finished todos: their partitions, dropped whole
(the history is partitioned and every queue has a ``retain_done_days``:
the longest), or the row walk (a queue that keeps them less long than the
longest; every queue where the history is not partitioned, or where one
queue keeps them for ever). Decision 0007."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from ingest.config import Settings, from_mapping
from ingest.processes.ack.partitions import done_keep, partitioned
from ingest.processes.ack.prune import walks

HISTORY = {"retain_history_days": 30}


def _settings(queues: dict[str, dict[str, Any]], acker: dict[str, Any] | None = HISTORY) -> Settings:
    raw: dict[str, Any] = {"database": {"url": "postgresql://u@h/d"}, "queues": queues}
    if acker:
        raw["acker"] = acker
    return from_mapping(raw, {})


def _done_walks(s: Settings) -> dict[str, float]:
    return {w.name: w.age.total_seconds() / 86_400 for w in walks(s) if w.kind == "done"}


def test_every_queue_with_a_done_retention_goes_by_partition_at_the_longest() -> None:
    s = _settings(
        {
            "orders": {"handler": "m:f", "retain_done_days": 7},
            "refunds": {"handler": "m:f", "retain_done_days": 2, "retain_failed_days": 30},
        }
    )
    assert done_keep(s) == timedelta(days=7)
    assert partitioned(s)
    # orders' done todos go with their partitions; refunds' are walked down to 2 days.
    assert _done_walks(s) == {"refunds": 2}
    assert {w.name for w in walks(s) if w.kind == "failed"} == {"refunds"}


def test_a_queue_that_keeps_its_todos_for_ever_keeps_every_partition() -> None:
    s = _settings({"orders": {"handler": "m:f", "retain_done_days": 7}, "archive": {"handler": "m:f"}})
    assert done_keep(s) is None
    assert partitioned(s)  # the history's partitions still
    assert _done_walks(s) == {"orders": 7}


def test_an_adapters_queue_without_a_section_keeps_its_todos_for_ever() -> None:
    s = from_mapping(
        {
            "database": {"url": "postgresql://u@h/d"},
            "acker": HISTORY,
            "adapters": [{"name": "orders", "source": "orders"}, {"name": "audit", "source": "audit"}],
            "queues": {"orders": {"handler": "m:f", "retain_done_days": 7}},
        },
        {},
    )
    assert done_keep(s) is None
    assert _done_walks(s) == {"orders": 7}


def test_the_partitions_keep_finished_todos_at_least_the_row_walks_floor() -> None:
    s = _settings({"orders": {"handler": "m:f", "retain_done_days": 0.01}})
    assert done_keep(s) == timedelta(hours=1)


def test_without_a_partitioned_history_every_queue_is_walked_row_by_row() -> None:
    s = _settings({"orders": {"handler": "m:f", "retain_done_days": 7}}, acker=None)
    assert done_keep(s) is None
    assert not partitioned(s)
    assert _done_walks(s) == {"orders": 7}


def test_no_queue_no_partitioned_todos_and_history_alone_partitions() -> None:
    assert done_keep(_settings({})) is None
    assert partitioned(_settings({}))
