"""Redis reliable lists: BLMOVE onto a per-consumer processing list, LREM to ack.

Key layout::

    {source}                              the source list (producers LPUSH)
    {source}:processing:{consumer}        items this consumer moved and has not removed yet
    {source}:consumers                    set of consumer names that ever owned a processing list
    {source}:heartbeat:{consumer}         present while the consumer lives (PX heartbeat_ttl_ms)
    {source}:recovering:{processing}      recovery lock (SET NX PX), one recoverer per list

(``{source}`` is the list's name. On a Redis Cluster, ``cluster = true``,
every key of one list lives in the list's own slot, so producers keep
pushing to the name they know: a name without a hash tag is wrapped in one,
``{jobs}:processing:c1`` for ``jobs``; a name with a tag of its own (its
first ``{...}``, not empty) is used as it is, ``{jobs}:processing:c1`` for
``{jobs}`` and ``queue:{jobs}:in:processing:c1`` for ``queue:{jobs}:in``,
since its tag already leads every derived key to its slot. Config refuses a
name neither form keeps in its slot (a ``}`` and no tag), and two lists whose
keys would be the same: ``jobs`` and ``{jobs}`` on one broker.)

Items are moved from the tail (RIGHT) of the source to the head (LEFT) of the
processing list, so LPUSH producers get FIFO order. The ack intent is
``LREM processing <copies> <body>`` of exactly the copies this consumer
stored; the idempotency key is ``{key_prefix}:{source}:{sha256(body)}``.

Recovery (``recover``) reconciles a processing list with the database: under
the row locks of the list's pending ack intents (the same locks the acker
holds while it removes), copies on the list minus copies pending = copies
consumed but never stored, and those are delivered again with their ack on
that list. It runs for the consumer's own list at start-up and after a failed
store, and, every ``reap_interval_ms``, for the lists of consumers whose
heartbeat has expired. A live consumer's list is never touched.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from importlib import resources
from typing import Any

import structlog
from redis.exceptions import RedisError

from backhalf.records import AckClaim, AckTarget
from backhalf.writes.keys import body_key
from ingest.adapters.base import (
    ConsumerLedger,
    Delivery,
    OpenLedger,
    PullAdapterBase,
    Unconfirmed,
    own_targets,
)
from ingest.adapters.redis.common import RedisEndpoint, as_bytes, as_text, connect, redis_errors
from ingest.adapters.redis.settings import list_key_base, options
from ingest.config import AdapterConfig
from ingest.errors import AckError
from ingest.lifecycle import wait_stop

# This mode's ack kind, registered in ingest.adapters.redis.MODES.
ACK_KIND = "lrem"

log = structlog.get_logger(__name__)

# A recovery lock is held from counting a list until the store of what the
# count found has committed (``stored()`` of that batch), so two recoverers
# never count the same list at once. Its
# value is the recoverer's consumer name, so a restart of that consumer can
# take it back at once. The TTL bounds how long a crash mid-recovery blocks
# others; it must exceed a store's duration (a few statements under
# statement_timeout).
RECOVERY_LOCK_TTL_MS = 30_000


def key_base(source: str, *, cluster: bool = False) -> str:
    """What a list's derived keys begin with: its name, or on a Redis
    Cluster a name that hashes to the list's slot: ``{jobs}`` for ``jobs``
    (a tag hashes as the name does), the name itself where it holds a hash
    tag (``{jobs}``, ``queue:{jobs}:in``), so that BLMOVE, the guarded LREM
    and recovery never span two slots (``ingest.config.adapter``)."""
    return list_key_base(source, cluster=cluster)


def processing_key(source: str, consumer: str, *, cluster: bool = False) -> str:
    return f"{key_base(source, cluster=cluster)}:processing:{consumer}"


def removed_marker(processing: str, inbox_id: int) -> str:
    return f"{processing}:removed:{inbox_id}"


# The tail of a removed-marker's name: a key that ends so is a marker of a
# processing list, not a list (a consumer named so would collide with it).
_MARKER_TAIL = re.compile(r":removed:[0-9]+\Z")


def is_processing_key(key: str, source: str, *, cluster: bool = False) -> bool:
    """Whether ``key`` is ``processing_key(source, consumer, cluster=cluster)``
    of some consumer: the source's own key base (the hash-tag form on a
    Cluster, the plain name elsewhere, never the other; a name with a hash
    tag of its own is its key base in both), ``:processing:``, then a
    consumer name, not empty and not a removed-marker's tail."""
    prefix = f"{key_base(source, cluster=cluster)}:processing:"
    if not key.startswith(prefix):
        return False
    consumer = key[len(prefix) :]
    return bool(consumer) and _MARKER_TAIL.search(consumer) is None


