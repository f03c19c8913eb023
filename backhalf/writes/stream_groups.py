"""The ``stream_groups`` table: where each consumer group Switchboard created
started, so a destroyed group is recreated at the same point.

An adapter with durable consumers records the start *before* it creates
the group (its transport's stream mode), so no crash can leave a group that
Switchboard created without its record. The first record wins: a second
ingester racing the first, or a restart, reads the start on record instead
of writing its own.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import NamedTuple

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from backhalf.db import within_deadline
from backhalf.errors import DeadlineExceeded, StoreError
from backhalf.writes import acks
from schema import inbox, stream_groups


class StreamGroup(NamedTuple):
    """One consumer group of one stream on one broker: the key of its
    recorded start. ``broker`` is ``host:port/db``, never a credential."""

    broker: str
    stream: str
    group: str


def _where(group: StreamGroup) -> sa.ColumnElement[bool]:
    return sa.and_(
        stream_groups.c.broker == group.broker,
        stream_groups.c.stream == group.stream,
        stream_groups.c.group_name == group.group,
    )


async def recorded(conn: AsyncConnection, group: StreamGroup) -> str | None:
    """The start on record for ``group``, or None."""
    value = await conn.scalar(sa.select(stream_groups.c.start_id).where(_where(group)))
    return None if value is None else str(value)


async def record(conn: AsyncConnection, group: StreamGroup, *, adapter: str, start_id: str) -> str | None:
    """Record ``start_id`` for ``group`` unless a start is on record already,
    and return the start on record (ours or the earlier one); None only if
    the earlier row was deleted meanwhile."""
    inserted = await conn.scalar(
        insert(stream_groups)
        .values(
            broker=group.broker,
            stream=group.stream,
            group_name=group.group,
            adapter=adapter,
            start_id=start_id,
        )
        .on_conflict_do_nothing(index_elements=list(stream_groups.primary_key.columns))
        .returning(stream_groups.c.start_id)
    )
    if inserted is not None:
        return str(inserted)
    # A conflict: ON CONFLICT waited for the other writer to commit, and this
    # statement (READ COMMITTED, a new snapshot) sees its row.
    return await recorded(conn, group)


async def present(conn: AsyncConnection) -> None:
    """Raise (undefined table, SQLSTATE 42P01) if the table is missing: a
    database migrated before revision 0002."""
    await conn.execute(sa.select(stream_groups.c.start_id).limit(0))


async def stored_before(conn: AsyncConnection, adapter: str) -> bool:
    """Whether the inbox holds any stream entry of ``adapter`` (a walk of
    ``ix_inbox_adapter_key`` from the adapter's first entry: a stream
    adapter's rows all have a native id, so the first one read answers)."""
    probe = (
        sa.select(inbox.c.id)
        .where(inbox.c.adapter == adapter, inbox.c.source_message_id.is_not(None))
        .limit(1)
    )
    return await conn.scalar(probe) is not None


class GroupStartLedger:
    """The stream adapters' :class:`ingest.adapters.base.GroupStarts`: each
    call its own short transaction under the transaction deadline. Driver
    errors and deadlines become :class:`StoreError` naming the adapter and
    the group, so the poll loop backs off and retries them like a failed
    store."""

    def __init__(self, engine: AsyncEngine, deadline_ms: int) -> None:
        self._engine = engine
        self._deadline_ms = deadline_ms

    @contextlib.asynccontextmanager
    async def _transaction(
        self, opening: contextlib.AbstractAsyncContextManager[AsyncConnection], what: str
    ) -> AsyncIterator[AsyncConnection]:
        try:
            async with within_deadline(opening, self._deadline_ms, what) as conn:
                yield conn
        except (SQLAlchemyError, DeadlineExceeded) as exc:
            raise StoreError(f"{what}: {type(exc).__name__}: {exc}") from exc

    async def recorded(self, group: StreamGroup, *, adapter: str) -> str | None:
        what = f"adapter {adapter}: reading the recorded start of group {group.group} on {group.stream}"
        async with self._transaction(self._engine.connect(), what) as conn:
            return await recorded(conn, group)

    async def stored_before(self, adapter: str) -> bool:
        what = f"adapter {adapter}: reading whether the inbox holds its entries"
        async with self._transaction(self._engine.connect(), what) as conn:
            return await stored_before(conn, adapter)

    async def acks_owed(self, adapter: str, keys: Sequence[str]) -> set[str]:
        what = f"adapter {adapter}: reading which of {len(keys)} idle entries have their ack queued"
        async with self._transaction(self._engine.connect(), what) as conn:
            return await acks.owed_native(conn, adapter, keys)

    async def settle_acks(self, adapter: str, consumer: str, session: str) -> int:
        what = f"adapter {adapter}: settling the acks consumer {consumer} left on its ended channels"
        async with self._transaction(self._engine.begin(), what) as conn:
            return await acks.settle_own(conn, adapter, consumer, session)

    async def record(self, group: StreamGroup, start_id: str, *, adapter: str) -> str:
        what = f"adapter {adapter}: recording start {start_id} of group {group.group} on {group.stream}"
        # Committed (synchronous_commit on) when the block ends: durable
        # before the caller creates the group.
        async with self._transaction(self._engine.begin(), what) as conn:
            on_record = await record(conn, group, adapter=adapter, start_id=start_id)
        if on_record is None:
            # Someone deleted the earlier row between our insert and our read:
            # fail this attempt; the retry inserts ours.
            raise StoreError(f"{what}: the earlier record vanished while it was read; retrying")
        return on_record
