"""Redis pub/sub: loss-tolerant only.

Key layout: the channel ``{source}``, nothing else. Pub/sub keeps no copy of a
message: whatever is published while no ingester is subscribed is gone, and
there is nothing to acknowledge (``ack_kind = 'none'``). The config refuses
this mode unless the adapter says ``delivery = "at-most-once"``.

The idempotency key is ``{key_prefix}:{source}:{sha256(body)}``, so a message
published twice while its todo is still active yields one todo.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Mapping
from typing import Any

from redis.exceptions import RedisError

from backhalf.keys import body_key
from backhalf.records import AckTarget
from ingest.adapters.base import Delivery, OpenLedger
from ingest.adapters.redis.common import RedisEndpoint
from ingest.config import AdapterConfig
from ingest.errors import BrokerError


class PubSubAdapter(RedisEndpoint):
    """A :class:`ingest.adapters.base.PullAdapter` over one channel."""

    overlapping_commits = False

    def __init__(self, config: AdapterConfig) -> None:
        super().__init__(config.name, config.redis_url, block_ms=config.block_ms)
        self._cfg = config
        self._pubsub: Any = None
        self._unconfirmed: deque[list[Delivery]] = deque()
        self._replay: list[Delivery] = []

    @property
    def ack_target(self) -> AckTarget:
        return AckTarget("none")

    async def start(self) -> None:
        try:
            await self._learn_identity()
            self._pubsub = self._client.pubsub(ignore_subscribe_messages=True)
            await self._pubsub.subscribe(self._cfg.source)
        except RedisError as exc:
            raise BrokerError(f"adapter {self.name}: SUBSCRIBE {self._cfg.source}: {exc}") from exc

    async def run_background(self, stop: asyncio.Event) -> None:
        """Nothing runs in the background for pub/sub."""

    async def recover(self, open_ledger: OpenLedger) -> list[Delivery]:
        """No broker-side record exists to recover from."""
        return []

    async def read(self, max_count: int) -> list[Delivery]:
        if self._replay:
            batch, self._replay = self._replay, []
            self._unconfirmed.append(batch)
            return batch
        try:
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
        except RedisError as exc:
            raise BrokerError(f"adapter {self.name}: reading channel {self._cfg.source}: {exc}") from exc
        batch = [Delivery(body_key(self._cfg.key_prefix, self._cfg.source, b), None, body=b) for b in bodies]
        if batch:
            self._unconfirmed.append(batch)
        return batch

    def stored(self) -> None:
        if self._unconfirmed:
            self._unconfirmed.popleft()

    def rewind(self) -> None:
        # The broker cannot redeliver: retry the unstored batches from memory.
        # A crash loses them, which is what at-most-once means.
        self._replay = [d for batch in self._unconfirmed for d in batch] + self._replay
        self._unconfirmed.clear()

    async def describe(self) -> Mapping[str, object]:
        try:
            numsub = await self._client.pubsub_numsub(self._cfg.source)
        except RedisError as exc:
            raise BrokerError(f"adapter {self.name}: PUBSUB NUMSUB {self._cfg.source}: {exc}") from exc
        return {"subscribers": int(numsub[0][1]) if numsub else 0}

    async def close(self) -> None:
        if self._pubsub is not None:
            await self._pubsub.aclose()
        await self._client.aclose()


class NoAcknowledger:
    """Pub/sub has nothing to acknowledge; its inbox rows never wait for an ack."""

    def __init__(self, config: AdapterConfig) -> None:
        self._name = config.name

    async def ack(self, claims: object) -> None:
        return None

    async def acked(self, claims: object) -> None:
        return None

    async def close(self) -> None:
        return None