def _lrem_target(claim: AckClaim) -> str:
    """An intent's target for the log: the list it names."""
    return f"{claim.kind} {claim.key}"


# LREM of exactly one intent's copies, guarded by a marker per inbox row so
# a retry never removes a copy twice; the script's header says why and how.
# Its comment lines stay in the file: EVAL sends the script with every claim.
_LUA = (resources.files("ingest.adapters.redis") / "guarded_lrem.lua").read_text("utf-8")
GUARDED_LREM = "\n".join(line for line in _LUA.splitlines() if not line.startswith("--"))
# Long enough for any acker to commit or retry; markers are deleted after the
# commit, so this only bounds what a crash leaves behind.
REMOVED_MARKER_TTL_MS = 24 * 3600 * 1000


class ListAdapter(RedisEndpoint, PullAdapterBase):
    """A :class:`ingest.adapters.base.PullAdapter` over one source list."""

    def __init__(self, config: AdapterConfig, *, ledger: ConsumerLedger | None = None) -> None:
        # ``ledger`` is unused: a list has no consumer group to record.
        self._opts = options(config)
        cluster = self._opts.cluster
        super().__init__(config.name, config.broker.url(), block_ms=config.block_ms, cluster=cluster)
        self._cfg = config
        self._base = key_base(config.source, cluster=cluster)
        self._processing = processing_key(config.source, config.consumer, cluster=cluster)
        self._consumers_key = f"{self._base}:consumers"
        self._started = False
        self._own_recovery_due = True
        self._next_reap_at = 0.0
        # Locks protecting each unconfirmed batch (empty for plain reads), and
        # locks whose batch is confirmed or abandoned, released on the next call.
        self._batch_locks: Unconfirmed[set[str]] = Unconfirmed()
        self._to_release: set[str] = set()

    def _locks_in_flight(self) -> set[str]:
        """The recovery locks some unconfirmed batch still needs."""
        return set().union(*self._batch_locks)

    def _heartbeat_key(self, consumer: str) -> str:
        return f"{self._base}:heartbeat:{consumer}"

    @property
    def ack_target(self) -> AckTarget:
        return AckTarget(ACK_KIND, self._processing, by_body=True)

    async def start(self) -> None:
        with redis_errors(self.name, f"start-up on {self._cfg.source}"):
            await self._beat()
            await self._learn_identity()
        self._started = True

    async def _beat(self) -> None:
        pipe = self._client.pipeline(transaction=False)
        pipe.set(self._heartbeat_key(self._cfg.consumer), "alive", px=self._opts.heartbeat_ttl_ms, xx=True)
        pipe.sadd(self._consumers_key, self._cfg.consumer)
        # Recovery locks we hold must outlive the stores they protect.
        for lock in self._locks_in_flight():
            pipe.pexpire(lock, RECOVERY_LOCK_TTL_MS)
        refreshed, *_ = await pipe.execute()
        if not refreshed:
            if self._started:
                # Our heartbeat lapsed: we may have been taken for dead and our
                # list reaped. Count it again before consuming more.
                log.warning("heartbeat_lapsed", adapter=self.name, consumer=self._cfg.consumer)
                self._own_recovery_due = True
            await self._client.set(
                self._heartbeat_key(self._cfg.consumer), "alive", px=self._opts.heartbeat_ttl_ms
            )

    async def run_background(self, stop: asyncio.Event) -> None:
        """The heartbeat, in its own task, so a slow commit or a long backoff in
        the poll loop never lets it lapse while this consumer is alive."""
        interval_s = self._opts.heartbeat_ttl_ms / 3000
        while not await wait_stop(stop, interval_s):
            try:
                await self._beat()
            except RedisError as exc:
                log.warning("heartbeat_failed", adapter=self.name, error=exc, broker=self.broker)

    async def read(self, max_count: int) -> list[Delivery]:
        cfg = self._cfg
        if self._own_recovery_due:
            # Nothing more goes onto our processing list until recovery has
            # counted it, or the count would include copies being stored.
            await asyncio.sleep(cfg.block_ms / 1000)
            return []
        with redis_errors(self.name, f"moving from {cfg.source}"):
            if not self._started:
                await self.start()
            first = await self._client.blmove(
                cfg.source,
                self._processing,
                cfg.block_ms / 1000,  # type: ignore[arg-type]  # BLMOVE takes fractional seconds
                src="RIGHT",
                dest="LEFT",
            )
            if first is None:
                return []
            bodies: list[bytes] = [as_bytes(first)]
            if max_count > 1:
                # BLMOVE takes one item; the rest of the batch in one round trip.
                pipe = self._client.pipeline(transaction=False)
                for _ in range(max_count - 1):
                    pipe.lmove(cfg.source, self._processing, src="RIGHT", dest="LEFT")
                bodies += [as_bytes(b) for b in await pipe.execute() if b is not None]
        self._batch_locks.returned(set())
        return [self._delivery(body, self._processing, 1) for body in bodies]

    def _delivery(self, body: bytes, processing: str, copies: int, *, redelivered: bool = False) -> Delivery:
        key = body_key(self._cfg.key_prefix, self._cfg.source, body)
        # Redis keeps no delivery count for list items: a recovered copy is
        # counted as a redelivery and PostgreSQL's attempts tell the rest.
        return Delivery(
            key, None, body=body, ack_key=processing, ack_copies=copies, deliveries=2 if redelivered else 1
        )

    def stored(self) -> None:
        self._to_release |= self._batch_locks.confirmed() or set()

    def rewind(self) -> None:
        # What was moved but not stored is on the processing list: recover it.
        self._own_recovery_due = True
        self._to_release.update(*self._batch_locks.rewound())

    async def _release_locks(self) -> None:
        # GET then DEL, not atomic: a lock could expire and be taken between
        # the two only if this consumer stalled for the whole TTL in between.
        for lock in sorted(self._to_release - self._locks_in_flight()):
            holder = await self._client.get(lock)
            if holder is not None and as_text(holder) == self._cfg.consumer:
                await self._client.delete(lock)
        self._to_release.clear()

    async def recover(self, open_ledger: OpenLedger) -> list[Delivery]:
        with redis_errors(self.name, "recovering processing lists"):
            if not self._started:
                await self.start()  # heartbeat first: a reaper must see us alive
            await self._release_locks()
            lists: list[tuple[str, str | None]] = []
            # A count is only right while none of our own batches from that
            # list is between read and commit: own recovery waits for an
            # empty pipeline, and a list whose recovered batch is still in
            # flight is not counted again.
            if self._own_recovery_due and not self._batch_locks:
                lists.append((self._processing, None))
            now = time.monotonic()
            if now >= self._next_reap_at:
                self._next_reap_at = now + self._opts.reap_interval_ms / 1000
                lists += await self._dead_consumers()
            in_flight = self._locks_in_flight()
            for processing, dead_owner in lists:
                lock = f"{self._base}:recovering:{processing}"
                if lock in in_flight:
                    continue
                deliveries = await self._recover_list(open_ledger, processing, dead_owner, lock)
                if processing == self._processing and deliveries is not None:
                    self._own_recovery_due = False
                if deliveries:
                    self._batch_locks.returned({lock})  # held until this batch is stored
                    return deliveries
                if deliveries is not None:
                    self._to_release.add(lock)  # nothing to store: nothing to protect
        return []

    async def _dead_consumers(self) -> list[tuple[str, str | None]]:
        members = await self._client.smembers(self._consumers_key)
        dead: list[tuple[str, str | None]] = []
        for raw in sorted(members):
            consumer = as_text(raw)
            if consumer != self._cfg.consumer and not await self._client.exists(
                self._heartbeat_key(consumer)
            ):
                dead.append(
                    (processing_key(self._cfg.source, consumer, cluster=self._opts.cluster), consumer)
                )
        return dead

    async def _recover_list(
        self, open_ledger: OpenLedger, processing: str, dead_owner: str | None, lock: str
    ) -> list[Delivery] | None:
        """Deliveries for the unstored copies on ``processing``; None if another
        recoverer holds the list (try again later)."""
        me = self._cfg.consumer
        if not await self._client.set(lock, me, nx=True, px=RECOVERY_LOCK_TTL_MS):
            holder = await self._client.get(lock)
            if holder is None or as_text(holder) != me:
                return None
            await self._client.pexpire(lock, RECOVERY_LOCK_TTL_MS)
        if dead_owner is not None and await self._client.exists(self._heartbeat_key(dead_owner)):
            self._to_release.add(lock)
            return None  # it came back: a live consumer's list is never taken
        async with open_ledger() as pending_copies:
            intents = await pending_copies(processing)
            # Copies of an intent already removed (its acker died before the
            # commit) are no longer on the list: count only the rest.
            done = (
                await self._client.mget([removed_marker(processing, i.inbox_id) for i in intents])
                if intents
                else []
            )
            pending: Counter[str] = Counter()
            for intent, marker in zip(intents, done, strict=True):
                removed = 0 if marker is None else int(marker)
                pending[intent.idempotency_key] += max(intent.copies - removed, 0)
            on_list = Counter(as_bytes(b) for b in await self._client.lrange(processing, 0, -1))
        deliveries = []
        for body, copies in on_list.items():
            unstored = copies - pending[body_key(self._cfg.key_prefix, self._cfg.source, body)]
            if unstored > 0:
                deliveries.append(self._delivery(body, processing, unstored, redelivered=True))
        if dead_owner is not None and not on_list:
            await self._client.srem(self._consumers_key, dead_owner)  # nothing left to reap
        if deliveries or on_list:
            log.info(
                "processing_list_recovered",
                adapter=self.name,
                processing=processing,
                dead_consumer=dead_owner,
                on_list=sum(on_list.values()),
                redelivered=sum(d.ack_copies for d in deliveries),
            )
        return deliveries

    async def describe(self) -> Mapping[str, object]:
        cfg = self._cfg
        with redis_errors(self.name, f"describing {cfg.source}"):
            members = sorted(as_text(m) for m in await self._client.smembers(self._consumers_key))
            consumers: dict[str, Any] = {}
            for name in members:
                ttl_ms = await self._client.pttl(self._heartbeat_key(name))
                consumers[name] = {
                    "processing_length": await self._client.llen(
                        processing_key(cfg.source, name, cluster=self._opts.cluster)
                    ),
                    "heartbeat_ttl_ms": ttl_ms if ttl_ms >= 0 else None,
                }
            length = await self._client.llen(cfg.source)
            node = await self._node_figure(cfg.source)
        return {"list_length": length, "consumers": consumers, **node}

    async def close(self) -> None:
        # Locks of confirmed batches go; locks of a recovery whose store may
        # not have committed are left to expire: there is no way to know here.
        try:
            await self._release_locks()
        except RedisError as exc:
            log.warning("recovery_locks_not_released", adapter=self.name, error=exc)
        await self._client.aclose()


