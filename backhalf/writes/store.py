"""``store(conn, batch)``: one consumed batch into the inbox, events and todos.

Runs inside the caller's transaction (``async with engine.begin() as conn``)
and never commits on its own; the NOTIFY it sends reaches the acker only if
that transaction commits, which is the whole of store-then-ack.

Statements are set-based (``unnest`` of arrays): two round trips for a
batch of new stream entries whatever its size (the write, NOTIFY), one more
to ask what is already stored when the batch holds a redelivery, never one
statement per message, and every row is written once. The steps, in order,
are the functions below ``_store``; the statements are in ``queries.sql``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

import psycopg
from sqlalchemy.ext.asyncio import AsyncConnection

from backhalf import failpoints, queries
from backhalf.db import driver_connection, wrap_driver_errors
from backhalf.errors import StoreError
from backhalf.housekeeping import partitions
from backhalf.lifecycle import todos
from backhalf.records import InboxRecord, StoreBatch, StoreResult
from backhalf.writes import keys

Cursor = psycopg.AsyncCursor[Any]
# A (key, processing list) pair of a list copy, and the pending inbox row it merges into.
PendingCopies = dict[tuple[str, str | None], int]
# A write's result row: key, inserted (None: a reused id), our event, its todo, whether we created it.
Written = tuple[str, bool | None, int | None, int | None, bool | None]


def _merge_duplicates(records: Sequence[InboxRecord], default_ack_key: str | None) -> list[list[InboxRecord]]:
    """The batch in rounds, each storable by one statement.

    One statement may not touch a row twice (ON CONFLICT DO UPDATE), and a
    batch can hold the same message twice: the broker's record of
    unacknowledged deliveries re-read while a sweep takes the same ones
    over, or several copies of one body. Copies of one message (the
    same key and the same whole-message digest) are merged, counting both.
    The same key on another body is another message (a producer's id used
    twice, a reused entry id): never merged away, it goes in the next round,
    which meets the row the round before stored and takes the reused-id
    path (``_store_reused``) or, where the id alone names the message,
    deduplicates. (Records are left as they are otherwise: this runs per
    message; a digest is computed only for a key seen twice.)"""
    rounds: list[dict[str, InboxRecord]] = [{}]
    for rec in records:
        key = rec.idempotency_key
        for merged in rounds:
            seen = merged.get(key)
            if seen is None:
                merged[key] = rec
                break
            if _ack_key(seen, default_ack_key) != _ack_key(rec, default_ack_key):
                # Adapters deliver one ack target per batch; events link by key.
                raise StoreError(f"key {key} appears with two ack keys in one batch")
            if _digest(seen) == _digest(rec):
                merged[key] = seen._replace(
                    ack_copies=seen.ack_copies + rec.ack_copies, deliveries=seen.deliveries + rec.deliveries
                )
                break
        else:
            rounds.append({key: rec})
    # A fixed lock order: two ingesters storing overlapping entries (a claim
    # racing a slow consumer) queue behind each other instead of deadlocking.
    return [sorted(merged.values(), key=attrgetter("idempotency_key")) for merged in rounds if merged]


def _ack_key(rec: InboxRecord, default: str | None) -> str | None:
    return default if rec.ack_key is None else rec.ack_key


async def store(conn: AsyncConnection, batch: StoreBatch) -> StoreResult:
    """Store ``batch`` in the caller's transaction; raise :class:`StoreError`."""
    rounds = _merge_duplicates(batch.records, batch.ack.key)
    if not rounds:
        return StoreResult(0, 0, 0, 0, 0)
    native = {r.source_message_id is not None for r in batch.records}
    if len(native) != 1:
        raise StoreError(f"adapter {batch.adapter}: a batch mixes messages with and without native ids")
    if batch.ack.by_body and (batch.ack.by_cursor or True in native):
        # Copies are counted on the queue, of messages keyed by their body.
        raise StoreError(
            f"adapter {batch.adapter}: ack target {batch.ack.kind!r} counts copies of a body,"
            " so its messages must be keyed by body and queued, not found by the cursor"
        )
    with wrap_driver_errors(
        StoreError, f"adapter {batch.adapter}: storing {len(batch.records)} messages failed"
    ):
        pg = await driver_connection(conn)
        async with pg.cursor() as cur:
            is_native = native.pop()
            results = [await _store(cur, batch, records, native=is_native) for records in rounds]
    return results[0] if len(results) == 1 else StoreResult.total(results)


