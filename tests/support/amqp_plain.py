"""Publishing as producers other than aio-pika do: pika, RabbitMQ's own
Python client, sends no ``message_id`` unless asked (aio-pika's aiormq stamps
a random one on every publish, so it cannot show that case), and sends a
``bytes`` property as it is, UTF-8 or not (as any producer may)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pika

TIMEOUT_S = 10.0


def publish_plain(
    url: str, queue: str, messages: Sequence[tuple[bytes | str | None, bytes]], **properties: Any
) -> None:
    """Publish (message_id, body) pairs in order to ``queue`` (the default
    exchange), persistent, confirmed by the broker; ``properties``: more of
    them, on every message (headers, timestamp...)."""
    params = pika.URLParameters(url)
    params.socket_timeout = TIMEOUT_S
    params.blocked_connection_timeout = TIMEOUT_S
    params.connection_attempts = 1
    connection = pika.BlockingConnection(params)
    try:
        channel = connection.channel()
        channel.confirm_delivery()
        for message_id, body in messages:
            channel.basic_publish(
                exchange="",
                routing_key=queue,
                body=body,
                properties=pika.BasicProperties(
                    delivery_mode=pika.DeliveryMode.Persistent, message_id=message_id, **properties
                ),
                mandatory=True,
            )
    finally:
        connection.close()


def publish_without_ids(url: str, queue: str, bodies: Sequence[bytes]) -> None:
    """Publish ``bodies`` in order to ``queue`` with no ``message_id``."""
    publish_plain(url, queue, [(None, body) for body in bodies])
