"""What a pull adapter is: the types every transport mode shares.

One module per mode implements :class:`PullAdapter` (in its transport's
folder, ``ingest/adapters/<transport>/``) plus an :class:`Acknowledger` for
its ack kind, and its transport registers the pair once as a
:class:`ModeImplementation` in its ``modes`` module; the poll loop and
the acker never branch on the mode. A capability a
mode lacks is a documented no-op (pub/sub has nothing to ack), not an
``isinstance`` check at the call site. ``memory`` is the in-memory fake for
unit tests of the loop.

Confirm in order: every non-empty batch ``read`` or ``recover`` returns is
unconfirmed until ``stored()`` says the oldest one committed, and
``rewind()`` gives up on all of them at once. What a mode must remember per
batch to honour that (a stream's lost-entry reports, a list's recovery
locks, pub/sub's messages themselves) it keeps in an :class:`Unconfirmed`:
``returned`` per batch, ``confirmed`` on ``stored()``, ``rewound`` on
``rewind()``.

Ack targets: an ack intent is a row of the ``inbox`` table, and a login that
may write such a row can name any target in it. Each acknowledger acts only
on the targets its own adapter config names (the stream and group, the
processing lists, the consumer's ack subjects, the queue) and discharges the
others untouched (:func:`own_targets`).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Generic, NamedTuple, Protocol, TypeVar

import structlog

from backhalf.records import AckClaim, AckKind, AckParty, AckTarget, Family, PendingIntent, Provenance
from backhalf.writes.normalize import Content
from backhalf.writes.stream_groups import StreamGroup

if TYPE_CHECKING:
    from ingest.config import AdapterConfig

__all__ = [
    "FAMILY",
    "TRUST_MODE",
    "AckIntentView",
    "AckTarget",
    "Acknowledger",
    "AdapterBuilder",
    "ConsumerLedger",
    "Delivery",
    "ModeImplementation",
    "OpenLedger",
    "PendingCopies",
    "PullAdapter",
    "TraceCarrier",
    "Unconfirmed",
    "own_targets",
    "trace_of",
]

log = structlog.get_logger(__name__)

# Every adapter here belongs to the pull family (DESIGN.md section 4): its
# events say so, and name the broker identity the adapter consumed as, which
# nothing verifies (a push delivery's signature would be).
FAMILY: Family = "queue"
TRUST_MODE = "queue"


def pull_provenance(identity: str) -> Provenance:
    """The events' family and trust metadata for messages consumed as ``identity``."""
    return Provenance(family=FAMILY, trust_mode=TRUST_MODE, verified=False, verify_detail=identity)


T = TypeVar("T")


# (traceparent, tracestate): read by each transport from where its messages
# carry them, checked by the poll loop (backhalf.tracing.carried).
TraceCarrier = tuple[str, str | None]


class Delivery(NamedTuple):
    """One message as the broker handed it over, not yet normalized.

    ``body`` is the message's content: its bytes, or a
    :class:`~backhalf.writes.normalize.FieldMap` where it came as named fields. It
    is None only when ``lost``: the broker still had the message pending but
    the message itself was deleted, which the back half records instead of
    acking silently.

    The ack intent is opaque to everyone but the transport's acknowledger:
    ``ack_ref`` is the broker's handle for this one message (whatever its
    acknowledger needs: an entry id, a reply subject, a receipt handle),
    ``ack_key`` overrides the batch's :class:`AckTarget` key (a recovered
    processing list), ``ack_copies`` counts the deliveries one intent
    discharges (identical bodies merged).

    A NamedTuple, built per message: see ``backhalf.records.InboxRecord``.
    """

    idempotency_key: str
    message_id: str | None
    body: Content | None = None
    ack_ref: str | None = None
    ack_key: str | None = None
    ack_copies: int = 1
    lost: bool = False
    deliveries: int = 1
    attributes: str | None = None  # JSON text for inbox.source_attributes (audit), or None
    # False where ``deliveries`` is only a lower bound (an AMQP classic
    # queue's ``redelivered`` flag: "at least twice"): the poll loop then
    # takes the message for a suspect at once, so one that crashes the
    # ingester every time is still isolated and counted.
    deliveries_exact: bool = True
    # The W3C trace context the message carries (DESIGN.md section 14), as
    # the broker gave it, unchecked: (traceparent, tracestate); see trace_of.
    trace: TraceCarrier | None = None


