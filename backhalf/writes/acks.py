"""Ack intents, seen from the acker and from list recovery.

Two ways to an ack owed: a stream entry acked on store is found by its
``inbox.ack_xid`` from the adapter's cursor (``claim_by_cursor``, then
``mark_by_cursor`` after the broker ack); every other one (list copies,
ack_after "complete", rows stored before migration 0008) by its ``ack_queue``
row (``claim``).

``claim`` runs inside the acker's transaction and marks the rows acked in the
same statement; the row locks are held while the broker ack is sent, so
several ackers split the work, and the mark becomes visible only if the
acker commits after the broker ack succeeded. A failure or a crash before the
commit leaves the rows pending, to be acked again (broker acks are idempotent).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import structlog
from sqlalchemy.ext.asyncio import AsyncConnection

from backhalf import queries
from backhalf.db import driver_connection, wrap_driver_errors
from backhalf.errors import AckStateError
from backhalf.housekeeping import partitions
from backhalf.records import AckClaim, PendingIntent

log = structlog.get_logger(__name__)


async def claim(
    conn: AsyncConnection, adapters: Sequence[str], limit: int, *, planned: bool = False
) -> list[AckClaim]:
    """Claim up to ``limit`` committed intents and mark them acked, uncommitted.
    ``planned``: the transaction ran the claim plan already (claim_by_cursor)."""
    with wrap_driver_errors(AckStateError, "claiming ack intents failed"):
        pg = await driver_connection(conn)
        async with pg.cursor() as cur:
            if not planned:
                await cur.execute(queries.CLAIM_PLAN)
            await cur.execute(queries.CLAIM_ACKS, {"adapters": list(adapters), "limit": limit})
            rows = await cur.fetchall()
    return list(map(AckClaim._make, rows))


@dataclass(frozen=True, slots=True)
class CursorClaim:
    """Stream acks claimed through the adapter's cursor (``cursor_acks``),
    and where the cursor moves once they are acked: past the last one, or,
    when the claim took every row owed (fewer than its limit), to the
    snapshot's xmin, below which no row can appear any more."""

    claims: list[AckClaim]
    xmin: int
    to: tuple[int, int]
    # A transaction at or above the xmin has ended: rows it stored may be
    # owed and not claimable until the transactions below it end (usually
    # within milliseconds), so the acker looks again soon, not at its poll.
    held: bool = False
    # Each claim's place in the cursor's order: (ack_xid, inbox id).
    positions: tuple[tuple[int, int], ...] = ()

    def leaving(self, owed: set[int]) -> CursorClaim:
        """This claim with the rows ``owed`` (inbox ids the broker refused)
        left pending: the others are marked, and the cursor stops just
        before the first one left, so the next claim takes it again."""
        kept = [c for c in self.claims if c.inbox_id not in owed]
        first = next(
            (p for c, p in zip(self.claims, self.positions, strict=True) if c.inbox_id in owed), None
        )
        if first is None:
            return self
        # The claim's condition is (ack_xid, id) > the cursor: one id below
        # the row's own puts it just ahead of the cursor.
        return CursorClaim(kept, self.xmin, (first[0], first[1] - 1), self.held, ())


async def claim_by_cursor(conn: AsyncConnection, adapter: str, limit: int) -> CursorClaim | None:
    """The acker transaction's first claim: if anything is owed (an
    unlocked look first), lock ``adapter``'s cursor and claim up to
    ``limit`` acks owed behind the snapshot's xmin. None: another acker
    holds the cursor. Resets a cursor made by another cluster or ahead of
    this one's transaction ids (a restore) and claims nothing this time."""
    with wrap_driver_errors(AckStateError, f"adapter {adapter}: claiming acks by cursor failed"):
        pg = await driver_connection(conn)
        async with pg.cursor() as cur:
            # Planned as the queue's claim is (queries.sql, claim_plan): an
            # index walk in cursor order that stops at the limit, not a bitmap
            # scan and a sort of every row owed.
            await cur.execute(queries.CLAIM_PLAN)
            # Unlocked first: an empty claim takes no transaction id, and its
            # commit writes no WAL.
            await cur.execute(queries.CURSOR_PEEK, {"adapter": adapter})
            peek = await cur.fetchone()
            held = bool(peek and peek[1])
            if peek is not None and not peek[0]:
                return CursorClaim([], 0, (0, 0), held)
            await cur.execute(queries.CURSOR_ACKS, {"adapter": adapter, "limit": limit})
            rows = await cur.fetchall()
            if not rows:
                return None
            at, xmin, reset = int(rows[0][0]), int(rows[0][1]), bool(rows[0][2])
            if reset:
                await cur.execute(queries.RESET_ACK_CURSOR, {"adapter": adapter})
                restamped = await cur.fetchone()
                log.warning(
                    "ack_cursor_reset",
                    adapter=adapter,
                    cursor_xid=at,
                    xmin=xmin,
                    restamped=int(restamped[0]) if restamped else 0,
                    detail="the ack cursor was made by another cluster, or is ahead of this one's"
                    " transaction ids (a restore into a new cluster): pending rows stamped again",
                )
                return CursorClaim([], xmin, (xmin, 0), held)
    found = [row for row in rows if row[3] is not None]
    claims = [
        AckClaim(int(row[3]), row[4], row[5], row[6], row[7], row[8], int(row[9]), None) for row in found
    ]
    positions = tuple((int(row[10]), int(row[3])) for row in found)
    if len(claims) < limit:
        return CursorClaim(claims, xmin, (xmin, 0), held, positions)
    last = rows[-1]
    return CursorClaim(claims, xmin, (int(last[10]), int(last[3])), held, positions)


