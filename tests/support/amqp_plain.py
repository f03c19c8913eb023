"""Publishing as the many AMQP producers that set no ``message_id`` do:
pika, RabbitMQ's own Python client, sends none unless asked (aio-pika's
aiormq stamps a random one on every publish, so it cannot show that case)."""

from __future__ import annotations

from collections.abc import Sequence

import pika

TIMEOUT_S = 10.0


def publish_without_ids(url: str, queue: str, bodies: Sequence[bytes]) -> None:
    """Publish ``bodies`` in order to ``queue`` (the default exchange),
    persistent, confirmed by the broker, with no ``message_id``."""
    params = pika.URLParameters(url)
    params.socket_timeout = TIMEOUT_S
    params.blocked_connection_timeout = TIMEOUT_S
    params.connection_attempts = 1
    connection = pika.BlockingConnection(params)
    try:
        channel = connection.channel()
        channel.confirm_delivery()
        for body in bodies:
            channel.basic_publish(
                exchange="",
                routing_key=queue,
                body=body,
                properties=pika.BasicProperties(delivery_mode=pika.DeliveryMode.Persistent),
                mandatory=True,
            )
    finally:
        connection.close()
