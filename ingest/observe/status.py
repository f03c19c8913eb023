"""``switchboard status``: per adapter, the broker's and the database's view,
and a verdict (exit ``EXIT_UNHEALTHY`` when any adapter is unhealthy).

Which adapters: those of the config, then every other adapter in the
``adapters`` table. Whose broker is checked: with adapters in the config,
the config's (a registered adapter absent from it is listed from the
database, unchecked: its broker URL is stored nowhere, and a guess would
report a healthy adapter of another deployment as broken); with none in the
config (no config file), every registered adapter's, at the broker URL the
caller gives (the default transport's variable, or its default).

An adapter is unhealthy when its broker cannot be asked (unreachable, or it
answers with an error), or when a process that served it died: an ingester
reading it, an acker acking it or a worker doing its queue whose heartbeat
row (``processes``) went silent without a stop, and that no newer process of
its role on its host replaced (``backhalf.housekeeping.heartbeats``). A disabled adapter
is still checked and shown, but not counted: an operator disables an adapter
to take it out of service. A dead process that served no adapter shown
makes the exit code non-zero too.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection

from backhalf.db import create_engine
from backhalf.housekeeping import heartbeats
from backhalf.housekeeping.heartbeats import ProcessRow
from backhalf.reads import audit
from backhalf.redaction import redact
from backhalf.writes import registry
from backhalf.writes.registry import AdapterRow
from ingest.adapters import registered
from ingest.adapters.factory import acked_by, make_adapter
from ingest.config import AdapterConfig, Settings
from ingest.errors import BrokerError, ConfigError
from ingest.exit_codes import EXIT_OK, EXIT_UNHEALTHY

NOT_IN_CONFIG = "not checked: not in the config file (its broker URL is stored nowhere)"


async def _broker_view(cfg: AdapterConfig) -> Mapping[str, object]:
    try:
        adapter = make_adapter(cfg, ledger=None)  # describe() only: no group is created
    except ConfigError as exc:
        return {"broker_error": f"cannot be checked: {exc}"}
    try:
        return await adapter.describe()
    except BrokerError as exc:
        return {"broker_error": redact(str(exc))}  # a driver's text may quote a URL
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
    push: bool = False  # a webhook adapter: no broker; served by `switchboard receive`


def _serves(p: ProcessRow, adapter: str, queue: str) -> bool:
    if p.role == "worker":
        return queue in p.detail.get("queues", ())
    return adapter in p.detail.get("adapters", ())


def _label(p: ProcessRow) -> str:
    """How an operator finds it: role, host and pid, and what it reads."""
    consumers = p.detail.get("consumers")
    named = f" ({', '.join(consumers)})" if consumers else ""
    return f"{p.role} {p.host}:{p.pid}{named}"


PUSH_FAMILY = "push"
FAILING = ("dead", "stuck", "failing")
ROLES = ("ingest", "ack", "receive", "worker")


def why(p: ProcessRow) -> str:
    """Why a process is in FAILING, in a few words."""
    if p.state == "dead":
        return f"silent {p.silent_s:.0f} s"
    if p.state == "failing":
        failing = p.detail.get("failing") or {}
        return "; ".join(f"{server} failing: {redact(str(error))}" for server, error in failing.items())
    return f"its loops stuck, seen {p.silent_s:.0f} s"


def _processes_of(procs: Sequence[ProcessRow], adapter: str, queue: str) -> dict[str, Any]:
    """The processes that serve one adapter: alive ones by role; ``dead``,
    those that died or hang (the verdict's business); ``not_running``, the
    roles that served it (a row of theirs is on record) with no process alive
    now. Shown, not judged: processes stopped gracefully were stopped on
    purpose (a deploy, maintenance), and one that died is ``dead`` already."""
    mine = [p for p in procs if _serves(p, adapter, queue)]
    out: dict[str, Any] = {
        role: [_label(p) for p in mine if p.role == role and p.state == "alive"] for role in ROLES
    }
    out["dead"] = [f"{_label(p)}, {why(p)}" for p in mine if p.state in FAILING]
    running = {p.role for p in mine if p.state in ("alive", "stuck", "failing")}
    out["not_running"] = sorted({p.role for p in mine} - running)
    return out


async def collect_processes(settings: Settings) -> list[ProcessRow]:
    engine = create_engine(settings.database)
    try:
        async with engine.connect() as conn:
            return await heartbeats.list_processes(conn)
    finally:
        await engine.dispose()


# Why a queue's handler cannot be imported (None: it can), asked of the
# caller (the CLI, which may import the worker's room).
HandlerCheck = Callable[[str], str | None]


@dataclass(frozen=True, slots=True)
class Figures:
    """What the verdicts are made of from the database: the registered
    adapters, their counts, the todos per queue and status, and the
    transaction holding the ack horizon back."""

    adapters: Mapping[str, AdapterRow]
    counts: Mapping[str, audit.AdapterCounts]
    todos: Mapping[str, Mapping[str, int]]
    holder: audit.HorizonHolder | None


async def read_figures(conn: AsyncConnection) -> Figures:
    """Every count over the whole tables, as `status` reports them (the
    console reads cheaper ones of its own: ``ingest.web``)."""
    return Figures(
        {r.name: r for r in await registry.list_adapters(conn)},
        await audit.adapter_counts(conn),
        await audit.todos_by_status(conn),
        await audit.ack_horizon_holder(conn),
    )


async def collect(
    settings: Settings,
    procs: Sequence[ProcessRow] = (),
    handler_check: HandlerCheck | None = None,
    *,
    db: Figures | None = None,
) -> list[dict[str, Any]]:
    """Registered adapters the config does not name are checked at
    ``settings.default_broker_url`` when the config has no adapters (see the module's
    docstring). ``procs``: the ``processes`` rows, for each adapter's own.
    ``handler_check``: asked for a configured queue no worker serves, so
    that a handler no worker could load (a worker stops at start on it) is
    named, and the adapter unhealthy: its todos pile up. ``db``: the
    database's figures, read by the caller; else :func:`read_figures`."""
    if db is None:
        engine = create_engine(settings.database)
        try:
            async with engine.connect() as conn:
                db = await read_figures(conn)
        finally:
            await engine.dispose()
    rows, counts, todo_counts, holder = db.adapters, db.counts, db.todos, db.holder
    entries = _entries(settings, rows)
    configured = {cfg.name for cfg in settings.adapters} | {w.name for w in settings.webhooks}
    report = []
    for e in entries:
        c = counts.get(e.name)
        broker = await _broker_view(e.cfg) if e.cfg is not None else _push_view(e)
        enabled = c.enabled if c else None
        age = c.oldest_unacked_age if c else None
        settings_of = e.row.settings if e.row is not None else {}
        queue = e.cfg.queue if e.cfg else str(settings_of.get("queue", e.name))
        served = _processes_of(procs, e.name, queue)
        unloadable = None
        if handler_check is not None and queue in settings.queues and not served["worker"]:
            unloadable = handler_check(queue)
        if enabled is False:
            healthy = None
        elif served["dead"] or unloadable is not None:
            healthy = False
        elif e.push:  # nothing to reach but the receiver itself
            healthy = True if served["receive"] else None
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
                **({"acked_by": "ingest"} if acked_by_ingester(e.cfg) else {}),
                "pending_acks": c.pending_acks if c else 0,
                "oldest_unacked_age_s": round(age.total_seconds(), 3) if age is not None else None,
                # The cursor's horizon holds back no ack its ingester sends.
                **({} if acked_by_ingester(e.cfg) else _held_by(age, holder)),
                "stored": c.stored if c else 0,
                "rejected": c.rejected if c else 0,
                "acked": c.acked if c else 0,
                "todos": todo_counts.get(queue, {}),
                **({"handler": f"no worker runs and none could: {unloadable}"} if unloadable else {}),
                "processes": served,
            }
        )
    return report


