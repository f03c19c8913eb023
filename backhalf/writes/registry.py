"""The ``adapters`` table: registration at start-up and the runtime flag."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncConnection

from backhalf.records import Family
from schema import adapters


@dataclass(frozen=True, slots=True)
class AdapterRow:
    name: str
    family: str
    transport: str
    mode: str
    enabled: bool
    settings: Mapping[str, Any]


async def register(
    conn: AsyncConnection,
    *,
    name: str,
    family: Family,
    transport: str,
    mode: str,
    settings: Mapping[str, Any],
) -> None:
    """Upsert one adapter. ``enabled`` is left alone on an existing row: it is
    the operator's runtime flag and survives restarts; so is ``family``, set
    when the adapter is first registered."""
    stmt = insert(adapters).values(
        name=name, family=family, transport=transport, mode=mode, settings=dict(settings)
    )
    stmt = stmt.on_conflict_do_update(
        index_elements=[adapters.c.name],
        set_={
            "transport": stmt.excluded.transport,
            "mode": stmt.excluded.mode,
            "settings": stmt.excluded.settings,
            "updated_at": sa.func.now(),
        },
    )
    await conn.execute(stmt)


async def is_enabled(conn: AsyncConnection, name: str) -> bool:
    value = await conn.scalar(sa.select(adapters.c.enabled).where(adapters.c.name == name))
    return bool(value)


async def set_enabled(conn: AsyncConnection, name: str, enabled: bool) -> bool:
    """Set the flag; return False if no such adapter is registered."""
    result = await conn.execute(
        sa.update(adapters)
        .where(adapters.c.name == name)
        .values(enabled=enabled, updated_at=sa.func.now())
        .returning(adapters.c.name)
    )
    return result.first() is not None


async def list_adapters(conn: AsyncConnection) -> list[AdapterRow]:
    rows = await conn.execute(
        sa.select(
            adapters.c.name,
            adapters.c.family,
            adapters.c.transport,
            adapters.c.mode,
            adapters.c.enabled,
            adapters.c.settings,
        ).order_by(adapters.c.name)
    )
    return [AdapterRow(*row) for row in rows]
