"""The adapter contract (``contract.AdapterContract``) for AMQP, against the
suite's RabbitMQ (``tests/support/amqp.py``). The ingester acks, after its
commit: AMQP acks are bound to the channel that received the delivery."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest

from ingest.adapters.base import PullAdapter
from tests.integration.adapters.contract import AdapterContract
from tests.support.amqp import declare_queue, publish, queue_counts


@pytest.fixture
def broker(amqp_url: str) -> str:
    name = f"contract-{uuid.uuid4().hex[:12]}"
    declare_queue(amqp_url, name)
    return name


@pytest.fixture
def registered() -> tuple[tuple[str, str], ...]:
    return ()  # the pipeline registers its adapter itself


class TestAmqpContract(AdapterContract):
    acked_by_ingester = True
    # What the consuming adapter holds, delivered and not yet read (``ready``
    # is 0 then: the prefetch took them all).
    backlog_figure = ("held_here", 7)

    @pytest.fixture(autouse=True)
    def _server(self, amqp_url: str, broker: str) -> None:
        self.url, self.queue = amqp_url, broker

    def adapter_table(self) -> dict[str, Any]:
        return {"transport": "amqp", "url": self.url, "source": self.queue, "consumer": "c1"}

    async def produce(self, broker: str, messages: list[bytes], adapter: PullAdapter | None) -> None:
        await asyncio.to_thread(publish, self.url, broker, messages)

    async def unacked(self, broker: str) -> int:
        _ready, unacked, _consumers = await asyncio.to_thread(queue_counts, self.url, broker)
        return unacked
