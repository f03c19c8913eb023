"""Config files for tests: the kit's writer (``ingest.embedded.config``) with
the suite's defaults, fast backoff and short refresh periods."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ingest.embedded import config


def stream_adapter(name: str = "orders", **overrides: Any) -> dict[str, Any]:
    adapter: dict[str, Any] = {
        "name": name,
        "transport": "redis",
        "mode": "stream",
        "source": name,
        "group": "switchboard",
        "queue": name,
        "ack_after": "store",
        "batch_size": 100,
        "block_ms": 200,
        "claim_idle_ms": 60_000,
    }
    adapter.update(overrides)
    return adapter


def write_config(
    path: Path,
    *,
    database_url: str,
    redis_url: str,
    adapters: list[Mapping[str, Any]],
    ingest: Mapping[str, Any] | None = None,
    acker: Mapping[str, Any] | None = None,
    database: Mapping[str, Any] | None = None,
    queues: Mapping[str, Mapping[str, Any]] | None = None,
    worker: Mapping[str, Any] | None = None,
    receiver: Mapping[str, Any] | None = None,
) -> Path:
    fast = {"backoff_initial_ms": 50, "backoff_max_ms": 1000}
    return config.write_config(
        path,
        database_url=database_url,
        redis_url=redis_url,
        adapters=adapters,
        database=database,
        ingest={**fast, "enabled_refresh_ms": 200, **(ingest or {})},
        acker={**fast, "poll_interval_ms": 200, **(acker or {})},
        queues=queues,
        worker=worker,
        receiver=receiver,
    )
