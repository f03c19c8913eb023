"""The one place a transport and mode are chosen: adapter and acknowledger per config.

Each transport registers its modes once (``ingest.adapters.redis.MODES``);
the poll loop, the acker and ``status`` never branch on either.
"""

from __future__ import annotations

from collections.abc import Mapping

from ingest.adapters import redis
from ingest.adapters.base import Acknowledger, GroupStarts, ModeImplementation, PullAdapter
from ingest.config import AdapterConfig
from ingest.errors import ConfigError

TRANSPORTS: Mapping[str, Mapping[str, ModeImplementation]] = {"redis": redis.MODES}


def _implementation(config: AdapterConfig) -> ModeImplementation:
    if config.credentials_error is not None:
        # Its username_env / password_env unset: said where the broker is
        # needed (ingest, ack, status), not by every verb that loads the config.
        raise ConfigError(config.credentials_error)
    implementation = TRANSPORTS.get(config.transport, {}).get(config.mode)
    if implementation is None:
        raise ConfigError(
            f"adapter {config.name!r}: key 'mode' = {config.mode!r} is not implemented"
            f" for transport {config.transport!r}"
        )
    return implementation


def make_adapter(config: AdapterConfig, *, group_starts: GroupStarts | None) -> PullAdapter:
    """``group_starts``: where a stream adapter records the groups it creates.
    Always said: the ingester passes PostgreSQL's; ``status``, which creates
    no group, None."""
    return _implementation(config).adapter(config, group_starts=group_starts)


def make_acknowledger(config: AdapterConfig) -> Acknowledger:
    return _implementation(config).acknowledger(config)
