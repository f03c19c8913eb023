"""Adapter-test fixtures: a Redis client on the test's Redis; the NATS server
of the NATS modules and the SQS endpoint of the SQS modules (each one per
test session, that is per xdist worker, started on first use)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from tests.support.nats import shared_nats
from tests.support.sqs import shared_sqs


@pytest.fixture
def r(redis_url: str) -> redis.Redis:
    return redis.Redis.from_url(redis_url, socket_timeout=10)


@pytest.fixture(scope="session")
def nats_url() -> Iterator[str]:
    with shared_nats() as url:
        yield url


@pytest.fixture(scope="session")
def sqs_endpoint() -> Iterator[str]:
    """The endpoint URL (``http://127.0.0.1:PORT``); clients sign with the
    emulator's dummy credentials (tests.support.sqs)."""
    with shared_sqs() as endpoint:
        yield endpoint
