"""The one place a transport and mode are chosen: adapter and acknowledger per config.

Transports are registered in :mod:`ingest.config.transports` and their
modes imported only when an adapter uses one (the way kombu loads its
transports by alias): a deployment that uses one transport imports no other
broker's client. Each transport is a folder under ``ingest/adapters/`` whose
``modes`` module registers its modes in ``MODES`` and says how its ack
intents read (``describe_ack``); its client library is an install extra, and
a missing one is a one-line config error naming the extra. The poll loop, the
acker and ``status`` never branch on a transport or a mode.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from types import ModuleType
from typing import NamedTuple, Protocol, cast

from backhalf.records import AckParty
from ingest.adapters.base import AckIntentView, Acknowledger, ConsumerLedger, ModeImplementation, PullAdapter
from ingest.config import AdapterConfig
from ingest.config.transports import definitions, package_of
from ingest.errors import ConfigError


class Transport(NamedTuple):
    """A transport's ``modes`` module, and the install extra that brings its
    client (None: the client is a dependency of Switchboard itself)."""

    module: str
    extra: str | None = None


def transports() -> Mapping[str, Transport]:
    """Each registered transport's modes, loaded when an adapter uses it."""
    return {name: Transport(f"{package_of(name)}.modes", d.extra) for name, d in definitions().items()}


class TransportPackage(Protocol):
    """What a transport's ``modes`` module exports."""

    MODES: Mapping[str, ModeImplementation]
    # OpenTelemetry's ``messaging.system`` for its spans (backhalf.tracing).
    MESSAGING_SYSTEM: str

    def describe_ack(self, intent: AckIntentView) -> str: ...


def transport(name: str, *, adapter: str | None = None) -> TransportPackage:
    """The package of transport ``name``, imported now; a ConfigError naming
    the adapter and the extra when it is unknown or its client is missing."""
    where = f"adapter {adapter!r}: " if adapter else ""
    known = transports().get(name)
    if known is None:
        raise ConfigError(f"{where}key 'transport' = {name!r} is not one of {sorted(transports())}")
    try:
        module: ModuleType = importlib.import_module(known.module)
    except ImportError as exc:
        extra = known.extra
        install = f"pip install 'switchboard-ingest[{extra}]'" if extra else "reinstall Switchboard"
        raise ConfigError(
            f"{where}transport {name!r} needs its client library ({exc.name or exc}): {install}"
        ) from exc
    return cast("TransportPackage", module)


def _implementation(config: AdapterConfig) -> ModeImplementation:
    implementation = transport(config.transport, adapter=config.name).MODES.get(config.mode)
    if implementation is None:
        raise ConfigError(
            f"adapter {config.name!r}: key 'mode' = {config.mode!r} is not implemented"
            f" for transport {config.transport!r}"
        )
    return implementation


def messaging_system(config: AdapterConfig) -> str:
    """The transport's name in OpenTelemetry's messaging conventions."""
    return transport(config.transport, adapter=config.name).MESSAGING_SYSTEM


def acked_by(config: AdapterConfig) -> AckParty:
    """Who acks this adapter's messages: the acker, from committed intents,
    or the ingester itself after its commit (``PullAdapter.ack_stored``)."""
    return _implementation(config).acked_by


def make_adapter(config: AdapterConfig, *, ledger: ConsumerLedger | None) -> PullAdapter:
    """``ledger``: where a stream adapter records the groups it creates.
    Always said: the ingester passes PostgreSQL's; ``status``, which creates
    no group, None."""
    implementation = _implementation(config)
    adapter = implementation.adapter(config, ledger=ledger)
    if adapter.ack_target.kind != implementation.ack_kind:
        # A transport's bug: the kind it registered names the acknowledger
        # the acker will choose for what this adapter stores.
        raise TypeError(
            f"transport {config.transport!r} mode {config.mode!r} registered ack kind"
            f" {implementation.ack_kind!r} but its adapter says {adapter.ack_target.kind!r}"
        )
    return adapter


def make_acknowledger(config: AdapterConfig) -> Acknowledger:
    """The acker's acknowledger for ``config``; ask :func:`acked_by` first:
    an adapter its ingester acks has none (a TypeError here)."""
    implementation = _implementation(config)
    if implementation.acked_by != "acker":
        raise TypeError(f"adapter {config.name!r}: its ingester acks its messages; the acker has no part")
    return implementation.acknowledger(config)


def describe_ack(transport_name: str | None, intent: AckIntentView) -> str:
    """An ack intent as its transport would send it (``trace``), e.g.
    ``XACK orders switchboard 1-0``; the bare intent where the transport is
    unknown here or its client is not installed."""
    plain = f"{intent.kind} {intent.key or '-'} {intent.group or '-'} {intent.ref or '-'}"
    # An adapter no longer registered has no transport on record: the one
    # that registered the intent's kind puts it in words.
    known = transports()
    names = [transport_name] if transport_name is not None else list(known)
    for name in names:
        if name not in known:
            continue
        try:
            package = transport(name)
        except ConfigError:  # its client is not installed here
            continue
        if transport_name is not None or any(m.ack_kind == intent.kind for m in package.MODES.values()):
            return package.describe_ack(intent)
    return plain