async def _store(cur: Cursor, batch: StoreBatch, records: list[InboxRecord], *, native: bool) -> StoreResult:
    # 1. What the inbox holds already: no todo and no event for those.
    pending: PendingCopies = {}
    known: set[str] = set()
    if not native:
        pending = await _pending_copies(cur, batch, records)
        known = {key for key, _ in pending}
    elif _asks_first(batch, records):
        known = await _stored_entries(cur, batch, records)
    # 2. List copies with a pending row on their list merge into it; the rest are written.
    writing = await _merge_copies(cur, batch, records, pending) if pending else records
    # 3. The write: todos, events, inbox rows and the acker's queue, one statement.
    rows = await _write(cur, batch, writing, known, native=native) if writing else []
    failpoints.hit("after_inbox_insert")
    # 4. Undo our events (and todos) of rows whose inbox row existed.
    outcome = _Outcome.of(rows)
    if outcome.lost:
        await _undo_lost(cur, outcome)
    # 5. A stored key whose row the write could not see (another store
    # committed it meanwhile) is a redelivery after all.
    if native and outcome.reused:
        await _redeliver(cur, batch, records, outcome)
    # 6. Another message on a stored entry id: stored again, under its own key.
    if outcome.reused:
        records, outcome = await _store_reused(cur, batch, records, outcome)
    # 7. Wake, on commit, the acker for the acks owed and the workers for
    # the new todos: one statement for both.
    acks, created = _ack_state(batch) == "pending", bool(outcome.created)
    if acks or created:
        await cur.execute(
            queries.NOTIFY_STORE,
            {"acks": acks, "ack_channel": queries.ACK_CHANNEL, "adapter": batch.adapter,
             "todos": created, "todo_channel": queries.TODO_CHANNEL, "queue": batch.queue},
        )  # fmt: skip
    return outcome.result(records)


def _ack_state(batch: StoreBatch) -> str:
    return "pending" if batch.ack.needs_ack else "none"


def _by_cursor(batch: StoreBatch) -> bool:
    """Intents acked by their reference alone and owed on store are found by
    the acker's cursor (``inbox.ack_xid``), not queued: no ``ack_queue`` row
    is written and deleted for each (issue 16). Copies of one body need the
    queue's copy bookkeeping, and acks waiting for their todo its
    ``waiting_for``."""
    return batch.ack.by_cursor and batch.ack_after == "store"


async def _pending_copies(cur: Cursor, batch: StoreBatch, records: list[InboxRecord]) -> PendingCopies:
    """List copies: the pending row of each (key, processing list), locked, to merge into."""
    ack_keys = sorted({k for r in records if (k := _ack_key(r, batch.ack.key)) is not None})
    keys = [r.idempotency_key for r in records]
    await cur.execute(
        queries.EXISTING_BODY_PENDING, {"adapter": batch.adapter, "keys": keys, "ack_keys": ack_keys}
    )
    return {(key, ack_key): inbox_id for key, ack_key, inbox_id in await cur.fetchall()}


def _asks_first(batch: StoreBatch, records: list[InboxRecord]) -> bool:
    # Messages delivered for the first time (a delivery count of 1) are
    # almost never in the inbox yet, so only a batch holding a redelivery asks, to write no
    # todo and no event for what is already stored. The rare first delivery
    # that is (its group was recreated) is written and then undone (step 4),
    # like a store that lost a race; the batches after it ask
    # (``check_stored``). Written that way, its todo is locked before its
    # inbox row, the reverse of ``inbox replay``: a replay of that very row
    # at that moment is a deadlock, which PostgreSQL breaks by failing one
    # side: the replay reports an error, or the store is redelivered (count
    # 2) and reads first.
    return batch.check_stored or any(r.deliveries > 1 for r in records)