def _entries(settings: Settings, rows: Mapping[str, AdapterRow]) -> list[_Entry]:
    """The configured adapters, then the registered ones the config does not name."""
    entries: list[_Entry] = [_Entry(cfg.name, rows.get(cfg.name), cfg) for cfg in settings.adapters]
    entries += [_Entry(w.name, rows.get(w.name), push=True) for w in settings.webhooks]
    configured = {e.name for e in entries}
    for name, row in sorted(rows.items()):
        if name in configured:
            continue
        if row.family == PUSH_FAMILY:  # nothing to rebuild: no broker to check
            entries.append(_Entry(name, row, push=True))
            continue
        if settings.adapters:
            entries.append(_Entry(name, row, note=NOT_IN_CONFIG))
            continue
        try:
            entries.append(_Entry(name, row, registered.adapter_config(row, settings.default_broker_url)))
        except ConfigError as exc:  # a row this version cannot rebuild: unhealthy, said why
            entries.append(_Entry(name, row, note=f"cannot be checked: {exc}", failed=True))
    return entries


def _push_view(e: _Entry) -> dict[str, Any] | None:
    if not e.push:
        return None
    return {"family": PUSH_FAMILY, "route": f"POST /hooks/{e.name}"}


def acked_by_ingester(cfg: AdapterConfig | None) -> bool:
    """An adapter whose ingester acks (its transport binds acks to the
    consuming channel): no ack process serves it."""
    try:
        return cfg is not None and acked_by(cfg) == "consumer"
    except ConfigError:  # its transport's client is missing: said by its broker view
        return False


