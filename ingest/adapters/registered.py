"""Adapters known from the ``adapters`` table rather than a config file.

The ingester registers each adapter with its transport, its mode and its
public settings (``AdapterConfig.public_settings``: the keys that apply to its
mode, never the broker URL). ``ack`` and ``status`` without adapters in their
config rebuild an :class:`AdapterConfig` from such a row, with its transport's
default broker URL (the default transport's: ``Settings.default_broker_url``;
another's: its own variable, else its default)."""

from __future__ import annotations

import os

from backhalf.writes.registry import AdapterRow
from ingest.adapters.base import FAMILY
from ingest.config import AdapterConfig, adapter_keys, read_adapter
from ingest.errors import ConfigError

# Not read from the settings: the row's own columns give name, mode and
# transport; ``schema`` is a path relative to a config file this process does
# not have (nothing here decodes), and the URL is never registered.
_NOT_FROM_SETTINGS = frozenset({"name", "mode", "transport", "url", "schema"})


def adapter_config(row: AdapterRow, default_url: str) -> AdapterConfig:
    """The config of a registered adapter, its broker at ``default_url`` if
    its transport is the default one, read
    by the config's own definitions (ingest.config.read_adapter). Settings
    this version does not know are ignored, and so are those that do not
    apply to the row's mode: rows registered before issue 23 published every
    key in every mode, and a stored row is data, not a config to refuse.
    Ill-typed settings, or a missing ``source``, are a ConfigError naming
    the adapter."""
    if row.family != FAMILY:
        raise ConfigError(f"registered adapter {row.name!r}: family {row.family!r} has no broker")
    keys = adapter_keys(row.mode, row.transport) - _NOT_FROM_SETTINGS
    table = {k: v for k, v in row.settings.items() if k in keys}
    table |= {"name": row.name, "mode": row.mode, "transport": row.transport}
    try:
        # The environment gives another transport's adapter its default server.
        return read_adapter(table, default_url, os.environ)
    except ConfigError as exc:
        detail = str(exc).removeprefix(f"adapter {row.name!r}: ")
        raise ConfigError(f"registered adapter {row.name!r}: {detail}") from exc
