"""Redis streams with a consumer group: the recommended, durable mode.

Key layout (the broker side of DESIGN.md section 6)::

    {source}                      the stream (XADD by producers); group created with MKSTREAM
    {source} group {group}        the consumer group, created at ``start_id`` (default 0,
                                  so a backlog written before the first start is consumed),
                                  ``$`` resolved to an entry id; that start is recorded in
                                  PostgreSQL (``stream_groups``) before the group is created,
                                  and a group destroyed later is recreated at it
    PEL of {consumer}             entries delivered to this consumer and not yet XACKed:
                                  they stay there until the acker has seen the todo committed

Reading order on each call: first this consumer's own PEL (``XREADGROUP ... 0``,
walked with a cursor) after a start or a rewind, then every ``claim_interval_ms``
a claim sweep (XPENDING, XRANGE, XCLAIM) of entries idle longer than ``claim_idle_ms`` (a dead
consumer's, or our own stuck ones), then new entries (``>``, blocking up to
``block_ms``). Everything redelivered flows through the same idempotent store.

Idempotency key: ``{key_prefix}:{source}:{entry-id}``. Ack: XACK, one call
per batch, of intents naming this adapter's stream and group only.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping, Sequence
from typing import Any

import structlog
from redis.exceptions import ResponseError

from backhalf.records import AckClaim, AckTarget
from backhalf.tracing import TRACEPARENT, TRACESTATE
from backhalf.writes.keys import native_key
from backhalf.writes.normalize import MAX_FIELDS, FieldMap, RefusedFieldMap
from backhalf.writes.stream_groups import StreamGroup
from ingest.adapters.base import (
    ConsumerLedger,
    Delivery,
    PullAdapterBase,
    Unconfirmed,
    own_targets,
    trace_of,
)
from ingest.adapters.redis.common import (
    RedisEndpoint,
    RedisErrorKind,
    as_text,
    connect,
    is_no_such_key,
    redis_errors,
    tolerating,
)
from ingest.adapters.redis.settings import options
from ingest.config import AdapterConfig
from ingest.errors import AckError, GroupMissing

# This mode's ack kind, registered in ingest.adapters.redis.MODES.
ACK_KIND = "xack"
# An entry's W3C trace context, in fields of their own beside its body.
TRACEPARENT_FIELD = TRACEPARENT.encode()
TRACESTATE_FIELD = TRACESTATE.encode()

log = structlog.get_logger(__name__)


# An entry as XREADGROUP's raw reply carries it: id and flat field list
# (``[field, value, ...]``), or no list for an entry deleted while pending.
Entry = tuple[bytes, Sequence[bytes] | None]


def _raw_reply(response: Any, **_options: Any) -> Any:
    """XREADGROUP's reply as Redis sent it. redis-py's own callback builds a
    dict per entry, a tenth of the ingester's Python time (py-spy, issue 5);
    the common entry, one body field, needs none (``_delivery_flat``)."""
    return response


def _entries(resp: Any) -> list[Entry]:
    """XREADGROUP's raw reply for our one stream: ``{stream: entries}`` in
    RESP3 (redis-py's default protocol since 8), ``[[stream, entries]]`` in RESP2."""
    if not resp:
        return []
    if isinstance(resp, dict):
        (entries,) = resp.values()
        return list(entries)
    return list(resp[0][1])


# A stream entry id as Redis gives it: milliseconds and sequence, each a
# 64-bit unsigned number.
_ENTRY_ID = re.compile(r"([0-9]{1,20})-([0-9]{1,20})")
_U64_MAX = 2**64 - 1


def is_entry_id(ref: str) -> bool:
    """Whether ``ref`` is a complete stream entry id (``<ms>-<seq>``), the
    only form an intent of this mode holds: anything else XACK would refuse
    for the whole call."""
    match = _ENTRY_ID.fullmatch(ref)
    return match is not None and all(int(part) <= _U64_MAX for part in match.groups())


def _xack_target(claim: AckClaim) -> str:
    """An intent's target for the log: its stream, group and entry id."""
    return f"{claim.kind} {claim.key} {claim.group} {claim.ref}"


# The start of a stream that does not exist yet: MKSTREAM creates it empty,
# and every entry it will ever hold lies after this id.
EMPTY_STREAM_START = "0-0"


class _Unrecorded:
    """:class:`ConsumerLedger` that keeps nothing: an adapter built without a
    ledger (``status``, which never creates a group; adapter tests) creates
    groups at ``start_id`` and recreates them there."""

    async def recorded(self, group: StreamGroup, *, adapter: str) -> str | None:
        return None

    async def record(self, group: StreamGroup, start_id: str, *, adapter: str) -> str:
        return start_id

    async def stored_before(self, adapter: str) -> bool:
        return False

    async def acks_owed(self, adapter: str, keys: Sequence[str]) -> set[str]:
        return set()

    async def settle_acks(self, adapter: str, consumer: str, session: str) -> int:
        return 0


def _field_map(flat: Sequence[bytes] | None) -> dict[bytes, bytes] | None:
    if flat is None:
        return None
    it = iter(flat)
    return dict(zip(it, it, strict=True))


def _last_value(flat: Sequence[bytes], field: bytes) -> bytes | None:
    """The value of ``field``'s last occurrence in a flat field list (the one
    a map of it keeps), found without building the map."""
    names = flat[0::2]
    try:
        at = len(names) - 1 - names[::-1].index(field)
    except ValueError:
        return None
    return flat[2 * at + 1]


class StreamAdapter(RedisEndpoint, PullAdapterBase):
    """A :class:`ingest.adapters.base.PullAdapter` over one stream and consumer group."""

    overlapping_commits = True

    def __init__(self, config: AdapterConfig, *, ledger: ConsumerLedger | None = None) -> None:
        self._opts = options(config)
        super().__init__(
            config.name, config.broker.url(), block_ms=config.block_ms, cluster=self._opts.cluster
        )
        self._cfg = config
        self._ledger: ConsumerLedger = ledger or _Unrecorded()
        self._body_field = self._opts.body_field.encode()
        # Both replies as Redis sent them: an entry's field list is counted
        # before any of it is made a map (_delivery_flat).
        self._client.set_response_callback("XREADGROUP", _raw_reply)
        self._client.set_response_callback("XCLAIM", _raw_reply)
        self._started = False
        self._history_cursor: str | None = "0"  # None: own PEL fully re-read
        self._claim_cursor = "-"
        self._next_claim_at = 0.0
        self._group_lost = False  # NOGROUP seen: the next start recreates the group
        # An entry deleted in the instant between XRANGE and XCLAIM leaves the
        # PEL as XCLAIM drops it, so that report exists only in memory until a
        # store commits it: kept per unconfirmed batch, replayed on rewind.
        self._reported_lost: list[Delivery] = []
        self._unconfirmed_lost: Unconfirmed[list[Delivery]] = Unconfirmed()
        self._lost_to_replay: list[Delivery] = []

    @property
    def ack_target(self) -> AckTarget:
        return AckTarget(ACK_KIND, self._cfg.source, self._opts.group, by_cursor=True)

    async def start(self) -> None:
        await self._ensure_group()
        with redis_errors(self.name, "ACL WHOAMI failed"):
            await self._learn_identity()
        self._started = True

    @property
    def _group(self) -> StreamGroup:
        return StreamGroup(self.broker, self._cfg.source, self._opts.group)

    async def _ensure_group(self) -> None:
        """Make sure the group exists, created where it first started.

        The start is recorded *before* the group is created: a crash in
        between leaves a record and no group, and the next start creates the
        group at the record; the other order could leave a group Switchboard
        created with nothing on record. A group on record is (re)created at
        its record, whatever ``start_id`` says now: after an XGROUP DESTROY
        that re-reads what was stored since (the inbox dedups it) and nothing
        from before the first start.
        """
        cfg = self._cfg
        bound = log.bind(adapter=self.name, stream=cfg.source, group=self._opts.group, broker=self.broker)
        start_id = await self._ledger.recorded(self._group, adapter=self.name)
        if start_id is None:
            # A group that exists with nothing on record (someone else's, or
            # one made before the stream_groups table), or one that existed
            # before (lost under us, or entries of ours stored already): where
            # it started is unknown. Recorded, and so recreated, at the
            # stream's start: what the inbox holds dedups, and nothing written
            # since (or pending unstored in a lost PEL) is lost. Its
            # last-delivered id or a configured "$" could lose both.
            exists = await self._group_exists()
            unknown = exists or self._group_lost or await self._ledger.stored_before(self.name)
            if unknown:
                bound.warning(
                    "group_start_not_recorded",
                    start_id=EMPTY_STREAM_START,
                    detail="the group was not created by this Switchboard, or before its start was"
                    " recorded: it is recorded at 0, so a recreation loses nothing (stored entries"
                    " are deduplicated)",
                )
            start = EMPTY_STREAM_START if unknown else await self._resolved_start()
            start_id = await self._ledger.record(self._group, start, adapter=self.name)
            bound.info("group_start_recorded", start_id=start_id)
            if exists:
                self._group_lost = False
                return
        # BUSYGROUP: the group exists already, which is all we wanted.
        with tolerating(
            RedisErrorKind.BUSYGROUP, self.name, f"XGROUP CREATE {cfg.source} {self._opts.group}"
        ):
            await self._client.xgroup_create(cfg.source, self._opts.group, id=start_id, mkstream=True)
            bound.info("group_created", start_id=start_id, recreated=self._group_lost)
        self._group_lost = False

    async def _resolved_start(self) -> str:
        """``start_id`` as an entry id: ``$`` is the stream's last generated
        id now (``EMPTY_STREAM_START`` for a stream not created yet).

        Resolved first and the group then created at that explicit id, so
        the race can only let in an entry added in between (it lies after
        the id), never lose one. Creating at ``$`` and reading the group's
        last-delivered-id afterwards would race the other way: another
        consumer's read in between moves that id past entries it holds, not
        yet stored, and a group recreated there would skip them.
        """
        cfg = self._cfg
        if self._opts.start_id != "$":
            return self._opts.start_id
        with redis_errors(self.name, f"XINFO STREAM {cfg.source}"):
            try:
                info = await self._client.xinfo_stream(cfg.source)
            except ResponseError as exc:
                if not is_no_such_key(exc):
                    raise
                return EMPTY_STREAM_START
        return as_text(info["last-generated-id"])

    async def _groups(self) -> list[Any]:
        """XINFO GROUPS of the stream; [] while it does not exist (a state,
        not a broker failure: the ingester creates it)."""
        try:
            return list(await self._client.xinfo_groups(self._cfg.source))
        except ResponseError as exc:
            if not is_no_such_key(exc):
                raise
            return []

    async def _group_exists(self) -> bool:
        cfg = self._cfg
        with redis_errors(self.name, f"XINFO GROUPS {cfg.source}"):
            groups = await self._groups()
        return any(as_text(g["name"]) == self._opts.group for g in groups)

    async def read(self, max_count: int) -> list[Delivery]:
        if self._lost_to_replay:
            batch, self._lost_to_replay = self._lost_to_replay, []
            self._unconfirmed_lost.returned(batch)
            return batch
        try:
            with redis_errors(self.name, f"reading {self._cfg.source}", nogroup=GroupMissing):
                batch = await self._read(max_count)
        except GroupMissing:
            # Stream or group deleted under us: recreate it on the next
            # read (at its recorded start), rather than loop on the error.
            # No rewind here: the poll loop rewinds once the commits under
            # way have ended.
            self._started = False
            self._group_lost = True
            raise
        if batch:
            self._unconfirmed_lost.returned(self._reported_lost)
        self._reported_lost = []
        return batch

    async def _read(self, max_count: int) -> list[Delivery]:
        if not self._started:
            await self.start()
        if self._history_cursor is not None:
            history = await self._read_history(max_count)
            if history:
                return history
        if time.monotonic() >= self._next_claim_at:
            claimed = await self._claim(max_count)
            if claimed:
                return claimed
        return await self._read_new(max_count)

    async def _read_history(self, count: int) -> list[Delivery]:
        cfg = self._cfg
        assert self._history_cursor is not None
        resp = await self._client.xreadgroup(
            self._opts.group, cfg.consumer, {cfg.source: self._history_cursor}, count=count
        )
        entries = _entries(resp)
        if not entries:
            self._history_cursor = None
            return []
        self._history_cursor = as_text(entries[-1][0])
        # Re-reading history counts as a delivery in Redis: ask how many so far.
        counts: list[Any] = await self._client.xpending_range(
            cfg.source,
            self._opts.group,
            min=as_text(entries[0][0]),
            max=as_text(entries[-1][0]),
            count=len(entries),
            consumername=cfg.consumer,
        )
        delivered = {as_text(p["message_id"]): int(p["times_delivered"]) for p in counts}
        return [
            self._delivery_flat(entry_id, flat, delivered.get(as_text(entry_id), 1))
            for entry_id, flat in entries
        ]

    async def _idle_entries(self, count: int) -> list[Any]:
        """The next ``count`` PEL entries idle past ``claim_idle_ms``, from
        the sweep's cursor; a sweep that reaches the end rests until the next
        interval."""
        idle: list[Any] = await self._client.xpending_range(
            self._cfg.source,
            self._opts.group,
            min=self._claim_cursor,
            max="+",
            count=count,
            idle=self._opts.claim_idle_ms,
        )
        if len(idle) < count:
            self._claim_cursor = "-"
            self._next_claim_at = time.monotonic() + self._opts.claim_interval_ms / 1000
        else:
            self._claim_cursor = "(" + as_text(idle[-1]["message_id"])
        return idle

    async def _claim(self, count: int) -> list[Delivery]:
        """Sweep the group's PEL for entries idle past ``claim_idle_ms``.

        XPENDING lists them, XRANGE tells which were deleted or trimmed, and
        only the live ones are XCLAIMed. A deleted entry is delivered as lost
        while it is still in the PEL, so the report survives any crash; the
        XACK after its commit is what removes it. (XAUTOCLAIM would drop it
        from the PEL at the moment it reports it, leaving the report only in
        this process's memory.)
        """
        cfg = self._cfg
        idle = await self._idle_entries(count)
        if not idle:
            return []
        ids = [as_text(p["message_id"]) for p in idle]
        # Stored, and only their XACK owed (the acker's, soon or once their
        # todo ends with ack_after = "complete"): not delivered again. An
        # entry waiting for a long todo stays idle in the PEL; without this,
        # every sweep would claim and re-store it.
        owed = await self._ledger.acks_owed(
            self.name, [native_key(cfg.key_prefix, cfg.source, i) for i in ids]
        )
        if owed:
            ids = [i for i in ids if native_key(cfg.key_prefix, cfg.source, i) not in owed]
            if not ids:
                return []
        delivered = {as_text(p["message_id"]): int(p["times_delivered"]) + 1 for p in idle}  # XCLAIM adds one
        pipe = self._client.pipeline(transaction=False)
        for entry_id in ids:
            pipe.xrange(cfg.source, entry_id, entry_id, count=1)
        exists = [bool(found) for found in await pipe.execute()]
        live = [i for i, present in zip(ids, exists, strict=True) if present]
        claimed: list[Entry] = []  # XCLAIM's raw reply: (id, flat field list) as XREADGROUP's
        if live:
            reply: Any = await self._client.xclaim(
                cfg.source, self._opts.group, cfg.consumer, self._opts.claim_idle_ms, list(live)
            )
            claimed = [(entry[0], entry[1]) for entry in reply or () if entry is not None]
        got = {as_text(entry_id) for entry_id, _ in claimed}
        deliveries = [
            self._delivery_flat(entry_id, flat, delivered.get(as_text(entry_id), 2))
            for entry_id, flat in claimed
        ]
        # Deleted before we looked: still in the PEL, reported here.
        gone = [i for i, present in zip(ids, exists, strict=True) if not present]
        deliveries += [self._delivery(entry_id, None) for entry_id in gone]
        # Deleted between XRANGE and XCLAIM (which drops such entries from the
        # PEL without a word) or claimed by another consumer meanwhile: only
        # an entry still in the PEL without an owner change is really lost.
        vanished = [i for i in live if i not in got]
        if vanished:
            pipe = self._client.pipeline(transaction=False)
            for entry_id in vanished:
                pipe.xrange(cfg.source, entry_id, entry_id, count=1)
            still_there = [bool(found) for found in await pipe.execute()]
            # Still in the stream: acked or claimed by another meanwhile. Gone:
            # deleted in between, and XCLAIM dropped it from the PEL.
            lost = [
                self._delivery(i, None) for i, there in zip(vanished, still_there, strict=True) if not there
            ]
            self._reported_lost = lost
            deliveries += lost
        if deliveries:
            log.info(
                "entries_claimed",
                adapter=self.name,
                stream=cfg.source,
                claimed=len(claimed),
                deleted=len(deliveries) - len(claimed),
            )
        return deliveries

    async def _read_new(self, count: int) -> list[Delivery]:
        cfg = self._cfg
        resp = await self._client.xreadgroup(
            self._opts.group, cfg.consumer, {cfg.source: ">"}, count=count, block=cfg.block_ms
        )
        return [self._delivery_flat(entry_id, flat) for entry_id, flat in _entries(resp)]

    def _delivery_flat(self, raw_id: bytes, flat: Sequence[bytes] | None, deliveries: int = 1) -> Delivery:
        if flat is not None and len(flat) == 2 and flat[0] == self._body_field:
            entry_id = raw_id.decode()
            key = native_key(self._cfg.key_prefix, self._cfg.source, entry_id)
            return Delivery(key, entry_id, body=flat[1], ack_ref=entry_id, deliveries=deliveries)
        if flat is not None and len(flat) > 2 * MAX_FIELDS:
            return self._delivery_refused(raw_id, flat, deliveries)
        return self._delivery(raw_id, _field_map(flat), deliveries)

    def _delivery_refused(self, raw_id: bytes, flat: Sequence[bytes], deliveries: int) -> Delivery:
        """An entry of more than MAX_FIELDS fields, counted from the reply and
        never made a map: its body field's value if it has one (the other
        fields are ignored, as always), else a field map refused by its count
        (rejected ``too_many_fields``, stored and acked like any rejection)."""
        entry_id = as_text(raw_id)
        key = native_key(self._cfg.key_prefix, self._cfg.source, entry_id)
        body = _last_value(flat, self._body_field)
        content = RefusedFieldMap(flat) if body is None else body
        return Delivery(key, entry_id, body=content, ack_ref=entry_id, deliveries=deliveries)

    def _delivery(
        self, raw_id: bytes | str, fields: Mapping[bytes, bytes] | None, deliveries: int = 1
    ) -> Delivery:
        entry_id = as_text(raw_id)
        key = native_key(self._cfg.key_prefix, self._cfg.source, entry_id)
        if not fields:  # XADD needs a field, so an empty entry was deleted or trimmed
            return Delivery(key, entry_id, ack_ref=entry_id, lost=True)
        body = fields.get(self._body_field)
        # The producer's trace context, in fields of its own (DESIGN.md section 14).
        trace = trace_of(fields.get(TRACEPARENT_FIELD), fields.get(TRACESTATE_FIELD))
        if body is not None:
            return Delivery(key, entry_id, body=body, ack_ref=entry_id, deliveries=deliveries, trace=trace)
        return Delivery(
            key, entry_id, body=FieldMap(fields), ack_ref=entry_id, deliveries=deliveries, trace=trace
        )

    def stored(self) -> None:
        self._unconfirmed_lost.confirmed()

    def rewind(self) -> None:
        self._history_cursor = "0"
        # Sweep again at once: entries claimed or found deleted in an
        # unstored batch are still in the PEL, under their old owner.
        self._claim_cursor = "-"
        self._next_claim_at = 0.0
        unstored = [d for lost in self._unconfirmed_lost.rewound() for d in lost]
        self._lost_to_replay = unstored + self._lost_to_replay

    async def describe(self) -> Mapping[str, object]:
        cfg = self._cfg
        with redis_errors(self.name, f"XINFO GROUPS {cfg.source}"):
            groups = await self._groups()
            length = await self._client.xlen(cfg.source)
            node = await self._node_figure(cfg.source)
        for g in groups:
            if as_text(g["name"]) == self._opts.group:
                return {
                    "stream_length": length,
                    "lag": g.get("lag"),
                    "broker_pending": g.get("pending"),
                    **node,
                }
        return {"stream_length": length, "lag": None, "broker_pending": None, **node}

    async def close(self) -> None:
        await self._client.aclose()


class StreamAcknowledger:
    """XACK for committed intents: one call per batch, on the adapter's own
    stream and group only (``own_targets``).

    An intent naming another stream or group is never XACKed, whatever its
    row says: that could ack another application's pending entry. This
    includes the adapter's own former group after ``group`` is renamed in
    the config: its entries stay in the old group's PEL (XGROUP DESTROY it
    once nothing reads it), and those the new group delivers again are
    deduplicated to their inbox rows, which then name the new group.
    """

    def __init__(self, config: AdapterConfig) -> None:
        self._name = config.name
        self._stream = config.source
        own = options(config)
        self._group = own.group
        self._client = connect(config.broker.url(), cluster=own.cluster)

    def _ours(self, claim: AckClaim) -> bool:
        return (
            claim.kind == ACK_KIND
            and claim.key == self._stream
            and claim.group == self._group
            and claim.ref is not None
            and is_entry_id(claim.ref)
        )

    async def ack(self, claims: Sequence[AckClaim]) -> Sequence[AckClaim]:
        ours = own_targets(claims, self._ours, adapter=self._name, target=_xack_target)
        if not ours:
            return []
        stream, group = self._stream, self._group
        ids = list(dict.fromkeys(c.ref for c in ours if c.ref is not None))
        what = f"XACK {stream} {group} ({len(ids)} ids)"
        with tolerating(RedisErrorKind.NOGROUP, self._name, what, error=AckError) as reply:
            await self._client.xack(stream, group, *ids)
        if reply.tolerated:
            # No group, no PEL: nothing is left to acknowledge. If the group
            # is recreated, the entries are redelivered and re-requested.
            log.warning("ack_group_missing", adapter=self._name, stream=stream, group=group, ids=len(ids))
        return []

    async def acked(self, claims: Sequence[AckClaim]) -> None:
        """Nothing to clean up: XACK is idempotent by itself."""

    async def close(self) -> None:
        await self._client.aclose()