def trace_of(traceparent: object, tracestate: object = None) -> TraceCarrier | None:
    """A message's trace context as text (a header's bytes decoded), or None
    when it carries no ``traceparent``. Checked later, and only while
    tracing is on: a transport only reads it."""
    if traceparent is None:
        return None
    return _header_text(traceparent), None if tracestate is None else _header_text(tracestate)


def _header_text(value: object) -> str:
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).decode("utf-8", "replace")
    return str(value)


class PendingCopies(Protocol):
    """Lock the pending ack intents on one ack key and return them."""

    async def __call__(self, ack_key: str) -> Sequence[PendingIntent]: ...


# Opens a database transaction whose row locks last for the ``async with``.
OpenLedger = Callable[[], AbstractAsyncContextManager[PendingCopies]]


class ConsumerLedger(Protocol):
    """What PostgreSQL keeps for a transport's durable consumers
    (``backhalf.writes.stream_groups.GroupStartLedger``): where each one Switchboard
    created started, so one destroyed later is recreated where it first
    started, not at a configured "new messages only" that by then means
    "later"; and what the inbox says of their messages. A durable consumer is
    named by broker, stream and consumer name (a stream's consumer group, a
    durable consumer). Modes without one ignore
    it."""

    async def recorded(self, consumer: StreamGroup, *, adapter: str) -> str | None:
        """The start on record for ``consumer``, or None."""
        ...

    async def record(self, consumer: StreamGroup, start: str, *, adapter: str) -> str:
        """Record ``start`` unless a start is on record already (the first
        record wins); return the start on record, committed on return."""
        ...

    async def stored_before(self, adapter: str) -> bool:
        """Whether the inbox holds messages of ``adapter`` with native ids:
        its consumer existed before, even if nothing recorded where it started."""
        ...

    async def acks_owed(self, adapter: str, keys: Sequence[str]) -> set[str]:
        """Of these messages' keys, the ones stored with their ack queued (owed
        now, or waiting for their todo): a sweep that takes over idle
        messages leaves those to the acker instead of delivering them again."""
        ...

    async def settle_acks(self, adapter: str, consumer: str, session: str) -> int:
        """Where the consuming process acks (AckParty "consumer"): settle the
        intents ``consumer`` left pending on its earlier channels (refs not
        starting with ``session``, the channel just opened). A channel's end
        settled each of its deliveries at the broker, acked or requeued, and a
        requeued one comes again to be stored and acked anew; so none is owed
        by anyone any more. Returns how many were settled."""
        ...


class PullAdapter(Protocol):
    name: str
    # May a batch commit while the one before it is still committing? Only
    # where redelivery rests on the broker's own record of what it delivered, not
    # on counts reconciled against committed rows (a processing list) or on
    # memory (pub/sub).
    overlapping_commits: bool
    # Must a batch's messages be stored in the order they came (an SQS FIFO
    # queue's groups)? Then a redelivered suspect, stored alone, takes every
    # message after it with it, one by one in order, instead of leaving them
    # to the batch stored before it.
    ordered: bool

    @property
    def ack_target(self) -> AckTarget: ...

    @property
    def identity(self) -> str:
        """The broker identity the events' ``verify_detail`` names, e.g. ``<broker> user: bot``."""
        ...

    @property
    def broker(self) -> str:
        """host:port for log fields; never credentials."""
        ...

    async def start(self) -> None:
        """Connect and prepare (create the group, learn the identity). Idempotent."""

    async def run_background(self, stop: asyncio.Event) -> None:
        """Work that must go on beside the poll loop until ``stop`` (a list
        consumer's heartbeat). Returns at once where a mode has none."""

    async def recover(self, open_ledger: OpenLedger) -> list[Delivery]:
        """Messages owed from broker-side holding areas (a processing list),
        reconciled against the database; [] where the broker redelivers by
        itself (streams) or keeps nothing (pub/sub). Called before every read;
        the adapter decides when recovery is due."""
        ...

    async def read(self, max_count: int) -> list[Delivery]:
        """Up to ``max_count`` messages; waits at most the adapter's block time."""
        ...

    def stored(self) -> None:
        """The oldest batch returned (by ``read`` or ``recover``, non-empty)
        and not yet confirmed has committed. The poll loop reads the next
        batch while others commit, so several batches may be unconfirmed;
        they are confirmed in the order they were returned."""

    def rewind(self) -> None:
        """No unconfirmed batch will be stored: deliver them all again, from
        the broker's own record of what is un-acked wherever one exists."""

    async def pause(self) -> None:
        """The adapter was disabled: give back what the broker pushed ahead
        of the reads (a channel's prefetch), so other consumers get it
        meanwhile; the next read starts again. A no-op where nothing is
        pushed (every pull-by-request mode)."""

    async def ack_stored(self) -> Sequence[Delivery]:
        """Where acks are bound to the channel that received the message
        (:data:`AckParty` "consumer"), the consuming process acks: every
        delivery of the batches ``stored()`` confirmed, acked now on its own
        channel; returns those acked, whose intents the poll loop then marks.
        Raises :class:`ingest.errors.BrokerError` when the channel is gone (its
        deliveries went back to the queue: redelivered and deduplicated).
        [] for every transport the acker acks for."""
        ...

    async def describe(self) -> Mapping[str, object]:
        """Broker-side figures for ``switchboard status`` (backlog, pending)."""
        ...

    async def close(self) -> None:
        """Release connections. Un-acked messages stay with the broker."""