async def _stored_entries(cur: Cursor, batch: StoreBatch, records: list[InboxRecord]) -> set[str]:
    """Stream entries: the keys the inbox holds already."""
    keys = [r.idempotency_key for r in records]
    await cur.execute(queries.EXISTING_NATIVE, {"adapter": batch.adapter, "keys": keys})
    return {key for (key,) in await cur.fetchall()}


async def _merge_copies(
    cur: Cursor, batch: StoreBatch, records: list[InboxRecord], pending: PendingCopies
) -> list[InboxRecord]:
    """Add the copies with a pending row on their list to that row; return the others."""
    merging = [r for r in records if (r.idempotency_key, _ack_key(r, batch.ack.key)) in pending]
    writing = [r for r in records if (r.idempotency_key, _ack_key(r, batch.ack.key)) not in pending]
    await cur.execute(
        queries.MERGE_INBOX_BODY,
        {
            "consumer": batch.consumer,
            "ids": [pending[r.idempotency_key, _ack_key(r, batch.ack.key)] for r in merging],
            "copies": [r.ack_copies for r in merging],
            "deliveries": [r.deliveries for r in merging],
        },
    )
    return writing


async def _write(
    cur: Cursor, batch: StoreBatch, writing: list[InboxRecord], known: set[str], *, native: bool
) -> list[Written]:
    """Todos, their log rows, events, inbox rows and ack queue rows, in one
    statement; one result row per message written."""
    await cur.execute(
        queries.STORE_NATIVE if native else queries.STORE_BODY, _write_params(batch, writing, known)
    )
    return await cur.fetchall()


async def _redeliver(cur: Cursor, batch: StoreBatch, records: list[InboxRecord], outcome: _Outcome) -> None:
    """The keys the write took for reused whose stored row another store
    committed after the write's snapshot was taken (the key's row made this
    store wait for that commit): asked again in a statement of its own, whose
    snapshot sees that row; those with the same message are redeliveries."""
    candidates = set(outcome.reused)
    again = [r for r in records if r.idempotency_key in candidates]
    await cur.execute(queries.REDELIVER_NATIVE, _write_params(batch, again, set()))
    found = {key for (key,) in await cur.fetchall()}
    outcome.reused = [key for key in outcome.reused if key not in found]


def _write_params(batch: StoreBatch, writing: list[InboxRecord], known: set[str]) -> dict[str, Any]:
    provenance = batch.provenance
    return {
        "adapter": batch.adapter,
        **todos.creating(batch.queue, todos.CREATED_BY_STORE),
        "consumer": batch.consumer,
        "family": provenance.family,
        "trust_mode": provenance.trust_mode,
        "verified": provenance.verified,
        "verify_detail": provenance.verify_detail,
        "ack_kind": batch.ack.kind,
        "ack_group": batch.ack.group,
        "ack_after": batch.ack_after,
        "ack_state": _ack_state(batch),
        "by_cursor": _by_cursor(batch),
        "by_body": batch.ack.by_body,
        "id_names_message": batch.id_names_message,
        "keys": [r.idempotency_key for r in writing],
        "ids": [r.source_message_id for r in writing],
        "bodies": [r.body for r in writing],
        # No todo and no event for a rejected or an already stored message.
        "payloads": [
            None if r.error is not None or r.idempotency_key in known else r.payload for r in writing
        ],
        **_uncommon_columns(writing, batch.ack.key),
    }


