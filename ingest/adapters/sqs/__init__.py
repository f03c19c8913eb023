"""The SQS transport.

A transport is this folder: ``settings`` is what the config reads of it
(its modes, URL, rules and variables; no client imported), ``modes`` what
the adapter factory loads when an adapter uses it (its adapters and
acknowledgers, on its client; aiobotocore is the ``sqs`` install extra).
The one table that registers it is :mod:`ingest.config.transports`.
"""
