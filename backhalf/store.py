"""``store(conn, batch)``: one consumed batch into the inbox, events and todos.

Runs inside the caller's transaction (``async with engine.begin() as conn``)
and never commits on its own; the NOTIFY it sends reaches the acker only if
that transaction commits, which is the whole of store-then-ack.

Statements are set-based (``unnest`` of arrays): three round trips per batch
whatever its size, never one statement per message.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
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
    merged: dict[str, InboxRecord] = {}
    for rec in records:
        if rec.ack_key is None:
            rec = replace(rec, ack_key=default_ack_key)
        seen = merged.get(rec.idempotency_key)
        if seen is None:
            merged[rec.idempotency_key] = rec
        elif seen.ack_key != rec.ack_key:
            # Adapters deliver one ack target per batch; events link by key.
            raise StoreError(f"key {rec.idempotency_key} appears with two ack keys in one batch")
        else:
            merged[rec.idempotency_key] = replace(
                seen,
                ack_copies=seen.ack_copies + rec.ack_copies,
                deliveries=seen.deliveries + rec.deliveries,
            )
    # A fixed lock order: two ingesters storing overlapping entries (a claim
    # racing a slow consumer) queue behind each other instead of deadlocking.
    return sorted(merged.values(), key=lambda r: r.idempotency_key)


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
    ack_state = "none" if batch.ack.kind == "none" else "pending"
    async with pg.cursor() as cur:
        await cur.execute(
            sql.INSERT_INBOX_NATIVE if native else sql.INSERT_INBOX_BODY,
            {
                "adapter": batch.adapter,
                "consumer": batch.consumer,
                "ack_kind": batch.ack.kind,
                "ack_group": batch.ack.group,
                "ack_after": batch.ack_after,
                "ack_state": ack_state,
                "keys": [r.idempotency_key for r in records],
                "ids": [r.source_message_id for r in records],
                "bodies": [r.body for r in records],
                "ack_keys": [r.ack_key for r in records],
                "entry_ids": [r.ack_entry_id for r in records],
                "copies": [r.ack_copies for r in records],
                "deliveries": [r.deliveries for r in records],
                "errors": [r.error for r in records],
            },
        )
        inserted_ids: dict[str, int] = {}
        redelivered = 0
        for inbox_id, key, _ack_key, inserted in await cur.fetchall():
            if inserted:
                inserted_ids[key] = inbox_id
            else:
                redelivered += 1
        failpoints.hit("after_inbox_insert")

        accepted = [r for r in records if r.error is None and r.idempotency_key in inserted_ids]
        rejected = sum(1 for r in records if r.error is not None and r.idempotency_key in inserted_ids)
        created = deduped = 0
        if accepted:
            await cur.execute(
                sql.UPSERT_TODOS,
                {
                    "queue": batch.queue,
                    "keys": [r.idempotency_key for r in accepted],
                    "payloads": [r.payload for r in accepted],
                },
            )
            todo_ids: dict[str, int] = {}
            for todo_id, key, was_created in await cur.fetchall():
                todo_ids[key] = todo_id
                if was_created:
                    created += 1
                else:
                    deduped += 1
            await cur.execute(
                sql.INSERT_EVENTS_AND_LINK,
                {
                    "adapter": batch.adapter,
                    "verify_detail": batch.verify_detail,
                    "inbox_ids": [inserted_ids[r.idempotency_key] for r in accepted],
                    "keys": [r.idempotency_key for r in accepted],
                    "ids": [r.source_message_id for r in accepted],
                    "payloads": [r.payload for r in accepted],
                    "todo_ids": [todo_ids[r.idempotency_key] for r in accepted],
                },
            )
        if ack_state == "pending":
            await cur.execute(sql.NOTIFY_ACKER, {"channel": sql.ACK_CHANNEL, "adapter": batch.adapter})
    return StoreResult(
        new=len(inserted_ids),
        rejected=rejected,
        redelivered=redelivered,
        todos_created=created,
        todos_deduped=deduped,
    )
