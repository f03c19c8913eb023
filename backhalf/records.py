"""The values the back half stores: what a consumed message became, plus the
ack intent the acker will discharge once the row is committed."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

AckKind = Literal["xack", "lrem", "none"]
# Who delivered a message: pulled from a broker, or pushed to us (a webhook).
Family = Literal["queue", "push"]  # schema.tables.EVENT_FAMILIES


@dataclass(frozen=True, slots=True)
class AckTarget:
    """Where the acks of one batch go; the same for every message of a batch.

    ``xack``: ``key`` is the stream, ``group`` the consumer group.
    ``lrem``: ``key`` is the consumer's processing list.
    ``none``: nothing to acknowledge (pub/sub).
    """

    kind: AckKind
    key: str | None = None
    group: str | None = None


class InboxRecord(NamedTuple):
    """One consumed message, normalized (``payload``) or rejected (``error``).

    A NamedTuple rather than a frozen dataclass, as ``Delivery`` is: one of
    each is built per message, and a frozen dataclass's ``__init__`` sets
    every field through ``object.__setattr__``, costlier than a tuple's
    (figures in docs/architecture.md). Still immutable.
    """

    idempotency_key: str
    source_message_id: str | None
    body: bytes
    payload: str | None  # JSON text; None when rejected
    error: str | None = None
    ack_entry_id: str | None = None
    ack_copies: int = 1
    deliveries: int = 1
    ack_key: str | None = None  # None: the batch's AckTarget.key
    # Set when ``body`` is only a prefix (a message over max_message_bytes):
    # the full length and sha256 (backhalf.normalize.RawForm).
    body_size: int | None = None
    body_sha256: bytes | None = None


@dataclass(frozen=True, slots=True)
class Provenance:
    """Where a batch's messages came from and how far they are trusted: the
    family and trust columns of their events, bound as parameters, so one
    store serves every family (DESIGN.md section 4).

    A pull adapter's events are ``Provenance("queue", "queue", False,
    "redis acl: deploy-bot")``: the broker identity is named, not verified.
    """

    family: Family
    trust_mode: str
    verified: bool
    verify_detail: str | None


@dataclass(frozen=True, slots=True)
class StoreBatch:
    adapter: str
    queue: str
    consumer: str | None
    ack_after: Literal["store", "complete"]
    ack: AckTarget
    provenance: Provenance
    records: Sequence[InboxRecord]
    # Ask which messages are stored already even if none is a redelivery:
    # the adapter's last batch held stored entries read for the first time
    # (a group recreated from 0 re-reads a whole stream that way).
    check_stored: bool = False


@dataclass(frozen=True, slots=True)
class StoreResult:
    new: int  # inbox rows inserted (stored or rejected)
    rejected: int
    redelivered: int  # already in the inbox: deliveries bumped, ack re-requested
    todos_created: int
    todos_deduped: int  # an active todo with the same (queue, key) already existed
    # New messages on an entry id the inbox holds with another body (Redis
    # restored from an older snapshot, a stream deleted and refilled with
    # explicit ids), as (entry id, the key they were stored under:
    # backhalf.keys.reused_key). Logged at error level once committed.
    reused: tuple[tuple[str, str], ...] = ()
    # The errors of the rejected rows among ``new`` (the metrics' reasons).
    rejected_errors: tuple[str, ...] = ()

    @classmethod
    def total(cls, results: Sequence[StoreResult]) -> StoreResult:
        return cls(
            new=sum(r.new for r in results),
            rejected=sum(r.rejected for r in results),
            redelivered=sum(r.redelivered for r in results),
            todos_created=sum(r.todos_created for r in results),
            todos_deduped=sum(r.todos_deduped for r in results),
            reused=tuple(pair for r in results for pair in r.reused),
            rejected_errors=tuple(e for r in results for e in r.rejected_errors),
        )


@dataclass(frozen=True, slots=True)
class PendingIntent:
    """A pending LREM intent on a processing list, locked by list recovery."""

    inbox_id: int
    idempotency_key: str
    copies: int


class AckClaim(NamedTuple):
    """A committed ack intent, locked by the acker's transaction.

    A NamedTuple, built per message from the claim's rows: see ``InboxRecord``.
    """

    inbox_id: int
    adapter: str
    kind: AckKind
    key: str | None
    group: str | None
    entry_id: str | None
    copies: int
    body: bytes | None  # only for lrem
