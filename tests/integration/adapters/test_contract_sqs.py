"""The adapter contract (``contract.AdapterContract``) for SQS, against the
suite's SQS-compatible server (``tests/support/sqs.py``: moto, with its FIFO
fix). The queue is FIFO with one message group, so "in order" is SQS's own
promise, not the emulator's habit: a standard queue's order is best effort."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass
from typing import Any

import pytest

from ingest.adapters.base import PullAdapter
from tests.integration.adapters.contract import AdapterContract
from tests.support.sqs import REGION, client, counts, create_queue, send, use_emulator_credentials

GROUP = "contract"


@dataclass(frozen=True)
class Queue:
    sqs: Any  # boto3's client, untyped
    name: str
    url: str


@pytest.fixture
def broker(sqs_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> Queue:
    use_emulator_credentials(monkeypatch)
    sqs = client(sqs_endpoint)
    name = f"contract-{uuid.uuid4().hex[:12]}.fifo"
    # A visibility timeout far above any test's length: what the contract
    # sees in flight stays so until deleted, or released at a close.
    return Queue(sqs, name, create_queue(sqs, name, fifo=True, visibility_timeout_s=300))


@pytest.fixture
def registered() -> tuple[tuple[str, str], ...]:
    return ()  # the pipeline registers its adapter itself


class TestSqsContract(AdapterContract):
    backlog_figure = ("visible", 7)

    @pytest.fixture(autouse=True)
    def _server(self, sqs_endpoint: str, broker: Queue) -> None:
        self.endpoint, self.queue = sqs_endpoint, broker.name

    def adapter_table(self) -> dict[str, Any]:
        return {
            "transport": "sqs",
            "mode": "queue",
            "url": self.endpoint,
            "region": REGION,
            "source": self.queue,
            "consumer": "c1",
            "ack_wait_ms": 300_000,
        }

    async def produce(self, broker: Queue, messages: list[bytes], adapter: PullAdapter | None) -> None:
        await asyncio.to_thread(send, broker.sqs, broker.url, messages, group=GROUP)

    async def unacked(self, broker: Queue) -> int:
        _visible, in_flight, _delayed = await asyncio.to_thread(counts, broker.sqs, broker.url)
        return in_flight
