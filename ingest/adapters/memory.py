"""An in-memory pull adapter: the fake for unit tests of the poll loop.

It models what the loop relies on from a broker: delivered-but-unacked
messages stay pending and come back after :meth:`rewind`. It is not proof of
any broker contract: every transport's modes are tested against their real brokers.
"""

from __future__ import annotations

from collections.abc import Mapping

from backhalf.records import AckClaim, AckTarget
from backhalf.writes.keys import native_key
from ingest.adapters.base import Delivery, PullAdapterBase


class MemoryAdapter(PullAdapterBase):
    def __init__(self, name: str, messages: list[bytes] | None = None) -> None:
        self.name = name
        self._queue: list[tuple[str, bytes]] = []
        self.pending: dict[str, bytes] = {}
        self.reads = 0
        self._replay = False
        self._seq = 0
        for body in messages or []:
            self.publish(body)

    def publish(self, body: bytes) -> str:
        self._seq += 1
        message_id = f"{self._seq}-0"
        self._queue.append((message_id, body))
        return message_id

    @property
    def ack_target(self) -> AckTarget:
        return AckTarget("memory", self.name, "memory", by_cursor=True)

    @property
    def identity(self) -> str:
        return "memory"

    @property
    def broker(self) -> str:
        return "memory"

    async def start(self) -> None:
        return None

    async def read(self, max_count: int) -> list[Delivery]:
        self.reads += 1
        if self._replay:
            self._replay = False
            batch = list(self.pending.items())[:max_count]
        else:
            batch, self._queue = self._queue[:max_count], self._queue[max_count:]
            self.pending.update(batch)
        return [
            Delivery(native_key("mem", self.name, mid), mid, body=body, ack_ref=mid) for mid, body in batch
        ]

    def stored(self) -> None:
        return None

    def rewind(self) -> None:
        self._replay = True

    async def describe(self) -> Mapping[str, object]:
        return {"queued": len(self._queue), "pending": len(self.pending)}

    async def close(self) -> None:
        return None

    def ack(self, claims: list[AckClaim]) -> None:
        for c in claims:
            if c.ref is not None:
                self.pending.pop(c.ref, None)