class Acknowledger(Protocol):
    """Discharges committed ack intents of one ack kind against one broker."""

    async def ack(self, claims: Sequence[AckClaim]) -> Sequence[AckClaim]:
        """Acknowledge the claims; return those the broker refused one by one
        (a batch delete's failed entries), which stay owed and are
        retried, [] when every one was acked. Raise
        :class:`ingest.errors.AckError` where none could be (the broker is
        down). Must be idempotent: a claim may be acked again after a crash.
        A claim whose target the adapter's config does not name is not sent
        to the broker, and not returned either (:func:`own_targets`): it is
        marked acked with the rest."""

    async def acked(self, claims: Sequence[AckClaim]) -> None:
        """The marks of these claims committed: clean up (best effort, never
        raises), and only for the claims ``ack`` acted on: the others name
        targets that are not the adapter's."""

    async def close(self) -> None: ...


# One ``ack_target_refused`` line names at most this many targets, each cut
# to this length: what it names is whatever a row holds.
REFUSED_TARGETS_NAMED = 20
REFUSED_TARGET_CHARS = 200


def own_targets(
    claims: Sequence[AckClaim],
    allowed: Callable[[AckClaim], bool],
    *,
    adapter: str,
    target: Callable[[AckClaim], str],
) -> list[AckClaim]:
    """The claims whose target ``allowed`` finds in the adapter's own config;
    the others are left out, with one error line for them all
    (``ack_target_refused``: the adapter, their inbox ids, ``target`` of each,
    never a credential: the targets are broker names).

    A row's ack intent is data: any login that may write an inbox row can
    point it at another application's stream, group, list or queue, and the
    acker must not ack there for it. Those claims are not returned as
    refused either: a refused claim stays owed and is retried forever, while
    one left out here is marked acked with the rest and costs nothing again.
    An incomplete intent (no target, no ref) is left out the same way: no
    adapter writes one, and no broker call can discharge it."""
    ours: list[AckClaim] = []
    foreign: list[AckClaim] = []
    for claim in claims:
        (ours if allowed(claim) else foreign).append(claim)
    if foreign:
        named = sorted({target(c)[:REFUSED_TARGET_CHARS] for c in foreign})
        log.error(
            "ack_target_refused",
            adapter=adapter,
            inbox_ids=sorted({c.inbox_id for c in foreign}),
            targets=named[:REFUSED_TARGETS_NAMED],
            refused=len(foreign),
            detail="ack intents naming targets this adapter's config does not: not sent to the broker,"
            " marked acked (a row repointed, or written by another login, or before a config change)",
        )
    return ours


