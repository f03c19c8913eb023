"""``[[adapters]]``: one table per adapter, read by the definitions of
:class:`AdapterConfig` (the modes each key applies to, its bounds, its
check), as every other table is (:mod:`ingest.config.keys`)."""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from backhalf.writes.body_schema import DEFAULT_SCHEMA_TIMEOUT_MS, BodySchema
from backhalf.writes.keys import native_key
from backhalf.writes.normalize import DEFAULT_MAX_MESSAGE_BYTES, BodyFormat
from ingest.config.body import Format, SchemaTimeoutMs, body_schema
from ingest.config.keys import DAYS_TYPE, Derived, Key, Rule, Section, Setting, check_keys, days, got, string
from ingest.config.transport import DefaultBroker, TransportDefinition, Values
from ingest.config.transports import DEFAULT_TRANSPORT, default, definitions
from ingest.config.urls import BrokerUrl, check_broker_url, env_name
from ingest.errors import ConfigError


def _default_broker_doc() -> str:
    """The reference's default of ``url``: each transport's default broker."""
    return "the transport's default broker: " + "; ".join(d.default_url_doc for d in definitions().values())


RETENTION = "([Retention](operating.md#retention))"
CREDENTIALS = "([security.md](security.md#broker-passwords-from-the-environment))"


ACK_AFTER = ("store", "complete")


def _modes() -> tuple[str, ...]:
    return tuple(dict.fromkeys(m for d in definitions().values() for m in d.modes))


def _mode(where: str, value: Any) -> str:
    modes = _modes()
    if value not in modes:
        raise ConfigError(f"{where} must be one of {', '.join(modes)} {got(value, modes)}")
    return str(value)


def definition_of(values: Values) -> TransportDefinition:
    """The definition of the transport a table (read so far) names."""
    return definitions()[values["transport"]]


def _transport(where: str, value: Any) -> str:
    if value not in definitions():
        # A webhook's table is read by its own definitions (ingest.config.webhook).
        transports = (*definitions(), "webhook")
        raise ConfigError(f"{where} must be one of {', '.join(transports)} {got(value, transports)}")
    return str(value)


def _mode_of_transport(label: str, values: Values) -> None:
    modes = definition_of(values).modes
    if values["mode"] not in modes:
        raise ConfigError(
            f"{label}: key 'mode' = {values['mode']!r} is not a mode of transport = {values['transport']!r}"
            f" (its modes: {', '.join(modes)})"
        )


def _url_of_transport(label: str, values: Values) -> None:
    """The url must be one the adapter's transport speaks (another
    transport's URL is refused at load, not at the first connect)."""
    definition = definition_of(values)
    definition.check_url(f"{label}: key 'url'", values["broker"])
    definition.rule("url", label, values)


def _by_transport(key: str) -> Rule:
    """The rule of ``key`` of the adapter's own transport."""

    def rule(label: str, values: Values) -> None:
        definition_of(values).rule(key, label, values)

    return rule


def _ack_after(where: str, value: Any) -> str:
    if value not in ACK_AFTER:
        raise ConfigError(f'{where} must be "store" or "complete" {got(value, ACK_AFTER)}')
    return str(value)


# Retention (issue 14). A stream entry id is deduplicated only while its inbox
# row exists, so an adapter's rows are kept at least as long as its broker can
# deliver the entry again: twice its claim (stream) or reap (list) cycle, and
# never under an hour. Twice, because a cycle is the bound on when a stuck
# entry is taken again, not on when that delivery is stored; the hour covers
# what no key bounds: a consumer frozen (a GC pause, SIGSTOP, a VM migration)
# with a batch it read before another consumer claimed, stored and acked it,
# which it stores when it wakes, and the store's own deadline.
DAY_MS = 86_400_000
RETENTION_FLOOR_MS = 3_600_000
RETENTION_HORIZON_FACTOR = 2


def redelivery_horizon_ms(values: Values) -> tuple[int, str]:
    """How long after its delivery an adapter's broker may deliver a message
    again, and from which keys (its transport's own reckoning)."""
    return definition_of(values).redelivery_horizon(values)


def dedup_minimum_ms(values: Mapping[str, Any]) -> tuple[int, int, str]:
    """The shortest an adapter's native ids may be remembered (twice its
    redelivery horizon, at least the floor), with the horizon and its keys."""
    horizon_ms, keys = redelivery_horizon_ms(values)
    return max(RETENTION_HORIZON_FACTOR * horizon_ms, RETENTION_FLOOR_MS), horizon_ms, keys


