"""The registered transports: the one table that names them.

Each is a folder, ``ingest/adapters/<name>/``; what the config reads of it
is its ``settings.DEFINITION`` (no client imported), and the adapter
factory loads its ``modes`` (its client) when an adapter uses it. Adding a
transport adds its folder and its name here (docs/transports.md, "Adding a
transport")."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Mapping
from types import MappingProxyType

from ingest.config.transport import TransportDefinition

# The first is the default: an adapter that names no transport, and the
# file's own broker (its table, ``[<name>]``).
REGISTERED = ("redis", "nats", "sqs", "amqp")
DEFAULT_TRANSPORT = REGISTERED[0]


@functools.cache
def definitions() -> Mapping[str, TransportDefinition]:
    """Every registered transport's definition, by name, in the table's order."""
    # Imported when first asked, not with the config: each transport's
    # settings import the config's key machinery, and the config imports this.
    found: dict[str, TransportDefinition] = {}
    for name in REGISTERED:
        definition = importlib.import_module(f"ingest.adapters.{name}.settings").DEFINITION
        if not isinstance(definition, TransportDefinition) or definition.name != name:
            raise TypeError(
                f"ingest.adapters.{name}.settings: DEFINITION is no TransportDefinition of {name!r}"
            )
        found[name] = definition
    return MappingProxyType(found)


def default() -> TransportDefinition:
    return definitions()[DEFAULT_TRANSPORT]


def of_scheme(scheme: str) -> TransportDefinition:
    """The transport whose URLs have ``scheme``; the default for any other
    (whose URL check then names its own schemes)."""
    return next((d for d in definitions().values() if scheme in d.url_schemes), default())