class ListAcknowledger:
    """LREM of exactly the stored copies, one pipeline per batch, on the
    adapter's own processing lists only (``is_processing_key``): an intent
    naming any other key is never sent, whatever its row says, since LREM
    there would remove another application's item. The consumer's name is
    any (every ingester's list, and a reaped one's, is the adapter's); the
    source list and ``cluster`` are the config's, so intents stored before
    either changed are refused (their lists are no longer read anyway),
    but for a name with a hash tag of its own, whose lists are the same
    either way."""

    def __init__(self, config: AdapterConfig) -> None:
        self._name = config.name
        self._source = config.source
        self._cluster = options(config).cluster
        self._client = connect(config.broker.url(), cluster=self._cluster)

    def _ours(self, claim: AckClaim) -> bool:
        return (
            claim.kind == ACK_KIND
            and claim.key is not None
            and claim.body is not None
            and is_processing_key(claim.key, self._source, cluster=self._cluster)
        )

    async def ack(self, claims: Sequence[AckClaim]) -> Sequence[AckClaim]:
        ours = own_targets(claims, self._ours, adapter=self._name, target=_lrem_target)
        if not ours:
            return []
        pipe = self._client.pipeline(transaction=False)
        for c in ours:
            assert c.key is not None  # _ours
            assert c.body is not None
            marker = removed_marker(c.key, c.inbox_id)
            pipe.eval(GUARDED_LREM, 2, c.key, marker, c.copies, c.body, REMOVED_MARKER_TTL_MS)
        with redis_errors(self._name, f"LREM of {len(ours)} intents", error=AckError):
            await pipe.execute()
        return []

    async def acked(self, claims: Sequence[AckClaim]) -> None:
        """After the acker's commit: the markers have done their job. Only
        our own lists' markers: another key's marker was never written."""
        markers = [removed_marker(c.key, c.inbox_id) for c in claims if self._ours(c) and c.key is not None]
        try:
            if markers:
                await self._client.delete(*markers)
        except RedisError as exc:  # they expire on their own
            log.warning("removed_markers_not_deleted", adapter=self._name, markers=len(markers), error=exc)

    async def close(self) -> None:
        await self._client.aclose()
