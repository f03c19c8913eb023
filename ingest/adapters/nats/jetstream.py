"""NATS JetStream: a durable pull consumer, acked by the acker.

Broker side (DESIGN.md section 6b)::

    {source}                      the JetStream stream (created by its owner, never by us)
    {source} consumer {group}     the durable pull consumer, created when missing:
                                  explicit acks, deliver all, ``max_deliver`` unlimited,
                                  ``ack_wait`` and ``max_ack_pending`` from the config,
                                  an optional ``subject`` filter; an existing one is
                                  brought to those settings (an update), or refused
                                  where it cannot be (another ack policy)

Reading: batched fetches of up to ``batch_size``, expiring after ``block_ms``.
Each delivery's reply subject (``$JS.ACK.<stream>.<consumer>.<delivered>.
<stream seq>.<consumer seq>.<time>.<pending>``, longer with a domain or an
account hash) is its ack intent, stored as the server gave it; the acker
sends ``+ACK`` to it as a request, so a consumer that vanished answers "no
responders" instead of swallowing the ack. The ingester never acks (its
NATS user may be denied ``$JS.ACK.>``: ``ops/nats-server.conf``).

Redelivery is the server's: a delivery unacked after ``ack_wait`` comes
again, with its delivery count, and dedups to its inbox row (whose ack
intent then takes the newest reply subject). ``max_deliver`` is left
unlimited, so the server never gives a message up on its own: Switchboard's
``max_deliveries`` rejects poison (stored as rejected, and acked), nothing
leaves unseen.

Idempotency key ``{key_prefix}:{stream}:{stream sequence}``; a stream
deleted and created again restarts its sequences at 1, and a new message on
a sequence the inbox holds with another body is stored under the reused-id
form of the key (``backhalf.writes.keys.reused_key``), as for Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping, Sequence
from typing import Any

import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import AckPolicy, ConsumerConfig, ConsumerInfo, DeliverPolicy, Header
from nats.js.client import JetStreamContext
from nats.js.errors import NotFoundError, ServiceUnavailableError

from backhalf.records import AckClaim, AckTarget
from backhalf.tracing import TRACEPARENT, TRACESTATE
from backhalf.writes.keys import native_key
from ingest.adapters.base import (
    ConsumerLedger,
    Delivery,
    PullAdapterBase,
    Replayed,
    own_targets,
    trace_of,
)
from ingest.adapters.nats.common import REQUEST_TIMEOUT_S, connect, nats_errors, server_label, user_name
from ingest.adapters.nats.settings import options
from ingest.config import AdapterConfig
from ingest.errors import AckError, BrokerError, GroupMissing

# This mode's ack kind, registered in ingest.adapters.nats.MODES.
ACK_KIND = "jsack"
ACK_BODY = b"+ACK"
# How often, at most, an empty fetch asks whether the consumer is full of
# unacked deliveries (max_ack_pending), to say why nothing comes.
FULL_CHECK_INTERVAL_S = 5.0
# Acks sent at once per wave, each answered on the connection's reply
# subscription before the next wave goes.
ACK_WAVE = 1000
# The status of an answer saying nobody took the ack: the consumer is gone.
NO_RESPONDERS = "503"

log = structlog.get_logger(__name__)


def _wanted(config: AdapterConfig) -> ConsumerConfig:
    """The durable consumer Switchboard needs."""
    own = options(config)
    return ConsumerConfig(
        name=own.group,
        durable_name=own.group,
        ack_policy=AckPolicy.EXPLICIT,
        deliver_policy=DeliverPolicy.ALL,
        max_deliver=-1,
        ack_wait=own.ack_wait_ms / 1000,
        max_ack_pending=own.max_ack_pending,
        filter_subject=own.subject,
    )


# What Switchboard sets on a consumer it finds: the rest is its owner's.
_CORRECTED = ("max_deliver", "max_ack_pending", "filter_subject", "ack_wait")


def _drifted(have: ConsumerConfig, want: ConsumerConfig) -> list[str]:
    """The settings of an existing consumer that differ from ours."""
    drift = [f for f in _CORRECTED[:3] if getattr(have, f) != getattr(want, f)]
    if have.ack_wait is None or abs(have.ack_wait - (want.ack_wait or 0)) > 0.001:
        drift.append("ack_wait")
    return drift


def _unusable(have: ConsumerConfig) -> str | None:
    """What makes an existing consumer one Switchboard must not read through
    (and cannot edit): other acks, bodies withheld, a push consumer, several
    filters where one is configured."""
    if have.ack_policy != AckPolicy.EXPLICIT:
        return f"ack policy {have.ack_policy} (Switchboard needs explicit acks)"
    if have.headers_only:
        return "headers_only set (its messages come without their bodies)"
    if have.deliver_subject:
        return "a deliver subject (a push consumer; Switchboard pulls)"
    if have.filter_subjects:
        return "several filter subjects (Switchboard sets one, `subject`)"
    return None


def position(msg: Msg) -> tuple[str, int]:
    """A delivery's stream sequence and delivery count, read off its reply
    subject: ``$JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.…`` (9
    tokens), or with a domain and an account hash after ``ACK`` (12 or
    more). nats-py's ``msg.metadata`` parses the same subject into objects,
    a fifth of the ingester's time (issue 26's bench); it stays the answer
    for any other form."""
    tokens = (msg.reply or "").split(".")
    if tokens[:2] == ["$JS", "ACK"]:
        if len(tokens) == 9:
            return tokens[5], int(tokens[4])
        if len(tokens) >= 12:
            return tokens[7], int(tokens[6])
    meta = msg.metadata
    return str(meta.sequence.stream), meta.num_delivered or 1


class JetStreamAdapter(PullAdapterBase):
    """A :class:`ingest.adapters.base.PullAdapter` over one durable pull consumer."""

    # Redelivery rests on the server's record (ack pending), as a stream's PEL.
    overlapping_commits = True

    def __init__(self, config: AdapterConfig, *, ledger: ConsumerLedger | None = None) -> None:
        # ``ledger`` is unused: a consumer recreated delivers the whole stream
        # again (deliver all), and the inbox dedups what it holds.
        self.name = config.name
        self._cfg = config
        self._opts = options(config)
        self._url = config.broker.url()
        self._client: Client | None = None
        self._js: JetStreamContext | None = None
        self._sub: JetStreamContext.PullSubscription | None = None
        self.identity = "nats user: (not connected)"
        self.broker = server_label(self._url)  # for log fields: never a credential
        # Batches returned and not yet confirmed, kept to give back at once on
        # rewind: the server's own redelivery waits for ack_wait.
        self._batches = Replayed()
        self._next_full_check = 0.0
        self._refusal: str | None = None  # a fetch the server refused (permissions violation)
        self._connecting = asyncio.Lock()

    @property
    def ack_target(self) -> AckTarget:
        return AckTarget(ACK_KIND, self._cfg.source, self._opts.group, by_cursor=True)

    async def start(self) -> None:
        if self._sub is not None:
            return
        client = await self._connection()
        js = client.jetstream(timeout=REQUEST_TIMEOUT_S)
        await self._ensure_consumer(js)
        cfg = self._cfg
        with nats_errors(self.name, f"subscribing to consumer {self._opts.group} of stream {cfg.source}"):
            self._sub = await js.pull_subscribe_bind(durable=self._opts.group, stream=cfg.source)
        self._js = js

    async def _connection(self) -> Client:
        # The poll loop's read and the gauges' describe both come here: one connects.
        async with self._connecting:
            if self._client is None or self._client.is_closed:
                self._client = await connect(self._cfg, role="ingest", on_error=self._server_said)
                self.identity = f"nats user: {await user_name(self._client, self._url)}"
                self._refusal = None  # a refusal of the identity's question is no fetch's
            return self._client

    def _server_said(self, exc: Exception) -> None:
        """An asynchronous error of the connection. A fetch the user may not
        make is refused this way, its request then expiring like an empty
        one: kept, so the read raises it instead of returning nothing."""
        text = str(exc).lower()
        if "permissions violation" in text and "msg.next" in text:
            self._refusal = str(exc)

    async def _ensure_consumer(self, js: JetStreamContext) -> None:
        cfg = self._cfg
        bound = log.bind(adapter=self.name, stream=cfg.source, consumer=self._opts.group, broker=self.broker)
        want = _wanted(cfg)
        with nats_errors(self.name, f"consumer {self._opts.group} of stream {cfg.source}"):
            try:
                await js.stream_info(cfg.source)
            except NotFoundError as exc:
                raise BrokerError(
                    f"adapter {self.name}: the JetStream stream {cfg.source!r} does not exist on"
                    f" {self.broker}: create it (Switchboard never creates streams); retrying"
                ) from exc
            try:
                info = await js.consumer_info(cfg.source, self._opts.group)
            except NotFoundError:
                await js.add_consumer(cfg.source, config=want)
                bound.info(
                    "consumer_created",
                    ack_wait_ms=self._opts.ack_wait_ms,
                    max_ack_pending=self._opts.max_ack_pending,
                )
                return
            have = info.config
            unusable = _unusable(have)
            if unusable:
                raise BrokerError(
                    f"adapter {self.name}: consumer {self._opts.group!r} of stream {cfg.source!r}"
                    f" has {unusable}:"
                    " Switchboard cannot consume through it; delete it, or name another group"
                )
            drift = _drifted(have, want)
            if drift:
                # ack_wait, max_deliver, max_ack_pending, the filter: all editable
                # (a create without an action updates an existing consumer). Only
                # those change: the rest of its settings stay as they are.
                update = have.evolve(**{f: getattr(want, f) for f in _CORRECTED})
                await js.add_consumer(cfg.source, config=update)
                bound.warning("consumer_updated", settings=drift)

    async def read(self, max_count: int) -> list[Delivery]:
        if again := self._batches.take(max_count):
            return again
        try:
            await self.start()
            assert self._sub is not None
            with nats_errors(self.name, f"fetching from consumer {self._opts.group} of {self._cfg.source}"):
                messages = await self._fetch(self._sub, max_count)
        except BrokerError:
            await self._forget_connection()
            raise
        if not messages and self._refusal is not None:
            refusal, self._refusal = self._refusal, None
            raise BrokerError(
                f"adapter {self.name}: the server refused this NATS user a request (fetching from consumer"
                f" {self._opts.group} of {self._cfg.source} needs"
                f" $JS.API.CONSUMER.MSG.NEXT.{self._cfg.source}.{self._opts.group};"
                f" see ops/nats-server.conf): {refusal}"
            )
        batch = [self._delivery(m) for m in messages]
        self._batches.returned(batch)
        return batch

    async def _fetch(self, sub: JetStreamContext.PullSubscription, max_count: int) -> list[Msg]:
        try:
            return await sub.fetch(max_count, timeout=self._cfg.block_ms / 1000)
        except (TimeoutError, NatsTimeout):
            await self._say_if_full()
            return []
        except (ServiceUnavailableError, NotFoundError) as exc:
            # The consumer (or its stream) was deleted under us: the next read
            # creates it again, once the stream exists.
            raise GroupMissing(
                f"adapter {self.name}: consumer {self._opts.group} of stream {self._cfg.source}"
                f" is gone: {exc}"
            ) from exc

    async def _say_if_full(self) -> None:
        """Nothing came: if because the consumer holds ``max_ack_pending``
        unacked deliveries (the acker is behind or stopped), say so, at most
        every few seconds. The server says nothing of it itself."""
        now = time.monotonic()
        if now < self._next_full_check or self._js is None:
            return
        self._next_full_check = now + FULL_CHECK_INTERVAL_S
        info = await self._js.consumer_info(self._cfg.source, self._opts.group)
        if (info.num_ack_pending or 0) >= self._opts.max_ack_pending:
            log.warning(
                "waiting_for_acks",
                adapter=self.name,
                consumer=self._opts.group,
                ack_pending=info.num_ack_pending,
                max_ack_pending=self._opts.max_ack_pending,
                stream_pending=info.num_pending,
                detail="the consumer holds max_ack_pending unacked deliveries: the server delivers nothing"
                " more until the acker acks (is `switchboard ack` running?)",
            )

    def _delivery(self, msg: Msg) -> Delivery:
        sequence, delivered = position(msg)
        key = native_key(self._cfg.key_prefix, self._cfg.source, sequence)
        headers = msg.headers
        trace = trace_of(headers.get(TRACEPARENT), headers.get(TRACESTATE)) if headers else None
        return Delivery(key, sequence, body=msg.data, ack_ref=msg.reply, deliveries=delivered, trace=trace)

    async def _forget_connection(self) -> None:
        """After a failure, the next read subscribes (and if need be connects) afresh."""
        await self._unsubscribe()
        self._js = None
        if self._client is not None and not self._client.is_connected:
            await self._close_client()

    async def _unsubscribe(self) -> None:
        sub, self._sub = self._sub, None
        if sub is None or self._client is None or not self._client.is_connected:
            return
        try:
            await sub.unsubscribe()
        except Exception as exc:  # noqa: BLE001 - the subscription is dropped either way
            log.info("nats_unsubscribe_failed", adapter=self.name, error=str(exc) or type(exc).__name__)

    async def _close_client(self) -> None:
        client, self._client = self._client, None
        if client is not None and not client.is_closed:
            try:
                await client.close()
            except Exception as exc:  # noqa: BLE001 - closing what already failed
                log.info("nats_close_failed", adapter=self.name, error=str(exc) or type(exc).__name__)

    def stored(self) -> None:
        self._batches.stored()

    def rewind(self) -> None:
        self._batches.rewind()

    async def describe(self) -> Mapping[str, object]:
        cfg = self._cfg
        client = await self._connection()
        js = client.jetstream(timeout=REQUEST_TIMEOUT_S)
        with nats_errors(self.name, f"consumer info {self._opts.group} of {cfg.source}"):
            stream = await js.stream_info(cfg.source)
            try:
                info: ConsumerInfo | None = await js.consumer_info(cfg.source, self._opts.group)
            except NotFoundError:
                info = None
        figures: dict[str, Any] = {"stream_messages": stream.state.messages}
        if info is None:
            return figures | {"num_pending": None, "num_ack_pending": None, "consumer": "missing"}
        return figures | {
            "num_pending": info.num_pending,
            "num_ack_pending": info.num_ack_pending,
            "num_redelivered": info.num_redelivered,
            "num_waiting": info.num_waiting,
            "max_ack_pending": info.config.max_ack_pending,
        }

    async def close(self) -> None:
        await self._unsubscribe()
        self._js = None
        await self._close_client()


# JetStream ack subjects, as nats-py's ``Msg.Metadata`` reads them:
# ``$JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.<consumer seq>.<time>.<pending>``
# (9 tokens), or ``$JS.ACK.<domain>.<account hash>.<stream>.<consumer>.`` and
# the same five numbers, then a random token the server adds (12; nats-py
# takes 11 too, and so does this). Where the stream and consumer names stand,
# and where the five numbers start.
_V1_TOKENS = 9
_V2_MIN_TOKENS = 11
_V1_NAMES, _V2_NAMES = slice(2, 4), slice(4, 6)
_V1_NUMBERS, _V2_NUMBERS = slice(4, 9), slice(6, 11)
_WILDCARDS = frozenset("*>")


def is_ack_subject_of(ref: str, stream: str, consumer: str) -> bool:
    """Whether ``ref`` is a JetStream ack subject of ``stream``'s durable
    ``consumer``, in either form, every token a literal (no wildcard, none
    empty) and its five numbers all digits: the acker publishes to nothing
    else, whatever a row says. A domain form's domain and account hash are
    not checked: the config names neither, and the subject stays in this
    connection's account."""
    tokens = ref.split(".")
    if tokens[:2] != ["$JS", "ACK"]:
        return False
    if len(tokens) == _V1_TOKENS:
        names, numbers = tokens[_V1_NAMES], tokens[_V1_NUMBERS]
    elif len(tokens) >= _V2_MIN_TOKENS:
        names, numbers = tokens[_V2_NAMES], tokens[_V2_NUMBERS]
    else:
        return False
    literal = all(t and t.isprintable() and " " not in t and not _WILDCARDS & set(t) for t in tokens)
    counted = all(n.isascii() and n.isdigit() for n in numbers)
    return literal and counted and names == [stream, consumer]