def _covers_redelivery(label: str, values: Values) -> None:
    """Each retention key, against the adapter's redelivery horizon: run
    once the transport's own keys, which set the horizon, are read."""
    for key in ("retain_acked_days", "retain_rejected_days"):
        days = values.get(key)
        if days is None:
            continue
        minimum_ms, horizon_ms, keys = dedup_minimum_ms(values)
        if days * DAY_MS < minimum_ms:
            raise ConfigError(
                f"{label}: key {key!r} ({days:g} days) is shorter than the adapter can redeliver: an entry"
                f" is deduplicated only while its inbox row is kept, and {keys} is {horizon_ms} ms; keep"
                f" rows at least {RETENTION_HORIZON_FACTOR}x that and at least"
                f" {RETENTION_FLOOR_MS // 60_000} minutes ({minimum_ms / DAY_MS:.6g} days)"
            )


def _retention(doc: str) -> Key:
    return Key(parse=days, doc=doc, default_doc="none: kept forever", type_doc=DAYS_TYPE)


@dataclass(frozen=True, slots=True, kw_only=True)
class AdapterConfig:
    """One ``[[adapters]]`` table. A key of another transport or mode is
    reported first; then the attributes are checked in the order they are
    declared, and the transport's own keys after them: of several errors in
    a table, the first so checked is reported."""

    name: Annotated[str, Key(public=False, doc="the adapter's name, one per adapter")]
    mode: Annotated[  # its own column
        str,
        Key(
            public=False,
            parse=_mode,
            doc="one of the transport's modes, named in its table below ([transports.md](transports.md))",
            default_doc="the transport's first",
        ),
    ] = "stream"
    transport: Annotated[
        str,
        Key(
            public=False,
            parse=_transport,
            rule=_mode_of_transport,
            doc="the broker's kind: a transport whose table follows (or `webhook`, a push adapter)",
        ),
    ] = DEFAULT_TRANSPORT  # its own column
    ack_after: Annotated[
        Literal["store", "complete"],
        Key(
            parse=_ack_after,
            rule=_by_transport("ack_after"),
            doc="`store`, or `complete`: the broker ack waits for the todo to finish, where the transport can"
            " hold an ack that long; see [Workers](workers.md#acking-on-completion-ack_after--complete)",
        ),
    ] = "store"
    format: Format = BodyFormat.JSON
    consumer: Annotated[
        str,
        Key(doc="unique per ingester process; `ingest --consumer` overrides it", default_doc="the host name"),
    ] = field(default_factory=socket.gethostname)
    key_prefix: Annotated[
        str,
        Key(
            doc="idempotency keys: `{key_prefix}:{source}:{entry-id}`",
            default_doc="the transport's name",
        ),
    ]  # always given: the defaults of the table's transport
    batch_size: Annotated[int, Key(maximum=10_000, doc="messages read at most per batch")] = 500
    block_ms: Annotated[
        int,
        Key(
            doc="how long a read waits for its first message: the timeout of the transport's blocking read"
            " ([transports.md](transports.md))"
        ),
    ] = 1000
    max_message_bytes: Annotated[
        int, Key(doc="a larger message is rejected `too_large` ([messages.md](messages.md))")
    ] = DEFAULT_MAX_MESSAGE_BYTES
    max_deliveries: Annotated[
        int, Key(minimum=3, doc="delivered this often and never stored: rejected as poison")
    ] = 10
    source: Annotated[
        str,
        Key(
            rule=_by_transport("source"),
            doc="what the adapter reads: its transport's stream, list, channel or queue"
            " ([transports.md](transports.md))",
        ),
    ]
    # The URL as read; its credentials, from the variables below, are added
    # after the table is read (see BrokerUrl).
    broker: Annotated[
        BrokerUrl,
        Key(
            public=False,
            toml="url",
            parse=check_broker_url,
            rule=_url_of_transport,
            doc="the adapter's own broker; never published in `adapters.settings`",
            default_doc=_default_broker_doc,
            type_doc="string",
        ),
    ]
    # The broker's user name and password from these environment variables
    # (never from the TOML), in place of the url's; not published.
    username_env: Annotated[
        str | None,
        Key(
            public=False,
            parse=env_name,
            doc=f"the variable holding the broker's user name, in place of the url's {CREDENTIALS}",
        ),
    ] = None
    password_env: Annotated[
        str | None,
        Key(
            public=False,
            parse=env_name,
            doc=f"the variable holding the broker's password, in place of the url's {CREDENTIALS}",
        ),
    ] = None
    queue: Annotated[str, Key(doc="the todo queue", default_doc="the adapter's `name`")]
    schema: Annotated[
        str | None,
        Key(
            parse=string,
            doc="a JSON Schema file the body must satisfy, else it is poison; relative to the config file,"
            ' its references resolved at start-up ([messages.md](messages.md)); not for `format = "bytes"`',
        ),
    ] = None
    schema_timeout_ms: SchemaTimeoutMs = DEFAULT_SCHEMA_TIMEOUT_MS
    # Retention (the acker's pruner, `switchboard prune`), checked against
    # the redelivery horizon above.
    retain_acked_days: Annotated[
        float | None,
        _retention(f"days stored rows whose ack is done are kept, with their events {RETENTION}"),
    ] = None
    retain_rejected_days: Annotated[
        float | None,
        _retention(
            "days rejected (poison, lost) rows are kept, with their events (longer: operators replay"
            f" them) {RETENTION}"
        ),
    ] = None
    body_schema: Annotated[BodySchema | None, Derived()] = field(default=None, compare=False, repr=False)
    # The transport's own keys, read by its definition's ``keys`` section
    # (``ingest/adapters/<transport>/settings.py``) into its frozen dataclass;
    # each transport's ``options(config)`` gives it typed.
    options: Annotated[Any, Derived()]

    def values(self) -> dict[str, Any]:
        """Every key's value by attribute, the shared and the transport's own."""
        shared = {s.attr: getattr(self, s.attr) for s in ADAPTERS.settings}
        own = {f.name: getattr(self.options, f.name) for f in dataclasses.fields(self.options)}
        return {**shared, **own}

    @property
    def key_space(self) -> str:
        """What each of this adapter's idempotency keys begins with,
        ``{key_prefix}:{source}:``, as its transport forms them (its
        ``queue_name``: a queue by its name, whether ``source`` gives the name
        or the URL)."""
        return native_key(self.key_prefix, definitions()[self.transport].queue_name(self.source), "")

    def public_settings(self) -> dict[str, Any]:
        """What goes into ``adapters.settings``: the settings that apply to
        this adapter's mode, never the broker URL; an unset ``schema`` is left
        out."""
        own = definitions()[self.transport].keys
        return {**ADAPTERS.public_values(self, self.mode), **own.public_values(self.options, self.mode)}


