"""``[[adapters]]``: one table per adapter, read by the definitions of
:class:`AdapterConfig` (the modes each key applies to, its bounds, its
check), as every other table is (:mod:`ingest.config.keys`)."""

from __future__ import annotations

import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Literal

from backhalf.body_schema import DEFAULT_SCHEMA_TIMEOUT_MS, BodySchema, SchemaFileError
from backhalf.keys import native_key
from backhalf.normalize import DEFAULT_MAX_MESSAGE_BYTES, BodyFormat
from ingest.config.keys import DAYS_TYPE, Derived, Key, Rule, Section, days, got, string
from ingest.config.transport import DefaultBroker, TransportDefinition, Values
from ingest.config.transports import default, definitions
from ingest.config.urls import BrokerUrl, check_broker_url, env_name
from ingest.errors import ConfigError

STREAM = ("stream",)
LIST = ("list",)
PUBSUB = ("pubsub",)
JETSTREAM = ("jetstream",)
QUEUE = ("queue",)


def _default_broker_doc() -> str:
    """The reference's default of ``url``: each transport's default broker."""
    return "the transport's default broker: " + "; ".join(d.default_url_doc for d in definitions().values())


RETENTION = "([Retention](operating.md#retention))"
CREDENTIALS = "([security.md](security.md#broker-passwords-from-the-environment))"


DELIVERIES = ("at-least-once", "at-most-once")
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


def _delivery(where: str, value: Any) -> str:
    if value not in DELIVERIES:
        raise ConfigError(f'{where} must be "at-least-once" or "at-most-once" {got(value, DELIVERIES)}')
    return str(value)


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
    definition_of(values).rule("transport", label, values)


def _url_of_transport(label: str, values: Values) -> None:
    """The url must be one the adapter's transport speaks (a Redis URL on a
    NATS adapter is refused at load, not at the first connect)."""
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


def _format(where: str, value: Any) -> BodyFormat:
    try:
        return BodyFormat(value)
    except ValueError as exc:
        raise ConfigError(
            f"{where} must be json, text or bytes {got(value, [f.value for f in BodyFormat])}"
        ) from exc


_START_ID = re.compile(r"\$|\d+(-\d+)?")


def _start_id(where: str, value: Any) -> str:
    if not isinstance(value, str) or not _START_ID.fullmatch(value):
        raise ConfigError(f"{where} must be '0', '$' or a stream id (got {value!r})")
    return value


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
# SQS's longest visibility timeout (12 hours), and so the bound of ack_wait_ms.
MAX_VISIBILITY_MS = 43_200_000
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


def _retention_rule(key: str) -> Rule:
    def covers_redelivery(label: str, values: Mapping[str, Any]) -> None:
        days = values.get(key)
        if days is None:
            return
        minimum_ms, horizon_ms, keys = dedup_minimum_ms(values)
        if days * DAY_MS < minimum_ms:
            raise ConfigError(
                f"{label}: key {key!r} ({days:g} days) is shorter than the adapter can redeliver: an entry"
                f" is deduplicated only while its inbox row is kept, and {keys} is {horizon_ms} ms; keep"
                f" rows at least {RETENTION_HORIZON_FACTOR}x that and at least"
                f" {RETENTION_FLOOR_MS // 60_000} minutes ({minimum_ms / DAY_MS:.6g} days)"
            )

    return covers_redelivery