def _jsack_target(claim: AckClaim) -> str:
    """An intent's target for the log: its stream, consumer and subject."""
    return f"{claim.kind} {claim.key} {claim.group} {claim.ref}"


def _message_time_ns(ref: str) -> int:
    """The message's time in the stream (ns since the epoch) from its ack
    subject; 0 where the subject's form is not known (never given up)."""
    tokens = ref.split(".")
    at = 7 if len(tokens) == _V1_TOKENS else 9 if len(tokens) >= _V2_MIN_TOKENS else None
    if at is None or not tokens[at].isdigit():
        return 0
    return int(tokens[at])


class _Replies:
    """The answers to one connection's acks: one subscription on
    ``<inbox>.*``, each ack published with a reply subject of its own token
    under it. nats-py's ``request`` does the same per call, with a future,
    a timer and a token each: 80 us an ack against 14 for a wave this way
    (measured, issue 26's bench), and every ack is still answered.
    ``"503"`` (no responders) is an answer too: the consumer is gone."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self._waves = 0
        self._open: dict[str, str | None] = {}  # token -> its answer's status (None: +ACK taken)
        self._expected = 0
        self._all_in = asyncio.Event()

    def begin(self, count: int) -> list[str]:
        """Tokens for a wave of ``count`` acks; answers to an earlier wave
        (one given up) are not counted in this one."""
        self._waves += 1
        self._open, self._expected = {}, count
        self._all_in.clear()
        return [f"{self._waves}_{i}" for i in range(count)]

    async def answered(self, msg: Msg) -> None:
        token = msg.subject.rpartition(".")[2]
        if not token.startswith(f"{self._waves}_") or token in self._open:
            return
        self._open[token] = msg.headers.get(Header.STATUS) if msg.headers else None
        if len(self._open) >= self._expected:
            self._all_in.set()

    async def wait(self, timeout_s: float) -> dict[str, str | None]:
        """The answers in, by token, once all came or at ``timeout_s``."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._all_in.wait()
        return dict(self._open)