def _uncommon_columns(writing: list[InboxRecord], default_ack_key: str | None) -> dict[str, Any]:
    """The columns most batches hold one value in, each as a NULL array
    unless a message of this batch differs (queries.sql, store_rows_cte):
    unnest pads a NULL array with NULLs, and the statement fills in the
    common value. Dumping arrays is much of the ingester's CPU."""
    ref_is_id = all(r.ack_ref == r.source_message_id for r in writing)  # the message's own id
    whole = all(r.body_size is None for r in writing)  # no body stored as a prefix
    return {
        "ack_key": default_ack_key,
        "ack_keys": None
        if all(r.ack_key is None for r in writing)
        else [_ack_key(r, default_ack_key) for r in writing],
        # Parameters named after the column that keeps the ref (ack_entry_id).
        "entry_is_id": ref_is_id,
        "entry_ids": None if ref_is_id else [r.ack_ref for r in writing],
        "copies": None if all(r.ack_copies == 1 for r in writing) else [r.ack_copies for r in writing],
        "deliveries": None if all(r.deliveries == 1 for r in writing) else [r.deliveries for r in writing],
        "errors": None if all(r.error is None for r in writing) else [r.error for r in writing],
        # Only a rejected oversize message has them.
        "sizes": None if whole else [r.body_size for r in writing],
        "digests": None if whole else [r.body_sha256 for r in writing],
        # What a broker says of a message beyond its id (an SQS FIFO queue's group and sequence).
        "attributes": None if all(r.attributes is None for r in writing) else [r.attributes for r in writing],
        # The todos' trace contexts (backhalf.tracing): only with tracing on, and a producer that sends them.
        "trace_contexts": None
        if all(r.trace_context is None for r in writing)
        else [r.trace_context for r in writing],
    }


@dataclass(slots=True)
class _Outcome:
    """The write's result rows, counted."""

    inserted: set[str] = field(default_factory=set)
    # Rows whose inbox row existed, with an event (and maybe a todo) of ours:
    # a concurrent store (a claim racing a slow consumer) won them, or they
    # were stored before (a recreated group). That store's event is the
    # record, and our todo upsert deduped to its todo, or created one only if
    # that todo has finished since. (event id, todo id, whether we created it)
    lost: list[tuple[int, int | None, bool | None]] = field(default_factory=list)
    # Keys whose inbox row holds another body (neither inserted nor updated):
    # their events and todos are undone with the lost ones.
    reused: list[str] = field(default_factory=list)
    # (entry id, derived key) of those stored again (_store_reused).
    stored_reused: list[tuple[str, str]] = field(default_factory=list)
    todos: int = 0
    created: int = 0

    @classmethod
    def of(cls, rows: list[Written]) -> _Outcome:
        outcome = cls()
        for key, was_inserted, event_id, todo_id, was_created in rows:
            if was_inserted is None:
                outcome.reused.append(key)
            if was_inserted:
                outcome.inserted.add(key)
            elif event_id is not None:
                outcome.lost.append((event_id, todo_id, was_created))
            outcome.todos += todo_id is not None
            outcome.created += bool(was_created)
        return outcome

    def result(self, records: list[InboxRecord]) -> StoreResult:
        rejected = [r.error for r in records if r.error is not None and r.idempotency_key in self.inserted]
        return StoreResult(
            new=len(self.inserted),
            rejected=len(rejected),
            rejected_errors=tuple(rejected),
            redelivered=len(records) - len(self.inserted),
            todos_created=self.created,
            todos_deduped=self.todos - self.created,
            reused=tuple(self.stored_reused),
        )


async def _undo_lost(cur: Cursor, outcome: _Outcome) -> None:
    """Delete our events of the lost rows and the todos we created for them,
    and count those todos neither created nor deduped."""
    ids = [event_id for event_id, _, _ in outcome.lost]
    await cur.execute(queries.DELETE_EVENTS, {"ids": ids, **partitions.id_bounds(ids)})
    ours = [todo_id for _, todo_id, was_created in outcome.lost if was_created and todo_id is not None]
    if ours:
        await todos.delete_created(cur, ours)
    outcome.created -= len(ours)
    outcome.todos -= len(outcome.lost)


