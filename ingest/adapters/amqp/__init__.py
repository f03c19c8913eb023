"""The AMQP 0-9-1 transport (RabbitMQ).

A transport is this folder: ``settings`` is what the config reads of it
(its modes, URL, rules and variables; no client imported), ``modes`` what
the adapter factory loads when an adapter uses it (its adapters and
acknowledgers, on its client; aio-pika is the ``amqp`` install extra).
The one table that registers it is :mod:`ingest.config.transports`.
"""
