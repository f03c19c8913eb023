"""``store(conn, batch)``: one consumed batch into the inbox, events and todos.

Runs inside the caller's transaction (``async with engine.begin() as conn``)
and never commits on its own; the NOTIFY it sends reaches the acker only if
that transaction commits, which is the whole of store-then-ack.

Statements are set-based (``unnest`` of arrays): two round trips for a
batch of new stream entries whatever its size (the write, NOTIFY), one more
to ask what is already stored when the batch holds a redelivery, never one
statement per message, and every row is written once.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter
from typing import Any

import psycopg
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncConnection

from backhalf import failpoints, sql
from backhalf.db import driver_connection
from backhalf.errors import StoreError
from backhalf.records import InboxRecord, StoreBatch, StoreResult


def _merge_duplicates(records: Sequence[InboxRecord], default_ack_key: str | None) -> list[InboxRecord]:
    # One statement may not touch a row twice (ON CONFLICT DO UPDATE), and a
    # batch can hold the same message twice: a PEL re-read overlapping a
    # claim, or several copies of one list body. Merge them, counting both.
    # (Records are left as they are otherwise: this runs per message.)
    merged: dict[str, InboxRecord] = {}
    for rec in records:
        seen = merged.get(rec.idempotency_key)
        if seen is None:
            merged[rec.idempotency_key] = rec
        elif _ack_key(seen, default_ack_key) != _ack_key(rec, default_ack_key):
            # Adapters deliver one ack target per batch; events link by key.
            raise StoreError(f"key {rec.idempotency_key} appears with two ack keys in one batch")
        else:
            merged[rec.idempotency_key] = seen._replace(
                ack_copies=seen.ack_copies + rec.ack_copies,
                deliveries=seen.deliveries + rec.deliveries,
            )
    # A fixed lock order: two ingesters storing overlapping entries (a claim
    # racing a slow consumer) queue behind each other instead of deadlocking.
    return sorted(merged.values(), key=attrgetter("idempotency_key"))


def _ack_key(rec: InboxRecord, default: str | None) -> str | None:
    return default if rec.ack_key is None else rec.ack_key


async def store(conn: AsyncConnection, batch: StoreBatch) -> StoreResult:
    """Store ``batch`` in the caller's transaction; raise :class:`StoreError`."""
    records = _merge_duplicates(batch.records, batch.ack.key)
    if not records:
        return StoreResult(0, 0, 0, 0, 0)
    native = {r.source_message_id is not None for r in records}
    if len(native) != 1:
        raise StoreError(f"adapter {batch.adapter}: a batch mixes messages with and without native ids")
    try:
        pg = await driver_connection(conn)
        return await _store(pg, batch, records, native=native.pop())
    except (psycopg.Error, SQLAlchemyError) as exc:
        raise StoreError(
            f"adapter {batch.adapter}: storing {len(records)} messages failed: {type(exc).__name__}: {exc}"
        ) from exc