class JetStreamAcknowledger:
    """``+ACK`` to each committed intent's reply subject, each answered:
    only to ack subjects of the adapter's own stream and durable consumer
    (``is_ack_subject_of``), whatever a row says. An intent of the adapter's
    former consumer, after ``group`` is renamed in the config, is refused
    too: nothing reads that consumer any more, and its deliveries are not
    this adapter's to ack."""

    def __init__(self, config: AdapterConfig) -> None:
        self._cfg = config
        self._opts = options(config)
        self._name = config.name
        self._client: Client | None = None
        self._replies: _Replies | None = None
        self._one_wave = asyncio.Lock()  # a wave's answers are counted alone
        self._refusal: str | None = None  # a permission violation the server reported

    def _server_said(self, exc: Exception) -> None:
        """A publish the user may not make is dropped by the server, which
        says so asynchronously: kept, to name in the unanswered acks' error."""
        if "permissions violation" in str(exc).lower():
            self._refusal = str(exc)

    async def _connection(self) -> tuple[Client, _Replies]:
        if self._client is None or self._replies is None or not self._client.is_connected:
            await self.close()
            try:
                self._client = await connect(self._cfg, role="ack", on_error=self._server_said)
                replies = _Replies(self._client.new_inbox())
                with nats_errors(self._name, "subscribing to the acks' answers"):
                    await self._client.subscribe(f"{replies.prefix}.*", cb=replies.answered)
            except BrokerError as exc:  # an acknowledger raises AckError (its protocol)
                raise AckError(str(exc)) from exc
            self._replies = replies
        return self._client, self._replies

    def _ours(self, claim: AckClaim) -> bool:
        stream, consumer = self._cfg.source, self._opts.group
        return (
            claim.kind == ACK_KIND
            and claim.key == stream
            and claim.group == consumer
            and claim.ref is not None
            and is_ack_subject_of(claim.ref, stream, consumer)
        )

    async def ack(self, claims: Sequence[AckClaim]) -> Sequence[AckClaim]:
        ours = own_targets(claims, self._ours, adapter=self._name, target=_jsack_target)
        if not ours:
            return []
        async with self._one_wave:
            client, replies = await self._connection()
            current = await self._of_current_streams(client, ours)
            for start in range(0, len(current), ACK_WAVE):
                await self._ack_wave(client, replies, current[start : start + ACK_WAVE])
        return []

    async def _of_current_streams(self, client: Client, claims: Sequence[AckClaim]) -> list[AckClaim]:
        """The claims whose message is in its stream as it is now. A stream
        deleted and created again restarts its sequences, and the server
        reads an ack subject by stream, consumer and sequence alone: an old
        delivery's ack would ack the new message on its sequence (maybe not
        stored yet), or go unanswered. Its message's time (in the subject)
        tells: older than the stream, it was the old stream's, and its ack
        is given up (the old message is gone with its stream)."""
        js = client.jetstream(timeout=REQUEST_TIMEOUT_S)
        kept: list[AckClaim] = []
        for stream in sorted({c.key or "" for c in claims}):
            mine = [c for c in claims if c.key == stream]
            with nats_errors(self._name, f"stream info {stream}", error=AckError):
                try:
                    info = await js.stream_info(stream)
                except NotFoundError:
                    info = None
            if info is None or info.created is None:
                gone = "deleted" if info is None else "of unknown age"
                log.warning("acks_given_up", adapter=self._name, stream=stream, acks=len(mine), reason=gone)
                kept += [] if info is None else mine
                continue
            born_ns = int(info.created.timestamp() * 1e9)
            older = [c for c in mine if 0 < _message_time_ns(c.ref or "") < born_ns]
            if older:
                log.warning(
                    "acks_given_up",
                    adapter=self._name,
                    stream=stream,
                    acks=len(older),
                    reason="their messages are older than the stream: it was deleted and created again",
                )
            given_up = {id(c) for c in older}
            kept += [c for c in mine if id(c) not in given_up]
        return kept

    async def _ack_wave(self, client: Client, replies: _Replies, claims: Sequence[AckClaim]) -> None:
        tokens = replies.begin(len(claims))
        with nats_errors(self._name, f"+ACK x{len(claims)}", error=AckError):
            for token, claim in zip(tokens, claims, strict=True):
                await client.publish(claim.ref or "", ACK_BODY, reply=f"{replies.prefix}.{token}")
            await client.flush(timeout=int(REQUEST_TIMEOUT_S))
        answers = await replies.wait(REQUEST_TIMEOUT_S)
        unanswered = [c for t, c in zip(tokens, claims, strict=True) if t not in answers]
        if unanswered:
            refusal, self._refusal = self._refusal, None
            said = f"; the server refused this NATS user: {refusal}" if refusal else ""
            raise AckError(
                f"adapter {self._name}: +ACK x{len(claims)}: {len(unanswered)} not answered within"
                f" {REQUEST_TIMEOUT_S:g} s (first: inbox row {unanswered[0].inbox_id}){said}"
            )
        no_consumer: dict[tuple[str, str], int] = {}
        for token, claim in zip(tokens, claims, strict=True):
            status = answers[token]
            if status == NO_RESPONDERS:
                target = (claim.key or "", claim.group or "")
                no_consumer[target] = no_consumer.get(target, 0) + 1
            elif status is not None:
                raise AckError(f"adapter {self._name}: +ACK for inbox row {claim.inbox_id}: status {status}")
        for (stream, consumer), count in no_consumer.items():
            await self._consumer_gone(client, stream, consumer, count)

    async def _consumer_gone(self, client: Client, stream: str, consumer: str, count: int) -> None:
        """No one answered the acks: if the consumer (or its stream) is gone,
        so are its unacked deliveries, and nothing is left to ack (a consumer
        made again delivers them anew, and their acks are asked again).
        If it exists, the server did not answer: an AckError, tried again."""
        what = f"+ACK x{count} to consumer {consumer} of stream {stream}"
        js = client.jetstream(timeout=REQUEST_TIMEOUT_S)
        with nats_errors(self._name, what, error=AckError):
            try:
                await js.consumer_info(stream, consumer)
            except NotFoundError:
                log.warning(
                    "ack_consumer_missing", adapter=self._name, stream=stream, consumer=consumer, acks=count
                )
                return
        raise AckError(f"adapter {self._name}: {what}: no responders, though the consumer exists")

    async def acked(self, claims: Sequence[AckClaim]) -> None:
        """Nothing to clean up: an ack is idempotent by itself."""

    async def close(self) -> None:
        client, self._client, self._replies = self._client, None, None
        if client is not None and not client.is_closed:
            try:
                await client.close()
            except Exception as exc:  # noqa: BLE001 - closing what already failed
                log.info("nats_close_failed", adapter=self._name, error=str(exc) or type(exc).__name__)
