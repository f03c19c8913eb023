"""``switchboard status``: per adapter, the broker's and the database's view,
and a verdict (exit ``EXIT_UNHEALTHY`` when any adapter is unhealthy).

Which adapters: those of the config, then every other adapter in the
``adapters`` table. Whose broker is checked: with adapters in the config,
the config's (a registered adapter absent from it is listed from the
database, unchecked: its broker URL is stored nowhere, and a guess would
report a healthy adapter of another deployment as broken); with none in the
config (no config file), every registered adapter's, at the broker URL the
caller gives (``SWITCHBOARD_REDIS_URL`` or the default).

An adapter is unhealthy when its broker cannot be asked (unreachable, or it
answers with an error). A disabled adapter is still checked and shown, but
not counted: an operator disables an adapter to take it out of service.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from backhalf import audit, registry
from backhalf.db import create_engine
from backhalf.registry import AdapterRow
from ingest import registered
from ingest.adapters.factory import make_adapter
from ingest.config import AdapterConfig, Settings
from ingest.errors import BrokerError, ConfigError
from ingest.exit_codes import EXIT_OK, EXIT_UNHEALTHY

NOT_IN_CONFIG = "not checked: not in the config file (its broker URL is stored nowhere)"


async def _broker_view(cfg: AdapterConfig) -> Mapping[str, object]:
    try:
        adapter = make_adapter(cfg, group_starts=None)  # describe() only: no group is created
    except ConfigError as exc:
        return {"broker_error": f"cannot be checked: {exc}"}
    try:
        return await adapter.describe()
    except BrokerError as exc:
        return {"broker_error": str(exc)}
    finally:
        await adapter.close()


@dataclass(frozen=True, slots=True)
class _Entry:
    """One adapter to report: ``cfg`` to check its broker with, else ``note``
    says why it is not checked (``failed``: and counts as unhealthy)."""

    name: str
    row: AdapterRow | None
    cfg: AdapterConfig | None = None
    note: str | None = None
    failed: bool = False


async def collect(settings: Settings) -> list[dict[str, Any]]:
    """Registered adapters the config does not name are checked at
    ``settings.redis_url`` when the config has no adapters (see the module's
    docstring)."""
    engine = create_engine(settings.database)
    try:
        async with engine.connect() as conn:
            rows = {r.name: r for r in await registry.list_adapters(conn)}
            counts = await audit.adapter_counts(conn)
            todo_counts = await audit.todos_by_status(conn)
    finally:
        await engine.dispose()
    entries: list[_Entry] = [_Entry(cfg.name, rows.get(cfg.name), cfg) for cfg in settings.adapters]
    configured = {cfg.name for cfg in settings.adapters}
    for name, row in sorted(rows.items()):
        if name in configured:
            continue
        if settings.adapters:
            entries.append(_Entry(name, row, note=NOT_IN_CONFIG))
            continue
        try:
            entries.append(_Entry(name, row, registered.adapter_config(row, settings.redis_url)))
        except ConfigError as exc:  # a row this version cannot rebuild: unhealthy, said why
            entries.append(_Entry(name, row, note=f"cannot be checked: {exc}", failed=True))
    report = []
    for e in entries:
        c = counts.get(e.name)
        broker = await _broker_view(e.cfg) if e.cfg is not None else None
        enabled = c.enabled if c else None
        age = c.oldest_unacked_age if c else None
        settings_of = e.row.settings if e.row is not None else {}
        if enabled is False:
            healthy = None
        elif broker is not None:
            healthy = "broker_error" not in broker
        else:
            healthy = False if e.failed else None
        report.append(
            {
                "adapter": e.name,
                "mode": e.cfg.mode if e.cfg else (e.row.mode if e.row else None),
                "source": e.cfg.source if e.cfg else settings_of.get("source"),
                "defined_in": "config" if e.name in configured else "database",
                "healthy": healthy,
                "registered": e.row is not None,
                "enabled": enabled,
                **({"broker": e.note} if e.note is not None else {}),
                **(broker or {}),
                "pending_acks": c.pending_acks if c else 0,
                "oldest_unacked_age_s": round(age.total_seconds(), 3) if age is not None else None,
                "stored": c.stored if c else 0,
                "rejected": c.rejected if c else 0,
                "acked": c.acked if c else 0,
                "todos": todo_counts.get(e.cfg.queue if e.cfg else str(settings_of.get("queue", e.name)), {}),
            }
        )
    return report


def unhealthy(report: Sequence[Mapping[str, Any]]) -> list[str]:
    return [r["adapter"] for r in report if r["healthy"] is False]


def exit_code(report: Sequence[Mapping[str, Any]]) -> int:
    return EXIT_UNHEALTHY if unhealthy(report) else EXIT_OK


def _text(value: Any) -> str:
    """A value as an operator reads it: no Python ``True``, ``None`` or dicts."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, Mapping):
        if not value:
            return "none"
        parts = []
        for k, v in value.items():
            parts.append(f"{k} ({_text(v)})" if isinstance(v, Mapping) else f"{k} {_text(v)}")
        return ", ".join(parts)
    return str(value)


def _verdict(r: Mapping[str, Any]) -> str:
    if r["healthy"] is True:
        return "ok"
    if r["healthy"] is False:
        return "UNHEALTHY"
    if r["enabled"] is False:
        return "disabled"
    return "not checked"


_IN_HEADER = ("adapter", "mode", "source", "healthy")


def render(report: Sequence[Mapping[str, Any]], as_json: bool) -> str:
    if as_json:
        return json.dumps(list(report), indent=2, default=str)
    if not report:
        return "no adapters configured or registered (start `switchboard ingest` once)"
    lines = []
    for r in report:
        lines.append(f"{r['adapter']} ({_text(r['mode'])} {_text(r['source'])}): {_verdict(r)}")
        for key, value in r.items():
            if key in _IN_HEADER:
                continue
            shown = f"{value} s" if key == "oldest_unacked_age_s" and value is not None else _text(value)
            lines.append(f"  {key:<22} {shown}")
    bad = unhealthy(report)
    if bad:
        lines.append(f"unhealthy: {', '.join(bad)}")
    return "\n".join(lines)