async def _store(
    pg: psycopg.AsyncConnection[Any], batch: StoreBatch, records: list[InboxRecord], *, native: bool
) -> StoreResult:
    async with pg.cursor() as cur:
        keys = [r.idempotency_key for r in records]
        # List copies: the pending row of each (key, processing list), to merge into.
        pending: dict[tuple[str, str | None], int] = {}
        known: set[str] = set()
        if not native:
            ack_keys = sorted({k for r in records if (k := _ack_key(r, batch.ack.key)) is not None})
            await cur.execute(
                sql.EXISTING_BODY_PENDING, {"adapter": batch.adapter, "keys": keys, "ack_keys": ack_keys}
            )
            pending = {(key, ack_key): inbox_id for key, ack_key, inbox_id in await cur.fetchall()}
            known = {key for key, _ in pending}
        elif batch.check_stored or any(r.deliveries > 1 for r in records):
            # Entries read for the first time (XREADGROUP ">") are almost never
            # in the inbox yet, so only a batch holding a redelivery asks, to
            # write no todo and no event for what is already stored. The rare
            # first delivery that is (its group was recreated) is written and
            # then undone below, like a store that lost a race; the batches
            # after it ask (``check_stored``). Written that way, its todo is
            # locked before its inbox row, the reverse of ``inbox replay``:
            # a replay of that very row at that moment is a deadlock, which
            # PostgreSQL breaks by failing one side: the replay reports an
            # error, or the store is redelivered (count 2) and reads first.
            await cur.execute(sql.EXISTING_NATIVE, {"adapter": batch.adapter, "keys": keys})
            known = {key for (key,) in await cur.fetchall()}

        ack_state = "none" if batch.ack.kind == "none" else "pending"
        writing = records
        if pending:  # list copies with a pending row on their list merge into it
            merging = [r for r in records if (r.idempotency_key, _ack_key(r, batch.ack.key)) in pending]
            writing = [r for r in records if (r.idempotency_key, _ack_key(r, batch.ack.key)) not in pending]
            await cur.execute(
                sql.MERGE_INBOX_BODY,
                {
                    "consumer": batch.consumer,
                    "ids": [pending[r.idempotency_key, _ack_key(r, batch.ack.key)] for r in merging],
                    "copies": [r.ack_copies for r in merging],
                    "deliveries": [r.deliveries for r in merging],
                },
            )
        rows: list[tuple[str, bool, int | None, int | None, bool | None]] = []
        if writing:
            await cur.execute(
                sql.STORE_NATIVE if native else sql.STORE_BODY,
                {
                    "adapter": batch.adapter,
                    "queue": batch.queue,
                    "consumer": batch.consumer,
                    "verify_detail": batch.verify_detail,
                    "ack_kind": batch.ack.kind,
                    "ack_group": batch.ack.group,
                    "ack_after": batch.ack_after,
                    "ack_state": ack_state,
                    "keys": [r.idempotency_key for r in writing],
                    "ids": [r.source_message_id for r in writing],
                    "bodies": [r.body for r in writing],
                    # No todo and no event for a rejected or an already stored message.
                    "payloads": [
                        None if r.error is not None or r.idempotency_key in known else r.payload
                        for r in writing
                    ],
                    "ack_keys": [_ack_key(r, batch.ack.key) for r in writing],
                    "entry_ids": [r.ack_entry_id for r in writing],
                    "copies": [r.ack_copies for r in writing],
                    "deliveries": [r.deliveries for r in writing],
                    "errors": [r.error for r in writing],
                },
            )
            rows = await cur.fetchall()
        failpoints.hit("after_inbox_insert")
        inserted: set[str] = set()
        # Rows whose inbox row existed, with an event (and maybe a todo) of
        # ours: a concurrent store (a claim racing a slow consumer) won them,
        # or they were stored before (a recreated group). That store's event
        # is the record, and our todo upsert deduped to its todo, or created
        # one only if that todo has finished since.
        lost: list[tuple[int, int | None, bool | None]] = []
        todos = created = 0
        for key, was_inserted, event_id, todo_id, was_created in rows:
            if was_inserted:
                inserted.add(key)
            elif event_id is not None:
                lost.append((event_id, todo_id, was_created))
            todos += todo_id is not None
            created += bool(was_created)
        if lost:
            await cur.execute(sql.DELETE_EVENTS, {"ids": [event_id for event_id, _, _ in lost]})
            ours = [todo_id for _, todo_id, was_created in lost if was_created]
            if ours:
                await cur.execute(sql.DELETE_TODOS, {"ids": ours})
            created -= len(ours)
            todos -= len(lost)
        if ack_state == "pending":
            await cur.execute(sql.NOTIFY_ACKER, {"channel": sql.ACK_CHANNEL, "adapter": batch.adapter})
    return StoreResult(
        new=len(inserted),
        rejected=sum(1 for r in records if r.error is not None and r.idempotency_key in inserted),
        redelivered=len(records) - len(inserted),
        todos_created=created,
        todos_deduped=todos - created,
    )
