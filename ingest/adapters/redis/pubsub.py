"""Redis pub/sub: loss-tolerant only.

Key layout: the channel ``{source}``, nothing else. Pub/sub keeps no copy of a
message: whatever is published while no ingester is subscribed is gone, and
there is nothing to acknowledge (``ack_kind = 'none'``). The config refuses
this mode unless the adapter says ``delivery = "at-most-once"``.

The idempotency key is ``{key_prefix}:{source}:{sha256(body)}``, so a message
published twice while its todo is still active yields one todo.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import redis.asyncio as aioredis

from backhalf.records import NO_ACK, AckClaim, AckTarget
from backhalf.writes.keys import body_key
from ingest.adapters.base import ConsumerLedger, Delivery, PullAdapterBase, Replayed
from ingest.adapters.redis.common import RedisEndpoint, redis_errors
from ingest.adapters.redis.settings import options
from ingest.config import AdapterConfig


class PubSubAdapter(RedisEndpoint, PullAdapterBase):
    """A :class:`ingest.adapters.base.PullAdapter` over one channel."""

    def __init__(self, config: AdapterConfig, *, ledger: ConsumerLedger | None = None) -> None:
        # ``ledger`` is unused: a channel has no consumer group to record.
        super().__init__(
            config.name, config.broker.url(), block_ms=config.block_ms, cluster=options(config).cluster
        )
        self._cfg = config
        self._pubsub: Any = None
        # The broker cannot redeliver: unstored batches are retried from
        # memory. A crash loses them, which is what at-most-once means.
        self._batches = Replayed()

    @property
    def ack_target(self) -> AckTarget:
        return AckTarget(NO_ACK)

    async def start(self) -> None:
        with redis_errors(self.name, f"SUBSCRIBE {self._cfg.source}"):
            await self._learn_identity()
            self._pubsub = self._client.pubsub(ignore_subscribe_messages=True)
            await self._pubsub.subscribe(self._cfg.source)

    async def read(self, max_count: int) -> list[Delivery]:
        if again := self._batches.take(max_count):
            return again
        with redis_errors(self.name, f"reading channel {self._cfg.source}"):
            if self._pubsub is None:
                await self.start()
            bodies: list[bytes] = []
            # Wait up to block_ms for the first message, then take what is buffered.
            message = await self._pubsub.get_message(timeout=self._cfg.block_ms / 1000)
            while message is not None:
                if message.get("type") == "message":
                    bodies.append(message["data"])
                if len(bodies) >= max_count:
                    break
                message = await self._pubsub.get_message(timeout=0)
        batch = [Delivery(body_key(self._cfg.key_prefix, self._cfg.source, b), None, body=b) for b in bodies]
        self._batches.returned(batch)
        return batch

    def stored(self) -> None:
        self._batches.stored()

    def rewind(self) -> None:
        self._batches.rewind()

    async def describe(self) -> Mapping[str, object]:
        with redis_errors(self.name, f"PUBSUB NUMSUB {self._cfg.source}"):
            node = await self._node_figure(self._cfg.source)
            if node:
                # A cluster's subscribers sit on whichever node they chose:
                # each node counts its own.
                counted: Any = await self._client.pubsub_numsub(
                    self._cfg.source, target_nodes=aioredis.RedisCluster.ALL_NODES
                )
                # redis-py sums the nodes' answers into one list of pairs
                # (a mapping by node in some versions).
                pairs = [p for ps in counted.values() for p in ps] if isinstance(counted, dict) else counted
            else:
                pairs = await self._client.pubsub_numsub(self._cfg.source)
        return {"subscribers": sum(int(n) for _, n in pairs), **node}

    async def close(self) -> None:
        if self._pubsub is not None:
            await self._pubsub.aclose()
        await self._client.aclose()


class NoAcknowledger:
    """Pub/sub has nothing to acknowledge; its inbox rows never wait for an ack."""

    def __init__(self, config: AdapterConfig) -> None:
        self._name = config.name

    async def ack(self, claims: Sequence[AckClaim]) -> Sequence[AckClaim]:
        return []

    async def acked(self, claims: object) -> None:
        return None

    async def close(self) -> None:
        return None
