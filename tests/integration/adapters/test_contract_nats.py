"""The adapter contract (``contract.AdapterContract``) for NATS JetStream,
against a real nats-server (``tests/support/nats.py``)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from ingest.adapters.base import PullAdapter
from tests.integration.adapters.contract import SOURCE, AdapterContract
from tests.support.nats import Streams, streams

GROUP = "switchboard"
# A JetStream stream name may not hold '.', so the contract's source is a
# stream named as it is, bound to the subjects under it.
SUBJECT = f"{SOURCE}.new"


@pytest.fixture
async def broker(nats_url: str) -> AsyncIterator[Streams]:
    async with streams(nats_url) as s:
        await s.reset()
        await s.create(SOURCE)
        yield s


@pytest.fixture
def registered() -> tuple[tuple[str, str], ...]:
    return ()  # the pipeline registers its adapter itself


class TestJetStreamContract(AdapterContract):
    backlog_figure = ("num_pending", 7)

    @pytest.fixture(autouse=True)
    def _server(self, nats_url: str) -> None:
        self.url = nats_url

    def adapter_table(self) -> dict[str, Any]:
        # The server redelivers what a consumer left unacked after ack_wait:
        # short here, so a dead consumer's messages come back within the test.
        return {
            "transport": "nats",
            "mode": "jetstream",
            "url": self.url,
            "group": GROUP,
            "consumer": "c1",
            "ack_wait_ms": 2000,
        }

    async def produce(self, broker: Streams, messages: list[bytes], adapter: PullAdapter | None) -> None:
        for body in messages:
            await broker.publish(SUBJECT, body)

    async def unacked(self, broker: Streams) -> int:
        return await broker.unacked(SOURCE, GROUP)
