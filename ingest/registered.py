"""Adapters known from the ``adapters`` table rather than a config file.

The ingester registers each adapter with its transport, its mode and its
public settings (``AdapterConfig.public_settings``: the keys that apply to its
mode, never the broker URL). ``ack`` and ``status`` without adapters in their
config rebuild an :class:`AdapterConfig` from such a row, with the default
broker URL (``Settings.redis_url``: SWITCHBOARD_REDIS_URL, else the config
file's ``[redis] url``, else the default)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from backhalf.normalize import BodyFormat
from backhalf.registry import AdapterRow
from ingest.adapters.base import FAMILY
from ingest.config import AdapterConfig
from ingest.errors import ConfigError

REDIS_URL_VARIABLE = "SWITCHBOARD_REDIS_URL"
# Set from the row's own columns, or not rebuilt at all: ``schema`` is a path
# relative to a config file this process does not have (nothing here decodes).
_NOT_FROM_SETTINGS = frozenset({"name", "mode", "transport", "redis_url", "schema", "body_schema"})


@functools.cache
def _fields() -> dict[str, dataclasses.Field[Any]]:
    return {f.name: f for f in dataclasses.fields(AdapterConfig) if f.name not in _NOT_FROM_SETTINGS}


def _value(row: AdapterRow, key: str, value: Any) -> Any:
    f = _fields()[key]
    if key == "format":
        try:
            return BodyFormat(value)
        except ValueError as exc:
            raise ConfigError(
                f"registered adapter {row.name!r}: setting 'format' = {value!r} is unknown"
            ) from exc
    default = f.default
    expected = type(default) if default is not dataclasses.MISSING and default is not None else str
    if isinstance(value, bool) or not isinstance(value, expected):
        raise ConfigError(
            f"registered adapter {row.name!r}: setting {key!r} must be {expected.__name__} (got {value!r})"
        )
    return value


def adapter_config(row: AdapterRow, redis_url: str) -> AdapterConfig:
    """The config of a registered adapter, its broker at ``redis_url``.
    Settings this version does not know are ignored; ill-typed ones, or a
    missing ``source``, are a ConfigError naming the adapter."""
    if row.family != FAMILY:
        raise ConfigError(f"registered adapter {row.name!r}: family {row.family!r} has no broker")
    values = {k: _value(row, k, v) for k, v in row.settings.items() if k in _fields()}
    if "source" not in values:
        raise ConfigError(f"registered adapter {row.name!r}: its settings name no 'source'")
    values.setdefault("queue", row.name)
    return AdapterConfig(name=row.name, mode=row.mode, transport=row.transport, redis_url=redis_url, **values)
