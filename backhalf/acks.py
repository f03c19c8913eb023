"""Ack intents, seen from the acker and from list recovery.

``claim`` runs inside the acker's transaction and marks the rows acked in the
same statement; the row locks are held while the broker ack is sent, so
several ackers split the work, and the mark becomes visible only if the
acker commits after the broker ack succeeded. A failure or a crash before the
commit leaves the rows pending, to be acked again (broker acks are idempotent).
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy.ext.asyncio import AsyncConnection

from backhalf import queries
from backhalf.db import driver_connection, wrap_driver_errors
from backhalf.errors import AckStateError
from backhalf.records import AckClaim, PendingIntent


async def claim(conn: AsyncConnection, adapters: Sequence[str], limit: int) -> list[AckClaim]:
    """Claim up to ``limit`` committed intents and mark them acked, uncommitted."""
    with wrap_driver_errors(AckStateError, "claiming ack intents failed"):
        pg = await driver_connection(conn)
        async with pg.cursor() as cur:
            await cur.execute(queries.CLAIM_PLAN)
            await cur.execute(queries.CLAIM_ACKS, {"adapters": list(adapters), "limit": limit})
            rows = await cur.fetchall()
    return list(map(AckClaim._make, rows))


async def lock_pending_copies(conn: AsyncConnection, adapter: str, ack_key: str) -> list[PendingIntent]:
    """Lock the pending LREM intents on one processing list until the caller's
    transaction ends, and return them."""
    with wrap_driver_errors(AckStateError, f"adapter {adapter}: locking pending copies on {ack_key}"):
        pg = await driver_connection(conn)
        async with pg.cursor() as cur:
            await cur.execute(queries.LOCK_PENDING_COPIES, {"adapter": adapter, "ack_key": ack_key})
            rows = await cur.fetchall()
    return [PendingIntent(int(inbox_id), str(key), int(copies)) for inbox_id, key, copies in rows]


async def owed_native(conn: AsyncConnection, adapter: str, keys: Sequence[str]) -> set[str]:
    """Of these stream entries' keys, the ones stored with their ack queued."""
    with wrap_driver_errors(AckStateError, f"adapter {adapter}: reading owed acks"):
        pg = await driver_connection(conn)
        async with pg.cursor() as cur:
            await cur.execute(queries.OWED_NATIVE, {"adapter": adapter, "keys": list(keys)})
            return {str(key) for (key,) in await cur.fetchall()}
