"""Adapter-test fixtures: a Redis client on the test's Redis; the NATS server
of the NATS modules (one per test session, started on first use)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from tests.support.nats import shared_nats


@pytest.fixture
def r(redis_url: str) -> redis.Redis:
    return redis.Redis.from_url(redis_url, socket_timeout=10)


@pytest.fixture(scope="session")
def nats_url() -> Iterator[str]:
    with shared_nats() as url:
        yield url