ADAPTERS = Section(
    "[[adapters]]",
    AdapterConfig,
    intro="One table per adapter. These keys apply to every transport; each transport's own keys follow in"
    " a table of their own, by the modes their rows name: a key given for another transport or mode is an"
    " error. The modes are explained in [transports.md](transports.md), and what becomes of a message in"
    " [messages.md](messages.md).",
)


def adapter_keys(mode: str | None = None, transport: str | None = None) -> frozenset[str]:
    """The keys of an ``[[adapters]]`` table, the shared ones and every
    transport's own; with ``mode`` (and ``transport``), those that apply to it."""
    names = set(ADAPTERS.names())
    for d in definitions().values():
        if transport is not None and d.name != transport:
            continue
        names |= {s.name for s, modes in _own_keys(d) if mode is None or mode in modes}
    return frozenset(names)


def _own_keys(d: TransportDefinition) -> list[tuple[Setting, tuple[str, ...]]]:
    """A transport's own keys, each with the modes it applies to."""
    return [(s, s.key.modes if s.key.modes is not None else d.modes) for s in d.keys.settings]


def _applies(label: str, raw: Mapping[str, Any], values: Values) -> None:
    """A key of another mode or transport, given: an error naming it and
    where it applies (DESIGN.md 6b), never silently ignored."""
    mode, transport = values["mode"], values["transport"]
    for name in raw:
        if name in ADAPTERS.names():
            continue
        owners = [
            (d.name, modes) for d in definitions().values() for s, modes in _own_keys(d) if s.name == name
        ]
        modes = tuple(dict.fromkeys(m for _, ms in owners for m in ms))
        if mode not in modes:
            named = " or ".join(repr(m) for m in modes)
            raise ConfigError(
                f"{label}: key {name!r} does not apply to mode = {mode!r} (it applies to mode {named})"
            )
        transports = [t for t, ms in owners if mode in ms]
        if transport not in transports:
            named = " or ".join(repr(t) for t in transports)
            raise ConfigError(
                f"{label}: key {name!r} does not apply to transport = {transport!r} (it applies to"
                f" transport {named})"
            )


def read_adapter(
    table: Mapping[str, Any], default_url: str, env: Mapping[str, str] | None = None
) -> AdapterConfig:
    """One ``[[adapters]]`` table, read and checked as a config file's are;
    ``default_url`` where an adapter of the default transport names no
    ``url`` (another transport's default is its own). A ``schema`` path is
    taken relative to the working directory."""
    return _adapter(0, table, DefaultBroker(default_url), Path.cwd(), env or {})