# An ack owed this long, with a transaction of this database holding an id:
# that transaction is named, for stream acks wait for it to end.
HELD_ACK_REPORT_S = 10.0


def _held_by(age: timedelta | None, holder: audit.HorizonHolder | None) -> dict[str, str]:
    if age is None or holder is None or age.total_seconds() < HELD_ACK_REPORT_S:
        return {}
    return {"acks_held_by": holder.describe()}


def unhealthy(report: Sequence[Mapping[str, Any]]) -> list[str]:
    return [r["adapter"] for r in report if r["healthy"] is False]


def dead(procs: Sequence[ProcessRow]) -> list[ProcessRow]:
    """Processes that died (silent, not replaced) or hang (their loops stuck)."""
    return [p for p in procs if p.state in FAILING]


def exit_code(report: Sequence[Mapping[str, Any]], procs: Sequence[ProcessRow] = ()) -> int:
    return EXIT_UNHEALTHY if unhealthy(report) or dead(procs) else EXIT_OK


def render_processes(procs: Sequence[ProcessRow]) -> list[str]:
    """One line per process row: alive and dead ones, and those stopped or
    replaced (reported until the heartbeats forget them, after a day)."""
    if not procs:
        return ["processes: none has written a heartbeat (none started since `switchboard migrate`)"]
    lines = ["processes:"]
    for p in procs:
        what = p.detail.get("queues") if p.role == "worker" else p.detail.get("adapters")
        state = p.state.upper() if p.state in FAILING else p.state
        lines.append(
            f"  {p.role:<7} {state:<8} {p.host}:{p.pid:<8} last seen {p.silent_s:.0f} s ago"
            f"  {', '.join(what or [])}"
        )
        for server, error in (p.detail.get("failing") or {}).items():
            lines.append(f"           {server}: {redact(str(error))}")
    return lines


def shown(value: Any) -> str:
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
            parts.append(f"{k} ({shown(v)})" if isinstance(v, Mapping) else f"{k} {shown(v)}")
        return ", ".join(parts)
    return str(value)


def verdict(r: Mapping[str, Any]) -> str:
    """The words an adapter's health is said in: ``ok``, ``UNHEALTHY``, ``disabled``, ``not checked``."""
    if r["healthy"] is True:
        return "ok"
    if r["healthy"] is False:
        return "UNHEALTHY"
    if r["enabled"] is False:
        return "disabled"
    return "not checked"


_IN_HEADER = ("adapter", "mode", "source", "healthy")


def render(
    report: Sequence[Mapping[str, Any]], as_json: bool, procs: Sequence[ProcessRow] | None = None
) -> str:
    if as_json:
        return json.dumps(list(report), indent=2, default=str)
    if not report:
        lines = ["no adapters configured or registered (start `switchboard ingest` once)"]
        if procs:
            lines += render_processes(procs)
        return "\n".join(lines)
    lines = [line for r in report for line in _render_adapter(r)]
    if procs is not None:
        lines += render_processes(procs)
    bad = unhealthy(report)
    if bad:
        lines.append(f"unhealthy: {', '.join(bad)}")
    if procs is not None and dead(procs):
        lines.append(f"dead processes: {', '.join(_label(p) for p in dead(procs))}")
    return "\n".join(lines)


def _render_adapter(r: Mapping[str, Any]) -> list[str]:
    """One adapter's report: its header with the verdict, a line a key, then the processes serving it."""
    lines = [f"{r['adapter']} ({shown(r['mode'])} {shown(r['source'])}): {verdict(r)}"]
    for key, value in r.items():
        if key in _IN_HEADER or key == "processes":
            continue
        text = f"{value} s" if key == "oldest_unacked_age_s" and value is not None else shown(value)
        lines.append(f"  {key:<22} {text}")
    served = r.get("processes") or {}
    roles = ("receive", "worker") if r.get("family") == PUSH_FAMILY else ("ingest", "ack", "worker")
    for role in roles:
        alive = ", ".join(served.get(role, [])) or "none"
        if role == "ack" and r.get("acked_by") == "ingest":
            alive = "not needed: its ingester acks"
        lines.append(f"  {role + ' alive':<22} {alive}")
    if served.get("dead"):
        lines.append(f"  {'DEAD':<22} {'; '.join(served['dead'])}")
    if served.get("not_running"):
        lines.append(f"  {'not running':<22} no {', no '.join(served['not_running'])} process alive")
    return lines
