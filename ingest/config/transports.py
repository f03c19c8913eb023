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


# Transports added at run time, by name: their packages, each holding a
# ``settings`` and a ``modes`` module as a folder of ingest/adapters/ does.
_ADDED: dict[str, str] = {}


def package_of(name: str) -> str:
    """The package of transport ``name``: its folder, ``ingest.adapters.<name>``,
    or where :func:`add` put it."""
    return _ADDED.get(name, f"ingest.adapters.{name}")


def add(name: str, package: str) -> None:
    """Register a transport kept outside ingest/adapters/ for this process
    (the contract suite's in-memory broker; an application's own transport):
    ``package`` holds its ``settings`` and ``modes`` as a folder here does."""
    if name in REGISTERED or name in _ADDED or name == "webhook":
        raise ValueError(f"transport {name!r} is registered already")
    # Checked before it is registered: a package that does not load would
    # otherwise break every later reading of the definitions.
    _load(name, package)
    _ADDED[name] = package
    definitions.cache_clear()


def remove(name: str) -> None:
    """Forget a transport :func:`add` registered."""
    _ADDED.pop(name, None)
    definitions.cache_clear()


@functools.cache
def definitions() -> Mapping[str, TransportDefinition]:
    """Every registered transport's definition, by name, in the table's
    order (then those :func:`add` registered)."""
    # Imported when first asked, not with the config: each transport's
    # settings import the config's key machinery, and the config imports this.
    return MappingProxyType({name: _load(name, package_of(name)) for name in (*REGISTERED, *_ADDED)})


def _load(name: str, package: str) -> TransportDefinition:
    module = f"{package}.settings"
    definition = importlib.import_module(module).DEFINITION
    if not isinstance(definition, TransportDefinition) or definition.name != name:
        raise TypeError(f"{module}: DEFINITION is no TransportDefinition of {name!r}")
    return definition


def default() -> TransportDefinition:
    return definitions()[DEFAULT_TRANSPORT]


def of_scheme(scheme: str) -> TransportDefinition:
    """The transport whose URLs have ``scheme``; the default for any other
    (whose URL check then names its own schemes)."""
    return next((d for d in definitions().values() if scheme in d.url_schemes), default())