class Unconfirmed(Generic[T]):
    """What an adapter keeps per batch returned and not yet confirmed, oldest
    first: the bookkeeping behind :meth:`PullAdapter.stored` and
    :meth:`PullAdapter.rewind`. Iterating it walks what is still held."""

    def __init__(self) -> None:
        self._held: deque[T] = deque()

    def returned(self, item: T) -> None:
        """A batch went out (``read`` or ``recover``, non-empty) with ``item``."""
        self._held.append(item)

    def confirmed(self) -> T | None:
        """``stored()``: the oldest batch committed; its item, None if none is held."""
        return self._held.popleft() if self._held else None

    def rewound(self) -> list[T]:
        """``rewind()``: none of them will be stored; every item, oldest first."""
        items = list(self._held)
        self._held.clear()
        return items

    def __iter__(self) -> Iterator[T]:
        return iter(self._held)

    def __len__(self) -> int:
        return len(self._held)


class PullAdapterBase:
    """The documented defaults of :class:`PullAdapter`, for a transport's
    adapter to inherit (the Protocol stays the contract; a mode overrides
    what it does otherwise): one batch's commit at a time, in any order;
    nothing in the background; the broker redelivers by itself, so nothing
    is recovered; nothing is read ahead of a request; the acker acks."""

    overlapping_commits = False
    ordered = False

    async def run_background(self, stop: asyncio.Event) -> None:
        """Nothing runs in the background."""

    async def recover(self, open_ledger: OpenLedger) -> list[Delivery]:
        """Nothing: the broker delivers again what stays unacked."""
        return []

    async def pause(self) -> None:
        """Nothing: nothing is read ahead of a request."""

    async def ack_stored(self) -> Sequence[Delivery]:
        """Nothing: the acker acks, from committed intents."""
        return []


class Replayed:
    """The batches an adapter returned and has not seen stored, and those it
    delivers again from memory after a rewind: ``stored()`` and ``rewind()``
    written once for every mode that keeps its unstored deliveries itself
    (the broker cannot redeliver them, or would only after a timeout)."""

    def __init__(self) -> None:
        self._unconfirmed: Unconfirmed[list[Delivery]] = Unconfirmed()
        self._again: list[Delivery] = []

    def returned(self, batch: list[Delivery]) -> None:
        """A read returned ``batch`` (nothing is noted for an empty one)."""
        if batch:
            self._unconfirmed.returned(batch)

    def take(self, max_count: int) -> list[Delivery]:
        """Up to ``max_count`` deliveries to deliver again, oldest first,
        noted as returned; [] when none wait."""
        batch, self._again = self._again[:max_count], self._again[max_count:]
        self.returned(batch)
        return batch

    def stored(self) -> None:
        """The oldest batch returned was committed."""
        self._unconfirmed.confirmed()

    def rewind(self) -> None:
        """None of the batches returned will be stored: each is delivered
        again, before what already waited."""
        self._again = [d for batch in self._unconfirmed.rewound() for d in batch] + self._again

    def held(self) -> list[Delivery]:
        """Every delivery held unstored, returned or waiting."""
        return [d for batch in self._unconfirmed for d in batch] + self._again

    def clear(self) -> None:
        """Forget them all (the broker takes them back)."""
        self._unconfirmed.rewound()
        self._again = []


class AdapterBuilder(Protocol):
    """How a mode builds its adapter. ``ledger`` is for modes with a durable
    consumer (streams) and ignored by the others; with None such an adapter
    records nothing (``status``, which never creates a consumer)."""

    def __call__(self, config: AdapterConfig, /, *, ledger: ConsumerLedger | None) -> PullAdapter: ...


class ModeImplementation(NamedTuple):
    """What a transport registers for one mode: how to build each side, the
    ack kind its intents carry, and who sends its acks (:data:`AckParty`:
    the acker from committed intents, or the consuming process after its
    commit where acks are bound to the receiving channel)."""

    adapter: AdapterBuilder
    acknowledger: Callable[[AdapterConfig], Acknowledger]
    ack_kind: AckKind
    acked_by: AckParty = "acker"


class AckIntentView(NamedTuple):
    """An ack intent as the inbox keeps it, for its transport to put in words
    (``trace``): the columns ``ack_kind``, ``ack_key``, ``ack_group``,
    ``ack_entry_id`` (the ref) and ``ack_copies``."""

    kind: str
    key: str | None
    group: str | None
    ref: str | None
    copies: int
