"""Enable or disable an adapter at runtime, and list the registered ones
(``switchboard adapters``). The flag is the ``adapters`` row's ``enabled``:
the ingester reads it and stops or resumes that adapter's reads."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy.ext.asyncio import AsyncEngine

from backhalf.writes import registry
from ingest.actions.outcomes import Refused


@dataclass(frozen=True, slots=True)
class EnabledSet:
    """The adapter's flag is now ``enabled``."""

    name: str
    enabled: bool


async def set_enabled(engine: AsyncEngine, name: str, enabled: bool) -> EnabledSet | Refused:
    """Set a registered adapter's flag; refused for a name not registered."""
    async with engine.begin() as conn:
        found = await registry.set_enabled(conn, name, enabled)
    if not found:
        return Refused(f"no adapter named {name!r} is registered (see `switchboard adapters list`)")
    return EnabledSet(name, enabled)


async def list_adapters(engine: AsyncEngine) -> tuple[registry.AdapterRow, ...]:
    """The registered adapters, by name."""
    async with engine.begin() as conn:
        return tuple(await registry.list_adapters(conn))
