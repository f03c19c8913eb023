"""Adapter-test fixtures: a Redis client on the test's Redis; the NATS server
of the NATS modules, the SQS endpoint of the SQS modules and the RabbitMQ of
the AMQP modules (each one per test session, that is per xdist worker,
started on first use); a RabbitMQ of the test's own, to kill and restart."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from ingest.embedded.rabbitmq_server import RabbitMqServer
from tests.support.amqp import owned_rabbitmq, shared_amqp
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


@pytest.fixture(scope="session")
def amqp_url() -> Iterator[str]:
    """The session's RabbitMQ (``amqp://switchboard:...@host:port/``, every
    permission on vhost ``/``); the tests are skipped, and counted in the
    summary, when there is none (tests.support.amqp)."""
    with shared_amqp() as url:
        yield url


@pytest.fixture
def amqp_server() -> Iterator[RabbitMqServer]:
    """A RabbitMQ this test owns, so it may kill and restart it (about 6 s
    to start); skipped, and counted, without the broker's binaries."""
    with owned_rabbitmq() as server:
        yield server
