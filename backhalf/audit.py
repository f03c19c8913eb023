"""Read-only questions for ``switchboard status`` and operators, over the audit views."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

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
