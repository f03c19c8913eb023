"""The values the back half stores: what a consumed message became, plus the
ack intent the acker will discharge once the row is committed."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

# An ack kind is a transport's own word, registered by its folder under
# ingest/adapters (ModeImplementation.ack_kind); the back half stores it and
# knows only NO_ACK, the kind of messages nothing acknowledges.
AckKind = str
NO_ACK: AckKind = "none"
# Who sends a transport's acks: the acker, from committed intents, where any
# process may ack (a stream's group, a reply subject, a receipt handle); or
# the consuming process itself, strictly after its commit, where an ack is
# bound to the channel that received the message.
AckParty = Literal["acker", "consumer"]
# Who delivered a message: pulled from a broker, or pushed to us (a webhook).
Family = Literal["queue", "push"]  # schema.tables.EVENT_FAMILIES


@dataclass(frozen=True, slots=True)
class AckTarget:
    """Where the acks of one batch go; the same for every message of a batch.

    ``kind`` names the transport's acknowledger; ``key`` and ``group`` are
    its coordinates (a stream and its consumer group, a processing list),
    read only by that acknowledger. ``NO_ACK``: nothing to acknowledge.

    ``by_cursor``: the intents are acked by their reference alone, so once
    stored (``ack_after = "store"``) the acker finds them by its cursor over
    committed rows (``inbox.ack_xid``) instead of an ``ack_queue`` row each.
    ``by_body``: the intents name their message by its body (a list item,
    removed by value), so copies of one body on one key merge
    into one queued intent that counts them (``ack_queue.by_body``), and the
    acknowledger is handed the body. The two exclude each other: counting
    copies needs the queue.
    """

    kind: AckKind
    key: str | None = None
    group: str | None = None
    by_cursor: bool = False
    by_body: bool = False

    @property
    def needs_ack(self) -> bool:
        return self.kind != NO_ACK


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
    ack_ref: str | None = None  # the transport's handle for this message (ingest.adapters.base.Delivery)
    ack_copies: int = 1
    deliveries: int = 1
    ack_key: str | None = None  # None: the batch's AckTarget.key
    # Set when ``body`` is only a prefix (a message over max_message_bytes):
    # the full length and sha256 (backhalf.writes.normalize.RawForm).
    body_size: int | None = None
    body_sha256: bytes | None = None
    # JSON text: what the broker says of the message beyond its id, kept for
    # audit in inbox.source_attributes (an SQS FIFO queue's MessageGroupId
    # and SequenceNumber); None for most.
    attributes: str | None = None
    # JSON text: the W3C trace context the todo keeps (todos.trace_context,
    # backhalf.tracing); None without one, or with tracing off.
    trace_context: str | None = None


@dataclass(frozen=True, slots=True)
class Provenance:
    """Where a batch's messages came from and how far they are trusted: the
    family and trust columns of their events, bound as parameters, so one
    store serves every family (DESIGN.md section 4).

    A pull adapter's events are ``Provenance("queue", "queue", False,
    "<broker> user: deploy-bot")``: the broker identity is named, not verified.
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
    # The native id alone names the message: a stored id met with another
    # body is the same message sent again (a webhook's delivery id that its
    # sender signs; Stripe signs a retry afresh, with its counters moved),
    # not a reused id to store apart. A broker's entry id is not such a name
    # (backhalf.writes.store), nor an id outside the signature (GitHub's: anyone
    # with one signed body could send it under another delivery's id).
    id_names_message: bool = False


@dataclass(frozen=True, slots=True)
class StoreResult:
    new: int  # inbox rows inserted (stored or rejected)
    rejected: int
    redelivered: int  # already in the inbox: deliveries bumped, ack re-requested
    todos_created: int
    todos_deduped: int  # an active todo with the same (queue, key) already existed
    # New messages on an entry id the inbox holds with another body (a broker
    # restored from an older snapshot, a stream deleted and refilled with
    # explicit ids), as (entry id, the key they were stored under:
    # backhalf.writes.keys.reused_key). Logged at error level once committed.
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
    """A pending intent on one ack key that discharges copies of one body (a
    processing list's), locked by the recovery that reconciles the copies."""

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
    ref: str | None  # the transport's handle for this message (Delivery.ack_ref)
    copies: int
    body: bytes | None  # only for intents that name their message by its body
