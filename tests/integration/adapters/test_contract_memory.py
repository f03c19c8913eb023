"""The adapter contract (``contract.AdapterContract``) run by the in-memory
fake (tests/support/memory_transport): a transport registered at run time,
outside ingest/adapters/, driven through the same factory, ingester and
acker as every real broker. It proves the contract can be met by a
transport added the documented way, and keeps the fake honest; it proves
nothing of any real broker."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from ingest.adapters.base import PullAdapter
from ingest.config import transports
from tests.integration.adapters.contract import SOURCE, AdapterContract
from tests.support.memory_transport.broker import MemoryBroker, new_broker


@pytest.fixture(scope="module", autouse=True)
def _memory_registered() -> Iterator[None]:
    transports.add("memory", "tests.support.memory_transport")
    yield
    transports.remove("memory")


@pytest.fixture
def broker() -> tuple[str, MemoryBroker]:
    return new_broker()


@pytest.fixture
def registered() -> tuple[tuple[str, str], ...]:
    return ()  # the pipeline registers its adapter itself


class TestMemoryContract(AdapterContract):
    backlog_figure = ("ready", 7)

    @pytest.fixture(autouse=True)
    def _url(self, broker: tuple[str, MemoryBroker]) -> None:
        self.url = broker[0]

    def adapter_table(self) -> dict[str, Any]:
        return {"transport": "memory", "mode": "queue", "url": self.url}

    async def produce(
        self, broker: tuple[str, MemoryBroker], messages: list[bytes], adapter: PullAdapter | None
    ) -> None:
        broker[1].publish(SOURCE, messages)

    async def unacked(self, broker: tuple[str, MemoryBroker]) -> int:
        return broker[1].counts(SOURCE)[1]
