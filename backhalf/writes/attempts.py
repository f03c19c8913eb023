"""Delivery attempts counted in PostgreSQL, for ``max_deliveries``.

A message that crashes the ingester each time it is processed never commits,
so nothing in the store's transaction can count it. A suspect (redelivered
more than once) is processed alone, and before each lone attempt the attempt
is recorded and committed on its own. This count, unlike the broker's, names
the culprit (a re-read batch raises the broker's count of every message in
it) and does not roll back with a broker restored from a snapshot or failed over; a row on record
also keeps a message a suspect when the broker's counter was reset.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from sqlalchemy.ext.asyncio import AsyncConnection

from backhalf import queries
from backhalf.db import driver_connection, wrap_driver_errors
from backhalf.errors import StoreError


async def record(conn: AsyncConnection, adapter: str, keys: Sequence[str]) -> dict[str, int]:
    """Count one more attempt for each key; return the counts. Commit before the attempt."""
    with wrap_driver_errors(StoreError, f"adapter {adapter}: recording delivery attempts"):
        pg = await driver_connection(conn)
        async with pg.cursor() as cur:
            await cur.execute(queries.RECORD_ATTEMPTS, {"adapter": adapter, "keys": sorted(set(keys))})
            return {str(key): int(n) for key, n in await cur.fetchall()}


async def known(conn: AsyncConnection, adapter: str, keys: Sequence[str]) -> set[str]:
    """Which of these keys have attempts on record."""
    with wrap_driver_errors(StoreError, f"adapter {adapter}: reading delivery attempts"):
        pg = await driver_connection(conn)
        async with pg.cursor() as cur:
            await cur.execute(queries.KNOWN_ATTEMPTS, {"adapter": adapter, "keys": sorted(set(keys))})
            return {str(key) for (key,) in await cur.fetchall()}


async def clear(conn: AsyncConnection, adapter: str, keys: Sequence[str]) -> None:
    """Forget the attempts of stored messages, in the store's transaction."""
    if not keys:
        return
    with wrap_driver_errors(StoreError, f"adapter {adapter}: clearing delivery attempts"):
        pg = await driver_connection(conn)
        async with pg.cursor() as cur:
            await cur.execute(queries.CLEAR_ATTEMPTS, {"adapter": adapter, "keys": list(keys)})


class OpenAttempts:
    """Lone attempts this process counted whose store then failed for a
    transient reason: the attempt is still open, and the next one of the same
    message reuses its count rather than adding one (an outage is not the
    message's fault). In memory on purpose: a process that dies loses it, and
    its successor counts again, which is what catches a message that kills the
    process. Bounded: the oldest are forgotten first (then counted again)."""

    def __init__(self, limit: int = 10_000) -> None:
        self._limit = limit
        self._open: OrderedDict[str, int] = OrderedDict()

    def keep(self, key: str, attempts: int) -> None:
        self._open[key] = attempts
        self._open.move_to_end(key)
        while len(self._open) > self._limit:
            self._open.popitem(last=False)

    def pop(self, key: str) -> int | None:
        return self._open.pop(key, None)

    def __len__(self) -> int:
        return len(self._open)
