"""The operator's replay of a rejected inbox row once the cause is fixed
(``switchboard inbox replay ID``); the rows themselves are read through
``backhalf.reads.inbox_views``.

A replay re-normalizes the stored raw body with the adapter's current rules
and, if it passes, creates (or dedups to) the todo and the event in one
transaction, turning the row from ``rejected`` into ``stored``. The broker
was acked long ago; nothing is asked of it.
"""

from __future__ import annotations

from collections.abc import Callable

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.ext.asyncio import AsyncConnection

from backhalf.errors import BackhalfError, PoisonMessage
from backhalf.lifecycle import todos
from backhalf.records import Family, Provenance
from schema import events, inbox


class ReplayError(BackhalfError):
    """The row cannot be replayed (not rejected, no body, still poison)."""


Normalizer = Callable[[bytes], str]


async def replay(
    conn: AsyncConnection,
    inbox_id: int,
    *,
    queue_for: Callable[[str], str],
    normalize_for: Callable[[str], Normalizer],
    trust_for: Callable[[str], tuple[Family, str]],
) -> int:
    """Replay one rejected row in the caller's transaction; return the todo id.

    The event gets the adapter's family and trust mode (``trust_for``: a
    pull adapter's, or a webhook's); it is not verified, and its
    ``verify_detail`` names the operator's replay.
    """
    columns = inbox.c[
        "adapter", "idempotency_key", "source_message_id", "body", "body_size", "status", "error"
    ]
    row = (await conn.execute(sa.select(*columns).where(inbox.c.id == inbox_id).with_for_update())).first()
    if row is None:
        raise ReplayError(f"inbox row {inbox_id} does not exist")
    adapter, key, message_id, body, body_size, status, error = row
    # The adapter's rules are looked up only once the row passed the other
    # checks: a row of an adapter no longer configured says what it is first.
    payload = check(inbox_id, status, bytes(body), body_size, error, lambda b: normalize_for(adapter)(b))
    # The inbox row is locked (above) before the todo: the reverse of a
    # store's order, see ``backhalf.writes.store``.
    todo_id = await todos.create(
        conn, queue=queue_for(adapter), key=key, payload=payload, detail=todos.CREATED_BY_REPLAY
    )
    family, trust_mode = trust_for(adapter)
    provenance = Provenance(family, trust_mode, False, f"replayed by operator from inbox row {inbox_id}")
    event_id = await conn.scalar(
        sa.insert(events)
        .values(
            family=provenance.family,
            adapter=adapter,
            trust_mode=provenance.trust_mode,
            verified=provenance.verified,
            verify_detail=provenance.verify_detail,
            idempotency_key=key,
            source_message_id=message_id,
            payload=_jsonb(payload),
            todo_id=todo_id,
        )
        .returning(events.c.id)
    )
    await conn.execute(
        sa.update(inbox)
        .where(inbox.c.id == inbox_id)
        .values(status="stored", error=None, todo_id=todo_id, event_id=event_id)
    )
    return todo_id


def check(
    inbox_id: int, status: str, body: bytes, body_size: int | None, error: str | None, normalize: Normalizer
) -> str:
    """The payload a replay of this row would store; :class:`ReplayError`
    if it would be refused. Writes nothing: ``inbox replay --dry-run`` asks
    it too, so a dry run refuses exactly what a replay refuses."""
    if status != "rejected":
        raise ReplayError(f"inbox row {inbox_id} is {status}, not rejected")
    if not body:
        raise ReplayError(f"inbox row {inbox_id} has no body to replay ({error})")
    if body_size is not None:
        # Only the first bytes of an oversize message are kept: replaying
        # them would make a todo of a message that never was.
        raise ReplayError(
            f"inbox row {inbox_id} keeps only the first {len(body)} of its {body_size} bytes:"
            " re-send the message instead"
        )
    try:
        return normalize(body)
    except PoisonMessage as exc:
        raise ReplayError(f"inbox row {inbox_id} is still rejected: {exc}") from exc


def _jsonb(payload: str) -> sa.ColumnElement[object]:
    # The payload is JSON text already: cast it in SQL, do not re-encode it.
    return sa.cast(sa.literal(payload, sa.Text()), JSONB)