def read_adapters(
    raw: Mapping[str, Any], default_broker: DefaultBroker, base_dir: Path, env: Mapping[str, str]
) -> tuple[AdapterConfig, ...]:
    """The file's ``[[adapters]]``, each read, then checked against the others.
    ``default_broker``: the file's own broker, the default transport's
    ``url`` and ``cluster``."""
    adapters = tuple(
        _adapter(i, a, default_broker, base_dir, env)
        for i, a in enumerate(adapter_tables(raw))
        if not is_webhook(a)
    )
    names = [a.name for a in adapters]
    for n in names:
        if names.count(n) > 1:
            raise ConfigError(f"adapter {n!r}: key 'name' is used by more than one adapter")
    _check_one_reader_each(adapters)
    for definition in definitions().values():
        if definition.across is not None:
            definition.across([a for a in adapters if a.transport == definition.name])
    return adapters


def adapter_tables(raw: Mapping[str, Any]) -> list[Any]:
    tables = raw.get("adapters", [])
    if not isinstance(tables, list):
        raise ConfigError("[[adapters]]: must be an array of tables")
    return tables


def is_webhook(table: Any) -> bool:
    """A push adapter's table: read by ingest.config.webhook, not here."""
    return isinstance(table, Mapping) and table.get("transport") == "webhook"


def _adapter(
    index: int, raw: Any, default_broker: DefaultBroker, base_dir: Path, env: Mapping[str, str]
) -> AdapterConfig:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"adapters[{index}]: must be a table")
    name = raw.get("name")
    label = f"adapter {name!r}" if isinstance(name, str) and name else f"adapters[{index}]"
    check_keys(label, raw, set(adapter_keys()))
    # The defaults that depend on the rest.
    defaults = {"queue": name, **_transport_defaults(raw, default_broker, env)}
    # A key of another transport or mode is said first, as soon as the
    # table's mode and transport are known to be good (else their own
    # errors come first, in the shared keys' order).
    mode, transport = raw.get("mode", defaults["mode"]), raw.get("transport", default().name)
    if isinstance(transport, str) and transport in definitions() and mode in definitions()[transport].modes:
        _applies(label, raw, {"mode": mode, "transport": transport})
    shared = {k: v for k, v in raw.items() if k in ADAPTERS.names()}
    values = ADAPTERS.read(label, shared, defaults=defaults)
    definition = definition_of(values)
    own_raw = {k: v for k, v in raw.items() if k not in ADAPTERS.names()}
    own = definition.keys.read(label, own_raw, defaults=defaults, context=values)
    _covers_redelivery(label, {**values, **own})
    # Only the processes that connect to this broker need the variables (the
    # ingester's and the acker's, per role): a missing one is raised when one does.
    credentials = definition.credentials(label, {**values, **own})
    values["broker"] = BrokerUrl.resolve(label, values["broker"], env, **credentials)
    options = definition.keys.cls(**own)
    return AdapterConfig(**{**values, **body_schema(label, values, base_dir)}, options=options)


def _transport_defaults(
    raw: Mapping[str, Any], default_broker: DefaultBroker, env: Mapping[str, str]
) -> dict[str, Any]:
    """The mode, url and key prefix an adapter of its transport has when its
    table names none (an unknown transport is refused by its own key)."""
    named = raw.get("transport")
    definition = definitions().get(named, default()) if isinstance(named, str) else default()
    defaults = {
        "mode": definition.modes[0],
        "url": definition.default_url(env, default_broker),
        "key_prefix": definition.key_prefix,
    }
    if definition.table_defaults is not None:
        defaults.update(definition.table_defaults(raw, default_broker))
    return defaults


def source_identity(a: AdapterConfig) -> tuple[str, ...]:
    """Which messages an adapter reads, whatever its group: its transport
    and mode, the server (and database or vhost) its URL reaches, whoever
    logs in, and the source there, as its transport tells sources apart."""
    located = definitions()[a.transport].located
    return (a.transport, a.mode, *a.broker.identity(), located(a) if located is not None else a.source)


def _check_one_reader_each(adapters: tuple[AdapterConfig, ...]) -> None:
    """Two adapters reading one source as one reader (a stream with one
    consumer group, one list, one queue) split its messages between them at
    random, and after a crash a message can reach both, as work in two
    queues: refused. Each transport says what one reader is."""
    readers: dict[tuple[str, ...], AdapterConfig] = {}
    for a in adapters:
        reader = definitions()[a.transport].reader(a, source_identity(a))
        if reader is None:
            continue
        first = readers.setdefault(reader.what, a)
        if first is not a:
            raise ConfigError(
                f"adapter {a.name!r}: key {reader.key!r}: adapter {first.name!r} already reads {reader.read}"
                f" on the same broker; {reader.hint}"
            )