async def _store_reused(
    cur: Cursor, batch: StoreBatch, records: list[InboxRecord], outcome: _Outcome
) -> tuple[list[InboxRecord], _Outcome]:
    """Store the messages whose entry id the inbox holds with another body
    under their derived keys (``keys.reused_key``), in this transaction, so
    nothing is dropped: each becomes a todo (or a rejected row) of its own
    and its entry is acked. A redelivery of one meets its derived row with
    the same body and dedups as usual. Returns the batch's records as stored
    and the outcome of both writes."""
    reused = set(outcome.reused)
    derived = {
        r.idempotency_key: r._replace(idempotency_key=keys.reused_key(r.idempotency_key, _digest(r)))
        for r in records
        if r.idempotency_key in reused
    }
    again = sorted(derived.values(), key=attrgetter("idempotency_key"))
    second = _Outcome.of(await _write(cur, batch, again, set(), native=True))
    if second.lost:
        await _undo_lost(cur, second)
    if second.reused:  # another store's derived row, committed after our snapshot
        await _redeliver(cur, batch, again, second)
    rejected: dict[str, InboxRecord] = {}
    if second.reused:
        rejected, second = await _reject_conflicts(cur, batch, again, second)
        derived = {key: rejected.get(r.idempotency_key, r) for key, r in derived.items()}
        again = sorted(derived.values(), key=attrgetter("idempotency_key"))
    conflicted = {r.idempotency_key for r in rejected.values()}
    combined = _Outcome(
        inserted=outcome.inserted | second.inserted,
        todos=outcome.todos + second.todos,
        created=outcome.created + second.created,
        # A redelivery of one (its derived row found) is no news; one
        # rejected on a conflict is a rejection, not a message stored.
        stored_reused=[
            (str(r.source_message_id), r.idempotency_key)
            for r in again
            if r.idempotency_key in second.inserted and r.idempotency_key not in conflicted
        ],
    )
    return [derived.get(r.idempotency_key, r) for r in records], combined


async def _reject_conflicts(
    cur: Cursor, batch: StoreBatch, again: list[InboxRecord], second: _Outcome
) -> tuple[dict[str, InboxRecord], _Outcome]:
    """Messages whose derived key, too, holds another body: each is that one
    message's rejection, stored under the derived key's own derived form
    (stable: its redelivery dedups to it), never its batch's failure. No
    transport's id can take a derived key's shape (``keys.key_id``), so only
    ids written to look like one by hand, or a sha256 collision, come here."""
    conflicted = set(second.reused)
    rejected = {
        r.idempotency_key: r._replace(
            idempotency_key=keys.reused_key(r.idempotency_key, _digest(r)),
            payload=None,
            # A message already rejected keeps its own reason.
            error=r.error
            or f"derived_key_conflict: another body is stored under {r.idempotency_key}, the key"
            " this message's id was moved to; stored rejected under its own",
        )
        for r in again
        if r.idempotency_key in conflicted
    }
    third = _Outcome.of(
        await _write(
            cur, batch, sorted(rejected.values(), key=attrgetter("idempotency_key")), set(), native=True
        )
    )
    if third.lost:
        await _undo_lost(cur, third)
    if third.reused:
        await _redeliver(cur, batch, list(rejected.values()), third)
    if third.reused:  # a third body on the same id and digests: a sha256 collision
        raise StoreError(f"adapter {batch.adapter}: derived keys {third.reused[:3]} also hold another body")
    combined = _Outcome(
        inserted=second.inserted | third.inserted,
        todos=second.todos + third.todos,
        created=second.created + third.created,
    )
    return rejected, combined


def _digest(rec: InboxRecord) -> bytes:
    """The sha256 of the whole message (of its stored form's full length)."""
    return rec.body_sha256 if rec.body_sha256 is not None else hashlib.sha256(rec.body).digest()
