"""A queue broker in this process's memory, and the adapter and acknowledger
the in-memory transport registers.

The broker keeps what a queue with competing consumers keeps: the messages
ready, in order, and each delivery unacknowledged under the consumer it
went to. An ack removes a delivery; an adapter's close puts what it read
and did not store back at the front, counted as delivered once more (as an
SQS adapter's close releases it with a visibility of 0). The
adapter keeps what it returned unstored in a ``Replayed``, as the real
queue adapters do, so a rewind delivers it again from memory.

Brokers are found by their URL (``memory://NAME``): a test makes one with
:func:`new_broker` and names it in its adapter's table.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from backhalf.records import AckClaim, AckTarget
from backhalf.writes.keys import native_key
from ingest.adapters.base import Delivery, PullAdapterBase, Replayed, own_targets
from ingest.config import AdapterConfig

ACK_KIND = "memack"
# How often a read that found nothing looks again, within its block time.
_POLL_S = 0.005


@dataclass
class Message:
    id: str
    body: bytes
    deliveries: int = 0


class MemoryBroker:
    """Queues of messages, by source; unacknowledged deliveries, by tag."""

    def __init__(self) -> None:
        self._ready: dict[str, deque[Message]] = {}
        # tag -> (source, message, consumer)
        self._unacked: dict[str, tuple[str, Message, str]] = {}
        self._ids = itertools.count(1)
        self._tags = itertools.count(1)

    def publish(self, source: str, bodies: Sequence[bytes]) -> list[str]:
        ready = self._ready.setdefault(source, deque())
        sent = [Message(str(next(self._ids)), body) for body in bodies]
        ready.extend(sent)
        return [m.id for m in sent]

    def receive(self, source: str, consumer: str, max_count: int) -> list[tuple[str, Message]]:
        ready = self._ready.setdefault(source, deque())
        taken: list[tuple[str, Message]] = []
        while ready and len(taken) < max_count:
            message = ready.popleft()
            message.deliveries += 1
            tag = f"{consumer}/{next(self._tags)}"
            self._unacked[tag] = (source, message, consumer)
            taken.append((tag, message))
        return taken

    def ack(self, tags: Sequence[str]) -> None:
        for tag in tags:
            self._unacked.pop(tag, None)  # acked already, or released: nothing to do

    def release(self, tags: Sequence[str]) -> None:
        """These deliveries back at the front of their queues, in the order
        they were delivered (those acked meanwhile stay acked)."""
        for tag in reversed(tags):
            if (held := self._unacked.pop(tag, None)) is not None:
                source, message, _consumer = held
                self._ready.setdefault(source, deque()).appendleft(message)

    def counts(self, source: str) -> tuple[int, int]:
        """(ready, unacknowledged) of ``source``."""
        unacked = sum(1 for s, _, _ in self._unacked.values() if s == source)
        return len(self._ready.get(source, ())), unacked


_BROKERS: dict[str, MemoryBroker] = {}


def new_broker() -> tuple[str, MemoryBroker]:
    """A broker of its own, and the URL an adapter's table names it by."""
    name = uuid.uuid4().hex[:12]
    broker = _BROKERS[name] = MemoryBroker()
    return f"memory://{name}", broker


def broker_at(config: AdapterConfig) -> MemoryBroker:
    return _BROKERS[urlsplit(config.broker.url()).netloc]


class MemoryQueueAdapter(PullAdapterBase):
    """A pull adapter over one queue of a :class:`MemoryBroker`."""

    def __init__(self, config: AdapterConfig, *, ledger: object = None) -> None:
        self.name = config.name
        self._cfg = config
        self._broker = broker_at(config)
        # Each adapter a consumer of its own.
        self._consumer = f"{config.consumer}-{uuid.uuid4().hex[:8]}"
        self._batches = Replayed()

    @property
    def ack_target(self) -> AckTarget:
        return AckTarget(ACK_KIND, self._cfg.source, None, by_cursor=True)

    @property
    def identity(self) -> str:
        return f"memory consumer: {self._consumer}"

    @property
    def broker(self) -> str:
        return urlsplit(self._cfg.broker.url()).netloc

    async def start(self) -> None:
        return None

    async def read(self, max_count: int) -> list[Delivery]:
        if again := self._batches.take(max_count):
            return again
        loop = asyncio.get_running_loop()
        until = loop.time() + self._cfg.block_ms / 1000
        while not (taken := self._broker.receive(self._cfg.source, self._consumer, max_count)):
            if loop.time() >= until:
                return []
            await asyncio.sleep(_POLL_S)
        batch = [
            Delivery(
                native_key(self._cfg.key_prefix, self._cfg.source, message.id),
                message.id,
                body=message.body,
                ack_ref=tag,
                deliveries=message.deliveries,
            )
            for tag, message in taken
        ]
        self._batches.returned(batch)
        return batch

    def stored(self) -> None:
        self._batches.stored()

    def rewind(self) -> None:
        self._batches.rewind()

    async def describe(self) -> Mapping[str, object]:
        ready, unacked = self._broker.counts(self._cfg.source)
        return {"ready": ready, "unacked": unacked}

    async def close(self) -> None:
        """What it holds unstored goes back to the queue at once (as an SQS
        adapter's close makes it visible again); what it stored stays
        unacknowledged until the acker acks it."""
        self._broker.release([d.ack_ref for d in self._batches.held() if d.ack_ref is not None])
        self._batches.clear()


class MemoryAcknowledger:
    """Acks committed intents that name the adapter's own queue."""

    def __init__(self, config: AdapterConfig) -> None:
        self._cfg = config
        self._broker = broker_at(config)

    def _ours(self, claim: AckClaim) -> bool:
        return claim.kind == ACK_KIND and claim.key == self._cfg.source and bool(claim.ref)

    async def ack(self, claims: Sequence[AckClaim]) -> list[AckClaim]:
        ours = own_targets(claims, self._ours, adapter=self._cfg.name, target=lambda c: f"{c.kind} {c.key}")
        self._broker.ack([c.ref for c in ours if c.ref is not None])
        return []

    async def acked(self, claims: Sequence[AckClaim]) -> None:
        return None

    async def close(self) -> None:
        return None
