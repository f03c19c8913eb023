"""``switchboard status``: per adapter, the broker's and the database's view."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from backhalf import audit
from backhalf.db import create_engine
from ingest.adapters.factory import make_adapter
from ingest.config import Settings
from ingest.errors import BrokerError


async def collect(settings: Settings) -> list[dict[str, Any]]:
    engine = create_engine(settings.database)
    try:
        async with engine.connect() as conn:
            counts = await audit.adapter_counts(conn)
            todo_counts = await audit.todos_by_status(conn)
    finally:
        await engine.dispose()
    report = []
    for cfg in settings.adapters:
        c = counts.get(cfg.name)
        adapter = make_adapter(cfg)
        try:
            broker: Mapping[str, object] = await adapter.describe()
        except BrokerError as exc:
            broker = {"broker_error": str(exc)}
        finally:
            await adapter.close()
        age = c.oldest_unacked_age if c else None
        report.append(
            {
                "adapter": cfg.name,
                "mode": cfg.mode,
                "source": cfg.source,
                "registered": c is not None,
                "enabled": c.enabled if c else None,
                **broker,
                "pending_acks": c.pending_acks if c else 0,
                "oldest_unacked_age_s": round(age.total_seconds(), 3) if age is not None else None,
                "stored": c.stored if c else 0,
                "rejected": c.rejected if c else 0,
                "acked": c.acked if c else 0,
                "todos": todo_counts.get(cfg.queue, {}),
            }
        )
    return report


def render(report: list[dict[str, Any]], as_json: bool) -> str:
    if as_json:
        return json.dumps(report, indent=2, default=str)
    lines = []
    for r in report:
        lines.append(f"{r['adapter']} ({r['mode']} {r['source']})")
        for key, value in r.items():
            if key not in ("adapter", "mode", "source"):
                lines.append(f"  {key:<22} {value}")
    return "\n".join(lines) if lines else "no adapters configured"
