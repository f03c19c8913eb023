"""The ``processes`` table: each running Switchboard process's heartbeat row,
and the reading of them that ``switchboard status`` reports.

A process is *alive* while its row is fresh (seen within ``ttl_s``) and not
stopped, and *stuck* when fresh but its own loops are not (``detail.healthy``
false: it beats, but a loop hangs), *failing* when fresh but a server it
needs has failed every try for a while (``detail.failing``, named with the
error). It is *dead* when its row is neither
stopped nor fresh and no newer process of the same role, on the same host
and in the same *slot* (``detail.slot``: what it serves, say the adapters
and consumer names of an ingester, so ``ingest@2``'s restart does not hide
a dead ``ingest@1``), has started since it was last seen: a supervisor's
restart replaces it. Rows stopped or silent for longer than
``FORGET_AFTER_S`` are deleted by the next process to start, so a host
scaled down by a crash stops being reported after a day.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncConnection

from schema import processes

HEARTBEAT_INTERVAL_S = 5.0
# Three beats missed: dead. A beat is one short statement; a database
# outage long enough to miss three makes every process look dead, which
# is what status should say then (nothing can be stored either).
HEARTBEAT_TTL_S = 3 * HEARTBEAT_INTERVAL_S
FORGET_AFTER_S = 86_400.0


def slot(*parts: Sequence[str]) -> str:
    """A process's slot, from what it serves: equal for a process and its
    restart, distinct for two processes side by side."""
    return "|".join(",".join(sorted(p)) for p in parts)


def _seconds(value: float) -> sa.ColumnElement[Any]:
    return sa.func.make_interval(0, 0, 0, 0, 0, 0, sa.bindparam(None, value, sa.Float))


def beat_statement(
    instance: uuid.UUID, role: str, host: str, pid: int, detail: Mapping[str, Any]
) -> sa.Insert:
    """Insert this process's row, or refresh its ``seen_at``."""
    stmt = insert(processes).values(instance=instance, role=role, host=host, pid=pid, detail=dict(detail))
    return stmt.on_conflict_do_update(
        index_elements=[processes.c.instance],
        set_={"seen_at": sa.func.now(), "detail": stmt.excluded.detail},
    )


def forget_statement() -> sa.Delete:
    """Rows of processes stopped, or silent, for longer than FORGET_AFTER_S."""
    cutoff = sa.func.now() - _seconds(FORGET_AFTER_S)
    return sa.delete(processes).where(sa.or_(processes.c.stopped_at < cutoff, processes.c.seen_at < cutoff))


def stopped_statement(instance: uuid.UUID) -> sa.Update:
    return (
        sa.update(processes)
        .where(processes.c.instance == instance)
        .values(stopped_at=sa.func.now(), seen_at=sa.func.now())
    )


def alive_children_statement(
    role: str, host: str, parent: int, ttl_s: float = HEARTBEAT_TTL_S
) -> sa.Select[Any]:
    """The ``detail`` of each process of ``role`` on ``host`` whose parent is
    ``parent`` (the dramatiq main process of a worker deployment) alive now."""
    return sa.select(processes.c.detail).where(
        processes.c.role == role,
        processes.c.host == host,
        processes.c.stopped_at.is_(None),
        processes.c.detail["parent"].as_integer() == parent,
        processes.c.seen_at >= sa.func.now() - _seconds(ttl_s),
    )


@dataclass(frozen=True, slots=True)
class ProcessRow:
    instance: uuid.UUID
    role: str
    host: str
    pid: int
    detail: Mapping[str, Any]
    started_at: datetime
    seen_at: datetime
    stopped_at: datetime | None
    state: str  # alive | stuck | failing | dead | stopped | replaced
    silent_s: float  # since its last heartbeat


async def list_processes(conn: AsyncConnection, ttl_s: float = HEARTBEAT_TTL_S) -> list[ProcessRow]:
    """Every row, with its state as the module's docstring defines it."""
    newer = processes.alias("newer")
    fresh = processes.c.seen_at >= sa.func.now() - _seconds(ttl_s)
    replaced = sa.exists().where(
        newer.c.role == processes.c.role,
        newer.c.host == processes.c.host,
        # Rows written before slots existed have none: one slot, "", per role and host.
        sa.func.coalesce(newer.c.detail["slot"].astext, "")
        == sa.func.coalesce(processes.c.detail["slot"].astext, ""),
        newer.c.instance != processes.c.instance,
        newer.c.started_at > processes.c.seen_at,
    )
    state = sa.case(
        (processes.c.stopped_at.isnot(None), "stopped"),
        (sa.and_(fresh, processes.c.detail["healthy"].as_boolean().is_(sa.false())), "stuck"),
        # A server it needs keeps failing (heartbeat detail "failing").
        (sa.and_(fresh, processes.c.detail.has_key("failing")), "failing"),
        (fresh, "alive"),
        (replaced, "replaced"),
        else_="dead",
    )
    silent = sa.extract("epoch", sa.func.now() - processes.c.seen_at)
    rows = await conn.execute(
        sa.select(
            processes.c.instance,
            processes.c.role,
            processes.c.host,
            processes.c.pid,
            processes.c.detail,
            processes.c.started_at,
            processes.c.seen_at,
            processes.c.stopped_at,
            state.label("state"),
            silent.label("silent_s"),
        ).order_by(processes.c.role, processes.c.host, processes.c.started_at)
    )
    # The columns are ProcessRow's, by name; the epoch is a numeric.
    return [ProcessRow(**{**r._mapping, "silent_s": float(r.silent_s)}) for r in rows]
