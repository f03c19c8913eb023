"""The one place a transport mode is chosen: adapter and acknowledger per config."""

from __future__ import annotations

from ingest.adapter import Acknowledger, PullAdapter
from ingest.config import AdapterConfig
from ingest.errors import ConfigError
from ingest.redis_list import ListAcknowledger, ListAdapter
from ingest.redis_pubsub import NoAcknowledger, PubSubAdapter
from ingest.redis_stream import StreamAcknowledger, StreamAdapter


def make_adapter(config: AdapterConfig) -> PullAdapter:
    if config.mode == "stream":
        return StreamAdapter(config)
    if config.mode == "list":
        return ListAdapter(config)
    if config.mode == "pubsub":
        return PubSubAdapter(config)
    raise ConfigError(f"adapter {config.name!r}: key 'mode' = {config.mode!r} is not implemented")


def make_acknowledger(config: AdapterConfig) -> Acknowledger:
    if config.mode == "stream":
        return StreamAcknowledger(config)
    if config.mode == "list":
        return ListAcknowledger(config)
    if config.mode == "pubsub":
        return NoAcknowledger()
    raise ConfigError(f"adapter {config.name!r}: key 'mode' = {config.mode!r} is not implemented")