def _retention(key: str, doc: str) -> Key:
    return Key(
        parse=days, rule=_retention_rule(key), doc=doc, default_doc="none: kept forever", type_doc=DAYS_TYPE
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class AdapterConfig:
    """One ``[[adapters]]`` table. The attributes are declared in the order
    their keys are checked: of several errors in a table, the first declared
    is reported."""

    name: Annotated[str, Key(public=False, doc="the adapter's name, one per adapter")]
    mode: Annotated[  # its own column
        str,
        Key(
            public=False,
            parse=_mode,
            doc="Redis: `stream`, `list` or `pubsub`; NATS: `jetstream`; SQS and AMQP: `queue`"
            " ([transports.md](transports.md))",
            default_doc="the transport's first: `stream` (Redis), `jetstream` (NATS), `queue` (SQS, AMQP)",
        ),
    ] = "stream"
    delivery: Annotated[
        str | None,
        Key(
            PUBSUB,
            parse=_delivery,
            doc="`at-most-once`, required for pub/sub"
            " ([transports.md](transports.md#pubsub-mode--pubsub-loss-tolerant-only))",
        ),
    ] = None
    transport: Annotated[
        str,
        Key(
            public=False,
            parse=_transport,
            rule=_mode_of_transport,
            doc="the broker's kind: `redis`, `nats`, `sqs` or `amqp` (RabbitMQ)",
        ),
    ] = "redis"  # its own column
    ack_after: Annotated[
        Literal["store", "complete"],
        Key(
            parse=_ack_after,
            rule=_by_transport("ack_after"),
            doc="`store`, or `complete`: the broker ack waits for the todo to finish, see"
            " [Workers](workers.md#acking-on-completion-ack_after--complete); not for pub/sub, which has"
            " no ack, nor JetStream or SQS, which redeliver what stays unacked past `ack_wait_ms`, nor AMQP,"
            " whose channel would hold the delivery past RabbitMQ's `consumer_timeout`",
        ),
    ] = "store"
    format: Annotated[
        BodyFormat,
        Key(
            parse=_format, doc="`json`, `text` or `bytes`: how the body is read ([messages.md](messages.md))"
        ),
    ] = BodyFormat.JSON
    start_id: Annotated[
        str,
        Key(
            STREAM,
            parse=_start_id,
            doc="where a new group starts: `0` consumes the backlog, `$` new only, or a stream id"
            " ([transports.md](transports.md#where-a-streams-group-starts-start_id))",
        ),
    ] = "0"
    cluster: Annotated[
        bool,
        Key(
            STREAM + LIST + PUBSUB,
            doc="the Redis is a Redis (or Valkey) Cluster: keys live in slots, a list's processing lists and"
            " markers share its hash slot ([transports.md](transports.md#redis-cluster))",
        ),
    ] = False
    group: Annotated[
        str,
        Key(
            STREAM + JETSTREAM,
            doc="the consumer group (Redis, created with MKSTREAM when missing), or the JetStream durable"
            " pull consumer (NATS, created when missing)",
        ),
    ] = "switchboard"
    subject: Annotated[
        str | None,
        Key(
            JETSTREAM, parse=string, doc="a subject filter for the durable consumer", default_doc="none: all"
        ),
    ] = None
    max_ack_pending: Annotated[
        int,
        Key(
            JETSTREAM,
            maximum=1_000_000,
            doc="deliveries the consumer may have unacked; past it the server delivers nothing more"
            " ([transports.md](transports.md#nats-jetstream))",
        ),
    ] = 20_000
    ack_wait_ms: Annotated[
        int,
        Key(
            JETSTREAM + QUEUE,
            transports=("nats", "sqs"),
            minimum=1000,
            maximum=MAX_VISIBILITY_MS,
            doc="an unacked delivery is redelivered after this (keep well above read + commit + ack);"
            " SQS: the visibility timeout of each receive, in whole seconds",
        ),
    ] = 60_000
    region: Annotated[
        str | None,
        Key(
            QUEUE,
            transports=("sqs",),
            parse=string,
            doc="the AWS region of the queue",
            default_doc="a queue URL's, else the AWS environment's (`AWS_REGION`, `AWS_DEFAULT_REGION`,"
            " the profile)",
        ),
    ] = None
    credentials_file_env: Annotated[
        str | None,
        Key(
            JETSTREAM,
            public=False,
            parse=env_name,
            doc="the variable holding the path of a NATS `.creds` file (JWT and NKey seed)",
        ),
    ] = None
    token_env: Annotated[
        str | None,
        Key(JETSTREAM, public=False, parse=env_name, doc="the variable holding a NATS auth token"),
    ] = None
    tls_ca_file: Annotated[
        str | None,
        Key(
            JETSTREAM + QUEUE,
            transports=("nats", "sqs", "amqp"),
            parse=string,
            doc="the CA file that verifies the server's certificate (NATS: a `tls://` URL, or the"
            " server requires it; SQS: an `https://` endpoint; AMQP: an `amqps://` URL)",
            default_doc="the system's CAs",
        ),
    ] = None
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
    body_field: Annotated[
        str, Key(STREAM, doc="the field holding the message; entries without it are taken as their field map")
    ] = "body"
    batch_size: Annotated[int, Key(maximum=10_000, doc="messages read at most per batch")] = 500
    block_ms: Annotated[
        int,
        Key(
            doc="how long a read waits for its first message (`XREADGROUP BLOCK`, `BLMOVE`'s timeout,"
            " pub/sub's wait, a JetStream fetch's expiry; SQS's long poll, in whole seconds from 1 to 20)"
        ),
    ] = 1000
    claim_idle_ms: Annotated[
        int, Key(STREAM, doc="claim (XCLAIM) entries idle longer than this (keep well above ack lag)")
    ] = 60_000
    claim_interval_ms: Annotated[int, Key(STREAM, doc="how often the claim sweep runs")] = 5_000
    max_message_bytes: Annotated[
        int, Key(doc="a larger message is rejected `too_large` ([messages.md](messages.md))")
    ] = DEFAULT_MAX_MESSAGE_BYTES
    heartbeat_ttl_ms: Annotated[
        int, Key(LIST, minimum=1000, doc="a consumer silent this long is dead; its processing list is reaped")
    ] = 30_000
    max_deliveries: Annotated[
        int, Key(minimum=3, doc="delivered this often and never stored: rejected as poison")
    ] = 10
    reap_interval_ms: Annotated[int, Key(LIST, doc="how often dead consumers' lists are checked")] = 5_000
    source: Annotated[
        str,
        Key(
            rule=_by_transport("source"),
            doc="stream key, list key or channel; the JetStream stream; the SQS queue's name or URL;"
            " the AMQP queue (it must exist)",
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
    # So a producer cannot stall the ingester.
    schema_timeout_ms: Annotated[
        int, Key(doc="a body whose validation takes longer is rejected (`validation_timeout`)")
    ] = DEFAULT_SCHEMA_TIMEOUT_MS
    # Retention (the acker's pruner, `switchboard prune`), checked against
    # the redelivery horizon above.
    retain_acked_days: Annotated[
        float | None,
        _retention(
            "retain_acked_days", f"days stored rows whose ack is done are kept, with their events {RETENTION}"
        ),
    ] = None
    retain_rejected_days: Annotated[
        float | None,
        _retention(
            "retain_rejected_days",
            "days rejected (poison, lost) rows are kept, with their events (longer: operators replay"
            f" them) {RETENTION}",
        ),
    ] = None
    body_schema: Annotated[BodySchema | None, Derived()] = field(default=None, compare=False, repr=False)

    @property
    def key_space(self) -> str:
        """What each of this adapter's idempotency keys begins with,
        ``{key_prefix}:{source}:``, as its transport forms them: an SQS
        queue by its name, whether ``source`` gives the name or the URL."""
        return native_key(self.key_prefix, definitions()[self.transport].queue_name(self.source), "")

    def public_settings(self) -> dict[str, Any]:
        """What goes into ``adapters.settings``: the settings that apply to
        this adapter's mode, never the broker URL; an unset ``schema`` is left
        out."""
        public: dict[str, Any] = {}
        for s in ADAPTERS.settings:
            value = getattr(self, s.attr)
            if s.key.public and s.key.applies_to(self.mode, self.transport) and value is not None:
                public[s.name] = value.value if isinstance(value, Enum) else value
        return public


ADAPTERS = Section(
    "[[adapters]]",
    AdapterConfig,
    intro="One table per adapter. The modes are explained in [transports.md](transports.md), and what"
    " becomes of a message in [messages.md](messages.md). A key applies to the modes its row names: given"
    " for another mode it is an error.",
)


def adapter_keys(mode: str | None = None, transport: str | None = None) -> frozenset[str]:
    """The keys of an ``[[adapters]]`` table; with ``mode`` (and
    ``transport``), those that apply to it."""
    if mode is None:
        return ADAPTERS.names()
    return frozenset(s.name for s in ADAPTERS.settings if s.key.applies_to(mode, transport))


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
    # The defaults that depend on the rest.
    values = ADAPTERS.read(
        label, raw, defaults={"queue": name, **_transport_defaults(raw, default_broker, env)}
    )
    # Only the processes that connect to this broker need the variables (the
    # ingester's and the acker's, per role): a missing one is raised when one does.
    credentials = definition_of(values).credentials(label, values)
    values["broker"] = BrokerUrl.resolve(label, values["broker"], env, **credentials)
    return AdapterConfig(**{**values, **_body_schema(label, values, base_dir)})


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


def _body_schema(label: str, values: Mapping[str, Any], base_dir: Path) -> dict[str, Any]:
    """``schema``: a JSON Schema file, relative to the config file's directory,
    its references resolved now (never while messages arrive)."""
    if values["schema"] is None:
        return {}
    path = Path(values["schema"])
    if values["format"] is BodyFormat.BYTES:
        raise ConfigError(f"{label}: key 'schema' cannot apply to format = \"bytes\" (nothing is decoded)")
    path = path if path.is_absolute() else base_dir / path
    try:
        body_schema = BodySchema.load(path, timeout_ms=values["schema_timeout_ms"])
        return {"schema": str(path), "body_schema": body_schema}
    except SchemaFileError as exc:
        raise ConfigError(f"{label}: key 'schema': {exc}") from exc


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
