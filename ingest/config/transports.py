"""The registered transports: the one table that names them.

Each is a folder, ``ingest/adapters/<name>/``; what the config reads of it
is its ``settings.DEFINITION`` (no client imported), and the adapter
factory loads its ``modes`` (its client) when an adapter uses it. Adding a
transport adds its folder and its line here (docs/transports.md, "Adding a
transport")."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from types import MappingProxyType

from ingest.config.transport import TransportDefinition


@functools.cache
def definitions() -> Mapping[str, TransportDefinition]:
    """Every registered transport by name; the first is the default (an
    adapter that names no transport, and the file's own ``[redis]``)."""
    # Imported when first asked, not with the config: each transport's
    # settings import the config's key machinery, and the config imports this.
    from ingest.adapters.amqp.settings import DEFINITION as AMQP
    from ingest.adapters.nats.settings import DEFINITION as NATS
    from ingest.adapters.redis.settings import DEFINITION as REDIS
    from ingest.adapters.sqs.settings import DEFINITION as SQS

    return MappingProxyType({d.name: d for d in (REDIS, NATS, SQS, AMQP)})


def default() -> TransportDefinition:
    return next(iter(definitions().values()))


def of_scheme(scheme: str) -> TransportDefinition:
    """The transport whose URLs have ``scheme``; the default for any other
    (whose URL check then names its own schemes)."""
    return next((d for d in definitions().values() if scheme in d.url_schemes), default())
