"""The Redis transport: streams, reliable lists and pub/sub.

A transport is this folder: ``settings`` is what the config reads of it
(its modes, URL, rules and variables; redis-py only to read a URL's query,
as it will), ``modes`` what
the adapter factory loads when an adapter uses it (its adapters and
acknowledgers, on its client; redis-py is a dependency of Switchboard itself).
The one table that registers it is :mod:`ingest.config.transports`.
"""