async def mark_by_cursor(conn: AsyncConnection, adapter: str, claimed: CursorClaim) -> int:
    """After the broker ack, in the claim's transaction: mark the cursor's
    claims acked and move the cursor; return how many were marked."""
    with wrap_driver_errors(AckStateError, f"adapter {adapter}: marking acks by cursor failed"):
        pg = await driver_connection(conn)
        async with pg.cursor() as cur:
            await cur.execute(
                queries.MARK_CURSOR_ACKS,
                {
                    "adapter": adapter,
                    "ids": (ids := [c.inbox_id for c in claimed.claims]),
                    **partitions.id_bounds(ids),
                    "xmin": claimed.xmin,
                    "to_xid": claimed.to[0],
                    "to_id": claimed.to[1],
                },
            )
            row = await cur.fetchone()
    return int(row[0]) if row else 0


async def lock_pending_copies(conn: AsyncConnection, adapter: str, ack_key: str) -> list[PendingIntent]:
    """Lock the pending intents that count copies of one body on ``ack_key``
    (a processing list's) until the caller's transaction ends, and return them."""
    with wrap_driver_errors(AckStateError, f"adapter {adapter}: locking pending copies on {ack_key}"):
        pg = await driver_connection(conn)
        async with pg.cursor() as cur:
            await cur.execute(queries.LOCK_PENDING_COPIES, {"adapter": adapter, "ack_key": ack_key})
            rows = await cur.fetchall()
    return [PendingIntent(int(inbox_id), str(key), int(copies)) for inbox_id, key, copies in rows]


async def owed_native(conn: AsyncConnection, adapter: str, keys: Sequence[str]) -> set[str]:
    """Of these stream entries' keys, the ones stored with their ack pending."""
    with wrap_driver_errors(AckStateError, f"adapter {adapter}: reading owed acks"):
        pg = await driver_connection(conn)
        async with pg.cursor() as cur:
            await cur.execute(queries.OWED_NATIVE, {"adapter": adapter, "keys": list(keys)})
            return {str(key) for (key,) in await cur.fetchall()}


async def mark_own(conn: AsyncConnection, adapter: str, refs: Sequence[str]) -> int:
    """A consumer-acked transport's acks, sent by the ingester after its
    commit: the intents with these refs marked acked; how many were."""
    with wrap_driver_errors(AckStateError, f"adapter {adapter}: marking its own acks failed"):
        pg = await driver_connection(conn)
        async with pg.cursor() as cur:
            await cur.execute(queries.MARK_OWN_ACKS, {"adapter": adapter, "refs": list(refs)})
            return cur.rowcount


async def settle_own(conn: AsyncConnection, adapter: str, consumer: str, session: str) -> int:
    """The intents ``consumer`` left pending on channels before ``session``
    (a ref prefix) settled: those channels have ended (``queries.sql``,
    settle_own_acks). How many were."""
    with wrap_driver_errors(AckStateError, f"adapter {adapter}: settling acks of ended channels failed"):
        pg = await driver_connection(conn)
        async with pg.cursor() as cur:
            await cur.execute(
                queries.SETTLE_OWN_ACKS, {"adapter": adapter, "consumer": consumer, "session": session}
            )
            return cur.rowcount
