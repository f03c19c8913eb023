"""Read-only questions for ``switchboard status`` and operators, over the audit views."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from backhalf import queries
from schema import todos


@dataclass(frozen=True, slots=True)
class AdapterCounts:
    adapter: str
    enabled: bool
    stored: int
    rejected: int
    pending_acks: int
    acked: int
    oldest_unacked_age: timedelta | None


_counts_view = sa.table(
    "audit_adapter_counts",
    *(sa.column(c) for c in AdapterCounts.__dataclass_fields__),
)
_trail_view = sa.table("audit_message_trail", sa.column("idempotency_key"), sa.column("inbox_id"))


async def adapter_counts(conn: AsyncConnection) -> dict[str, AdapterCounts]:
    rows = await conn.execute(sa.select(_counts_view))
    return {row.adapter: AdapterCounts(*row) for row in rows}


async def todos_by_status(conn: AsyncConnection) -> dict[str, dict[str, int]]:
    rows = await conn.execute(
        sa.select(todos.c.queue, todos.c.status, sa.func.count()).group_by(todos.c.queue, todos.c.status)
    )
    out: dict[str, dict[str, int]] = {}
    for queue, status, n in rows:
        out.setdefault(queue, {})[status] = n
    return out


async def message_trail(conn: AsyncConnection, idempotency_key: str) -> list[dict[str, Any]]:
    rows = await conn.execute(
        sa.select(sa.text("*"))
        .select_from(_trail_view)
        .where(_trail_view.c.idempotency_key == idempotency_key)
        .order_by(_trail_view.c.inbox_id)
    )
    return [dict(r._mapping) for r in rows]


@dataclass(frozen=True, slots=True)
class HorizonHolder:
    """The oldest transaction that holds the ack cursor's horizon: a session
    of this database with a transaction id whose login may write the inbox
    (a login with no such right holds nothing back), or a prepared
    transaction. Stream acks stored after it wait for it to end (queries.sql,
    ``ack_horizon_cte``). A session's state and age are shown only to its
    own role (or pg_read_all_stats): None otherwise."""

    kind: str  # "session" or "prepared transaction"
    name: str  # the session's pid, or the prepared transaction's gid
    user: str | None
    ids_behind: int  # transaction ids begun since it took its own
    open_for: timedelta | None
    state: str | None

    def describe(self) -> str:
        what = f"{self.kind} {self.name}" if self.kind != "session" else f"pid {self.name}"
        facts = [f"user {self.user}" if self.user else None, self.state,
                 f"open {self.open_for.total_seconds():.0f} s" if self.open_for is not None else None,
                 f"{self.ids_behind} transaction ids behind"]  # fmt: skip
        return f"{what} ({', '.join(f for f in facts if f)})"


async def ack_horizon_holder(conn: AsyncConnection) -> HorizonHolder | None:
    """The oldest transaction holding the ack cursor's horizon back (one of
    this database with an id of its own whose login may write the inbox, or
    a prepared transaction), or None. No parameter: nothing from outside."""
    row = (await conn.exec_driver_sql(queries.ACK_HORIZON_HOLDER)).first()
    if row is None:
        return None
    kind, name, who, behind, open_for, state = tuple(row)
    return HorizonHolder(str(kind), str(name), who, int(behind), open_for, state)
