"""consumer_name_in_use compares (adapter, consumer) pairs (issue 44; a
review's finding: two sets once warned of pairs nobody shared)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

from backhalf.housekeeping.heartbeats import ProcessRow
from ingest.processes.pull.ingester import taken_consumers

NOW = datetime(2026, 12, 6, tzinfo=UTC)


def ingester(detail: dict[str, Any], host: str = "other-host", state: str = "alive") -> ProcessRow:
    return ProcessRow(uuid.uuid4(), "ingest", host, 1, detail, NOW, NOW, None, state, 1.0)


def test_only_a_shared_adapter_and_consumer_pair_is_taken() -> None:
    ours = {"adapters": ["x"], "consumers": ["c2"], "reading": [["x", "c2"]]}
    apart = ingester(
        {"adapters": ["x", "y"], "consumers": ["c1", "c2"], "reading": [["x", "c1"], ["y", "c2"]]}
    )
    same = ingester({"adapters": ["x"], "consumers": ["c2"], "reading": [["x", "c2"]]})
    older = ingester({"adapters": ["x"], "consumers": ["c2"]})  # a row from before "reading"
    dead = ingester({"adapters": ["x"], "consumers": ["c2"], "reading": [["x", "c2"]]}, state="dead")
    assert taken_consumers([apart, same, older, dead], ours, "this-host") == [same, older]
