"""Adapter-test fixtures: a Redis client on the test's Redis."""

from __future__ import annotations

import pytest
import redis


@pytest.fixture
def r(redis_url: str) -> redis.Redis:
    return redis.Redis.from_url(redis_url, socket_timeout=10)
