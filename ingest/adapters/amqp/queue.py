"""AMQP 0-9-1 (RabbitMQ) ``queue`` mode: one consumer on an existing queue,
acked by the ingester itself after each commit.

Broker side (DESIGN.md section 6b)::

    {source}      the queue (classic or quorum), declared by its owner, never by us

Reading: one channel per adapter with manual acks and a prefetch of twice
``batch_size`` (the batch being stored, and the next one read meanwhile);
deliveries pushed by the server wait in memory until ``read`` takes up to
``max_count`` of them, waiting at most ``block_ms`` for the first.

Acking: an AMQP ack is bound to the channel that received the delivery, so
no other process can send it. The poll loop stores a batch (its inbox rows
carry the intent, ``ack_entry_id`` = ``{channel session}:{delivery tag}``),
and only once that transaction has committed calls :meth:`ack_stored`, which
acks with ``multiple`` up to the last tag of the batches committed: never
past an uncommitted one, since batches are read, and committed, in tag order
(``overlapping_commits`` is off). The loop then marks the intents acked.

What a crash or a lost channel leaves: every delivery the channel held goes
back to the queue (the broker's own rule), comes again (``redelivered``, or
a quorum queue's ``x-delivery-count``), dedups to its inbox row, which then
names the new delivery, and is acked. An ack sent and never marked (a crash
between the two) leaves a row pending whose channel is gone: the consumer's
next channel settles its earlier channels' rows at its start
(``ConsumerLedger.settle_acks``).

Keys: ``{key_prefix}:{queue}:{message_id}`` where the message carries the
``message_id`` property (the producer's choice, so taken into the key only
as ``backhalf.writes.keys.key_id`` escapes it: no ``:``, no NUL, no id that differs
making the same key), else ``{key_prefix}:{queue}:{sha256(body)}``; the
inbox's ``source_message_id`` is that id as received (a NUL made U+FFFD,
``keys.storable_id``) or that digest (a departure from
DESIGN.md, which says NULL: see docs/architecture.md), so every AMQP row is
deduplicated by the inbox for as long as it is kept, not only while its todo
is active, and a batch mixing both kinds is one statement.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import aiormq
import structlog
from aio_pika.abc import AbstractChannel, AbstractConnection
from aiormq.abc import DeliveredMessage

from backhalf.records import AckTarget
from backhalf.tracing import TRACEPARENT, TRACESTATE
from backhalf.writes.keys import key_id, native_key, storable_id
from ingest.adapters.amqp.common import (
    CALL_TIMEOUT_S,
    amqp_errors,
    close_connection,
    connect,
    server_label,
    user_of,
)
from ingest.adapters.amqp.frames import UNDECODABLE
from ingest.adapters.amqp.settings import vhost as amqp_vhost
from ingest.adapters.base import (
    Acknowledger,
    ConsumerLedger,
    Delivery,
    PullAdapterBase,
    Unconfirmed,
    trace_of,
)
from ingest.config import AdapterConfig
from ingest.errors import BrokerError, ConfigError

# This mode's ack kind (the intents' words, ``describe_ack``).
ACK_KIND = "amqp"
# A quorum queue's count of a message's earlier deliveries (RabbitMQ 3.8+).
DELIVERY_COUNT = "x-delivery-count"
CLOSE_TIMEOUT_S = 5.0

log = structlog.get_logger(__name__)


def no_acker(config: AdapterConfig) -> Acknowledger:
    """The acker's acknowledger, which this mode has none of (the factory
    asks ``acked_by`` first; reaching this is a bug)."""
    raise ConfigError(f"adapter {config.name!r}: an AMQP adapter is acked by its ingester, not the acker")


class _Batch(NamedTuple):
    """A batch returned by ``read``: the channel it came on (its tags are
    that channel's and name nothing on another), its deliveries and the
    highest delivery tag among them."""

    channel: AbstractChannel
    deliveries: list[Delivery]
    last_tag: int


def _tag_of(delivery: Delivery) -> int:
    """A delivery's tag, from its ref ``{session}:{tag}``."""
    return int((delivery.ack_ref or "0").rpartition(":")[2])


def deliveries_of(message: DeliveredMessage) -> int:
    """How many times the message has been delivered, this time included:
    a quorum queue counts the earlier ones; elsewhere only ``redelivered``
    says it came before (once at least)."""
    count = _delivery_count(message)
    if count is not None:
        return count + 1
    return 2 if getattr(message.delivery, "redelivered", False) else 1


def _delivery_count(message: DeliveredMessage) -> int | None:
    headers = message.header.properties.headers or {}
    count = headers.get(DELIVERY_COUNT)
    if isinstance(count, int) and not isinstance(count, bool) and count >= 0:
        return count
    return None


class AmqpQueueAdapter(PullAdapterBase):
    """A :class:`ingest.adapters.base.PullAdapter` over one AMQP queue."""

    # Acks go out with ``multiple`` in tag order: one commit at a time.

    def __init__(self, config: AdapterConfig, *, ledger: ConsumerLedger | None = None) -> None:
        self.name = config.name
        self._cfg = config
        self._ledger = ledger  # None for ``status``, which never consumes
        self._url = config.broker.url()
        self.identity = f"amqp user: {user_of(self._url)} vhost: {amqp_vhost(self._url)}"
        self.broker = server_label(self._url)  # for log fields: never a credential
        self._connection: AbstractConnection | None = None
        self._channel: AbstractChannel | None = None
        self._session = ""  # this channel's id in the intents' refs
        self._consumer_tag: str | None = None
        self._arrived: asyncio.Queue[DeliveredMessage | None] = asyncio.Queue()
        self._closed_by: BaseException | None = None  # why the server closed the channel
        self._unconfirmed: Unconfirmed[_Batch] = Unconfirmed()
        self._replay: list[_Batch] = []
        self._committed: list[_Batch] = []
        self._connecting = asyncio.Lock()
        self._settled = False  # the consumer's earlier channels' intents (see start)

    @property
    def ack_target(self) -> AckTarget:
        # by_cursor: no ack_queue row per message; the intents are found by
        # ``ack_xid`` (cleared by the mark) and the ref alone.
        return AckTarget(ACK_KIND, self._cfg.source, None, by_cursor=True)

    # -- the channel --------------------------------------------------------

    async def start(self) -> None:
        async with self._connecting:
            if self._channel is None or self._channel.is_closed or self._closed_by is not None:
                # One channel per connection: a channel that ended takes its
                # connection along (whose own state may lag behind a reset),
                # and the next one starts on a fresh connection.
                await self._drop_connection()
                await self._open()
            if not self._settled:
                await self._settle()

    async def _settle(self) -> None:
        """Once per channel, after it opened: the intents this consumer left
        pending on its earlier channels are settled (those channels have
        ended, and with them whatever they held). A failure raises (the
        database's error) and is tried again by the next read."""
        if self._ledger is not None:
            cfg = self._cfg
            settled = await self._ledger.settle_acks(self.name, cfg.consumer, f"{self._session}:")
            if settled:
                log.info("ended_channels_settled", adapter=self.name, consumer=cfg.consumer, intents=settled)
        self._settled = True

    async def _open(self) -> None:
        """A fresh connection's channel, consuming. What the rest of the
        adapter sees of it (channel, session, arrivals) is published at once,
        only when it consumes: a half-open channel is never taken for the
        current one, and one a cancellation left half-open goes with its
        connection."""
        cfg = self._cfg
        try:
            if self._connection is None:
                self._connection = await connect(cfg, role="ingest")
            with amqp_errors(self.name, f"opening a channel to consume queue {cfg.source!r}"):
                channel = await self._connection.channel(publisher_confirms=False)
                underlay = await channel.get_underlay_channel()
                await self._check_queue(underlay)
                # The batch being stored and the next one read meanwhile.
                await channel.set_qos(prefetch_count=2 * cfg.batch_size, timeout=CALL_TIMEOUT_S)
                session = uuid.uuid4().hex[:16]
                arrived: asyncio.Queue[DeliveredMessage | None] = asyncio.Queue()
                consumed = await underlay.basic_consume(
                    cfg.source,
                    functools.partial(_put, arrived),
                    no_ack=False,
                    consumer_tag=f"switchboard.{cfg.consumer}.{session}",
                    timeout=CALL_TIMEOUT_S,
                )
        except BaseException as exc:
            # Whatever failed (a cancellation too), the next start begins on
            # a fresh connection.
            await self._drop_connection()
            if isinstance(exc, BrokerError) or not isinstance(exc, Exception):
                raise
            raise BrokerError(
                f"adapter {self.name}: opening a channel to {self.broker}: {type(exc).__name__}"
            ) from exc
        self._channel, self._session, self._arrived, self._closed_by = channel, session, arrived, None
        self._consumer_tag = consumed.consumer_tag
        self._settled = False
        channel.close_callbacks.add(self._channel_closed)
        if channel.is_closed:  # closed before the callback was there to say so
            self._channel_closed(channel, ConnectionError("the channel closed as it opened"))
        log.info(
            "amqp_consuming", adapter=self.name, queue=cfg.source, broker=self.broker, session=self._session
        )

    async def _check_queue(self, underlay: aiormq.abc.AbstractChannel) -> None:
        """The queue must exist (a passive declare; its absence closes the
        channel, which the next start opens again)."""
        try:
            await underlay.queue_declare(self._cfg.source, passive=True, timeout=CALL_TIMEOUT_S)
        except aiormq.exceptions.ChannelNotFoundEntity as exc:
            raise BrokerError(
                f"adapter {self.name}: the queue {self._cfg.source!r} does not exist on {self.broker}: create"
                " it (Switchboard never declares queues); retrying"
            ) from exc

    def _channel_closed(self, sender: object, exc: BaseException | None = None) -> None:
        """The channel ended: by us, or by the server (``consumer_timeout``,
        a permission refused, the queue deleted), asynchronously. Kept, and
        the read waiting is woken to raise it. An earlier channel's close,
        told late, is not the current one's."""
        if sender is not self._channel:
            return
        self._closed_by = exc or ConnectionError("the channel was closed")
        self._arrived.put_nowait(None)

    def _live(self, channel: AbstractChannel | None) -> bool:
        """Whether ``channel`` is the current one and still open: only its
        deliveries may be acked (or replayed, still held on it)."""
        return (
            channel is not None
            and channel is self._channel
            and self._closed_by is None
            and not channel.is_closed
        )

    async def _drop_channel(self) -> None:
        """Forget the channel; everything it held goes back to the queue."""
        channel, self._channel = self._channel, None
        self._consumer_tag = None
        self._committed.clear()
        if channel is not None and not channel.is_closed:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(CLOSE_TIMEOUT_S):
                    await channel.close()

    async def _drop_connection(self) -> None:
        await self._drop_channel()
        connection, self._connection = self._connection, None
        if connection is not None:
            await close_connection(connection, adapter=self.name)

    def _raise_if_closed(self, what: str) -> None:
        if self._closed_by is not None or self._channel is None or self._channel.is_closed:
            reason = self._closed_by or ConnectionError("the channel is closed")
            raise BrokerError(
                f"adapter {self.name}: {what}: the channel to {self.broker} ended ({_reason(reason)}); every"
                " delivery it held went back to the queue"
            ) from reason

    # -- the poll loop's side ----------------------------------------------

    async def read(self, max_count: int) -> list[Delivery]:
        replay = self._take_replay(max_count)
        if replay is not None:
            return replay
        try:
            await self.start()
            channel, session = self._channel, self._session
            messages = await self._take(max_count)
        except BrokerError:
            await self._drop_connection()
            raise
        if not messages or channel is None or not self._live(channel):
            # Dropped while this waited (a failed ack): what it took went
            # back to the queue with the channel.
            return []
        batch = _Batch(channel, [self._delivery(m, session) for m in messages], _tag(messages[-1]))
        self._unconfirmed.returned(batch)
        return batch.deliveries

    def _take_replay(self, max_count: int) -> list[Delivery] | None:
        """Rewound batches, again, up to ``max_count`` messages, while their
        channel lives (they are still held on it); those of an ended channel
        are dropped: the broker put them back in the queue, to be delivered
        again. Their order, and so their tags' order, is kept."""
        live = [b for b in self._replay if self._live(b.channel)]
        self._replay = []
        if not live:
            return None
        channel = live[0].channel
        deliveries = [d for b in live for d in b.deliveries]
        taken, rest = deliveries[:max_count], deliveries[max_count:]
        if rest:
            self._replay = [_Batch(channel, rest, max(map(_tag_of, rest)))]
        batch = _Batch(channel, taken, max(map(_tag_of, taken)))
        self._unconfirmed.returned(batch)
        return taken

    async def _take(self, max_count: int) -> list[DeliveredMessage]:
        """Up to ``max_count`` deliveries that arrived, waiting ``block_ms``
        at most for the first; taken without a pause in between, so a read
        cancelled while it waits has taken nothing."""
        self._raise_if_closed("reading")
        arrived = self._arrived
        if arrived.empty():
            try:
                async with asyncio.timeout(self._cfg.block_ms / 1000):
                    first = await arrived.get()
            except TimeoutError:
                return []
            if first is None:
                self._raise_if_closed("reading")
                return []
            messages = [first]
        else:
            messages = []
        while len(messages) < max_count and not arrived.empty():
            message = arrived.get_nowait()
            if message is None:  # the channel ended: what came before it is void too
                self._raise_if_closed("reading")
                break
            messages.append(message)
        return messages

    def _delivery(self, message: DeliveredMessage, session: str) -> Delivery:
        body = message.body
        properties = message.header.properties
        undecodable = (properties.headers or {}).get(UNDECODABLE)
        if undecodable is not None:
            # Its properties are gone (frames.py): keyed by its body.
            log.warning("amqp_properties_undecodable", adapter=self.name, error=str(undecodable))
        producer_id = properties.message_id
        if producer_id:
            # The producer's choice: data, never trusted as a key as it is.
            message_id = storable_id(producer_id)
            key = native_key(self._cfg.key_prefix, self._cfg.source, key_id(producer_id))
        else:
            message_id = hashlib.sha256(body).hexdigest()
            key = native_key(self._cfg.key_prefix, self._cfg.source, message_id)
        ref = f"{session}:{_tag(message)}"
        # A classic queue says only that a message came before, not how
        # often: a lower bound, which the poll loop treats as a suspect.
        exact = _delivery_count(message) is not None or not getattr(message.delivery, "redelivered", False)
        headers = properties.headers
        trace = trace_of(headers.get(TRACEPARENT), headers.get(TRACESTATE)) if headers else None
        return Delivery(
            key,
            message_id,
            body=body,
            ack_ref=ref,
            deliveries=deliveries_of(message),
            deliveries_exact=exact,
            trace=trace,
        )

    def stored(self) -> None:
        batch = self._unconfirmed.confirmed()
        if batch is not None:
            self._committed.append(batch)

    def rewind(self) -> None:
        self._replay = self._unconfirmed.rewound() + self._replay

    async def pause(self) -> None:
        """Disabled: the channel closes, so what its prefetch took (read or
        not, none of it stored: the poll loop waited for its commits first)
        goes back to the queue for other consumers; the next read opens a
        new channel."""
        self._replay.clear()
        await self._drop_connection()
        log.info("amqp_paused", adapter=self.name, queue=self._cfg.source)

    async def ack_stored(self) -> Sequence[Delivery]:
        """The committed batches acked on this channel with one ``basic.ack``
        (``multiple`` up to their last tag). A batch of an ended channel was
        put back in the queue by the broker: dropped, its redelivery acks it."""
        committed, self._committed = self._committed, []
        channel = self._channel
        live = [b for b in committed if b.channel is channel]
        if channel is None or not live:
            return []
        last = max(b.last_tag for b in live)
        try:
            self._raise_if_closed(f"acking {sum(len(b.deliveries) for b in live)} stored messages")
            with amqp_errors(self.name, f"acking up to delivery tag {last}"):
                async with asyncio.timeout(CALL_TIMEOUT_S):  # a socket that does not drain
                    underlay = await channel.get_underlay_channel()
                    await underlay.basic_ack(last, multiple=True)
        except BrokerError:
            await self._drop_connection()
            raise
        return [d for b in live for d in b.deliveries]

    # -- status ------------------------------------------------------------

    async def describe(self) -> Mapping[str, object]:
        """The queue's ready messages and consumers (a passive declare, on a
        channel of its own: a missing queue closes the channel it is asked
        on), and what this process holds unacked."""
        connection = self._connection
        own = connection is None or connection.is_closed or not self._live(self._channel)
        try:
            if own:
                connection = await connect(self._cfg, role="status")
            assert connection is not None
            with amqp_errors(self.name, f"declaring queue {self._cfg.source!r} passively"):
                async with asyncio.timeout(CALL_TIMEOUT_S):
                    channel = await connection.channel(publisher_confirms=False)
                    try:
                        underlay = await channel.get_underlay_channel()
                        try:
                            ok = await underlay.queue_declare(self._cfg.source, passive=True)
                        except aiormq.exceptions.ChannelNotFoundEntity:
                            return {"ready": None, "consumers": None, "queue": "missing"}
                    finally:
                        if not channel.is_closed:
                            await channel.close()
        finally:
            if own and connection is not None:
                await close_connection(connection, adapter=self.name)
        figures: dict[str, object] = {
            "ready": ok.message_count,
            "consumers": ok.consumer_count,
            "prefetch": 2 * self._cfg.batch_size,
        }
        # What this process holds unacked (0 for status's own adapter, and
        # for a paused one: the gauge then falls back to 0).
        held = 0
        if self._live(self._channel):
            held = sum(len(b.deliveries) for b in (*self._unconfirmed, *self._replay, *self._committed))
            held += self._arrived.qsize()
        figures["held_here"] = held
        return figures

    async def close(self) -> None:
        """Commits are over (the poll loop has ended): what is still held,
        read or not, goes back to the queue as the channel closes."""
        started = time.monotonic()
        await self._drop_connection()
        log.info("amqp_closed", adapter=self.name, close_ms=round((time.monotonic() - started) * 1000, 1))


async def _put(arrived: asyncio.Queue[DeliveredMessage | None], message: DeliveredMessage) -> None:
    """aiormq's consumer callback, run in a task of its own per delivery, in
    the order they came (tasks start in the order they were made, and this
    one does not pause)."""
    arrived.put_nowait(message)


def _tag(message: DeliveredMessage) -> int:
    tag = getattr(message.delivery, "delivery_tag", None)
    if not isinstance(tag, int):
        raise BrokerError(f"a delivery without a delivery tag: {type(message.delivery).__name__}")
    return tag


def _reason(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__
