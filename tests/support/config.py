"""Config files for tests, written in the contract's TOML form."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return str(v)
    return json.dumps(str(v))  # a JSON string of ASCII/escapes is a TOML basic string


def _table(values: Mapping[str, Any]) -> str:
    return "".join(f"{k} = {_value(v)}\n" for k, v in values.items())


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
) -> Path:
    text = f"[database]\n{_table({'url': database_url, **(database or {})})}"
    text += f"\n[redis]\n{_table({'url': redis_url})}"
    for a in adapters:
        text += f"\n[[adapters]]\n{_table(a)}"
    fast = {"backoff_initial_ms": 50, "backoff_max_ms": 1000}
    text += f"\n[ingest]\n{_table({**fast, 'enabled_refresh_ms': 200, **(ingest or {})})}"
    text += f"\n[acker]\n{_table({**fast, 'poll_interval_ms': 200, **(acker or {})})}"
    path.write_text(text)
    return path
