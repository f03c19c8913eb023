"""The adapter contract (``contract.AdapterContract``) for every Redis mode."""

from __future__ import annotations

from typing import Any

import pytest
import redis

from ingest.adapters.base import PullAdapter
from ingest.adapters.redis.lists import processing_key
from tests.integration.adapters.contract import NAME, SOURCE, AdapterContract
from tests.support.in_process import wait_until

GROUP = "switchboard"


@pytest.fixture
def broker(r: redis.Redis) -> redis.Redis:
    return r  # the contract's hooks are handed this module's broker client


@pytest.fixture
def registered() -> tuple[tuple[str, str], ...]:
    return ()  # the pipeline registers its adapter itself


class TestStreamContract(AdapterContract):
    backlog_figure = ("stream_length", 7)

    def adapter_table(self) -> dict[str, Any]:
        return {"mode": "stream", "group": GROUP, "consumer": "c1"}

    async def produce(self, broker: redis.Redis, messages: list[bytes], adapter: PullAdapter | None) -> None:
        for body in messages:
            broker.xadd(SOURCE, {"body": body})

    async def unacked(self, broker: redis.Redis) -> int:
        try:
            return int(broker.xpending(SOURCE, GROUP)["pending"])
        except redis.ResponseError:  # no group yet: nothing delivered
            return 0


class TestListContract(AdapterContract):
    native_ids = False
    backlog_figure = ("list_length", 7)

    def adapter_table(self) -> dict[str, Any]:
        return {"mode": "list", "consumer": "c1"}

    async def produce(self, broker: redis.Redis, messages: list[bytes], adapter: PullAdapter | None) -> None:
        for body in messages:
            broker.lpush(SOURCE, body)  # LPUSH producers get FIFO order

    async def unacked(self, broker: redis.Redis) -> int:
        return int(broker.llen(processing_key(SOURCE, "c1")))


class TestPubSubContract(AdapterContract):
    redelivers = False
    fans_out = True
    acks = False
    native_ids = False
    backlog_figure = ("subscribers", 1)  # pub/sub keeps no backlog: its listener is the figure

    def adapter_table(self) -> dict[str, Any]:
        return {"mode": "pubsub", "delivery": "at-most-once"}

    async def wait_listening(self, broker: redis.Redis) -> None:
        await wait_until(lambda: broker.pubsub_numsub(SOURCE)[0][1] >= 1)

    async def produce(self, broker: redis.Redis, messages: list[bytes], adapter: PullAdapter | None) -> None:
        if adapter is not None:
            await adapter.read(1)  # subscribes; nothing published yet
            await self.wait_listening(broker)
        for body in messages:
            broker.publish(SOURCE, body)

    async def unacked(self, broker: redis.Redis) -> int:
        return 0  # pub/sub keeps nothing


assert NAME  # the adapter under test is named contract.NAME in every mode
