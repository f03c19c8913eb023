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
from urllib.parse import urlsplit

from backhalf.body_schema import DEFAULT_SCHEMA_TIMEOUT_MS, BodySchema, SchemaFileError
from backhalf.keys import DEFAULT_PREFIX, native_key
from backhalf.normalize import DEFAULT_MAX_MESSAGE_BYTES, BodyFormat
from ingest.config.keys import DAYS_TYPE, Derived, Key, Rule, Section, days, got, string
from ingest.config.urls import AWS_ENDPOINT, URL_CHECKS, BrokerUrl, check_broker_url, env_name
from ingest.errors import ConfigError

# The modes of each transport, its first the default (DESIGN.md 6 and 6b).
TRANSPORT_MODES: Mapping[str, tuple[str, ...]] = {
    "redis": ("stream", "list", "pubsub"),
    "nats": ("jetstream",),
    "sqs": ("queue",),
    "amqp": ("queue",),
}
MODES = tuple(dict.fromkeys(m for modes in TRANSPORT_MODES.values() for m in modes))
STREAM = ("stream",)
LIST = ("list",)
PUBSUB = ("pubsub",)
JETSTREAM = ("jetstream",)
QUEUE = ("queue",)
REDIS_MODES = TRANSPORT_MODES["redis"]
# Where a transport's adapters connect when they name no ``url``.
NATS_URL_VARIABLE = "SWITCHBOARD_NATS_URL"
DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
SQS_URL_VARIABLE = "SWITCHBOARD_SQS_ENDPOINT_URL"
AMQP_URL_VARIABLE = "SWITCHBOARD_AMQP_URL"
DEFAULT_AMQP_URL = "amqp://127.0.0.1:5672/"
REDIS_DEFAULT_BROKER = "`SWITCHBOARD_REDIS_URL`, else `[redis] url`"
DEFAULT_BROKER = (
    f"the transport's default broker: Redis {REDIS_DEFAULT_BROKER};"
    f" NATS `{NATS_URL_VARIABLE}`, else `{DEFAULT_NATS_URL}`; SQS `{SQS_URL_VARIABLE}`, else"
    f" `{AWS_ENDPOINT}` (AWS's own endpoint of the region); AMQP `{AMQP_URL_VARIABLE}`, else"
    f" `{DEFAULT_AMQP_URL}`"
)
# The key prefix of a transport's idempotency keys (DESIGN.md 6b).
DEFAULT_PREFIXES: Mapping[str, str] = {"redis": DEFAULT_PREFIX, "nats": "nats", "sqs": "sqs", "amqp": "amqp"}
RETENTION = "([Retention](operating.md#retention))"
CREDENTIALS = "([security.md](security.md#broker-passwords-from-the-environment))"


DELIVERIES = ("at-least-once", "at-most-once")
ACK_AFTER = ("store", "complete")


def _mode(where: str, value: Any) -> str:
    if value not in MODES:
        raise ConfigError(f"{where} must be one of {', '.join(MODES)} {got(value, MODES)}")
    return str(value)


def _delivery(where: str, value: Any) -> str:
    if value not in DELIVERIES:
        raise ConfigError(f'{where} must be "at-least-once" or "at-most-once" {got(value, DELIVERIES)}')
    return str(value)


def _pubsub_is_at_most_once(label: str, values: Mapping[str, Any]) -> None:
    if values["mode"] == "pubsub" and values["delivery"] != "at-most-once":
        raise ConfigError(
            f'{label}: key \'delivery\' must be "at-most-once" for mode = "pubsub": pub/sub has no '
            "redelivery and loses messages published while the ingester is down"
        )


def _transport(where: str, value: Any) -> str:
    if value not in TRANSPORT_MODES:
        # A webhook's table is read by its own definitions (ingest.config.webhook).
        transports = (*TRANSPORT_MODES, "webhook")
        raise ConfigError(f"{where} must be one of {', '.join(transports)} {got(value, transports)}")
    return str(value)


def _mode_of_transport(label: str, values: Mapping[str, Any]) -> None:
    modes = TRANSPORT_MODES[values["transport"]]
    if values["mode"] not in modes:
        raise ConfigError(
            f"{label}: key 'mode' = {values['mode']!r} is not a mode of transport = {values['transport']!r}"
            f" (its modes: {', '.join(modes)})"
        )


def _url_of_transport(label: str, values: Mapping[str, Any]) -> None:
    """The url must be one the adapter's transport speaks (a Redis URL on a
    NATS adapter is refused at load, not at the first connect)."""
    URL_CHECKS[values["transport"]](f"{label}: key 'url'", values["broker"])
    # A queue URL names its endpoint: a second one in 'url' is either the same
    # (said twice) or another (which would the calls go to?).
    if (
        values["transport"] == "sqs"
        and "://" in values["source"]
        and values["broker"] != AWS_ENDPOINT
        and urlsplit(values["source"]).netloc != urlsplit(values["broker"]).netloc
    ):
        raise ConfigError(
            f"{label}: key 'source' is a queue URL on another endpoint than key 'url': name the queue once,"
            " by its URL in 'source' (no 'url'), or by its name in 'source' with the endpoint in 'url'"
        )


# A JetStream stream or consumer name: no subject wildcards or separators,
# no path characters, no whitespace (the server's own rule).
_JETSTREAM_NAME = re.compile(r"[^.*>/\\\s]+")


def _jetstream_names(label: str, values: Mapping[str, Any]) -> None:
    if values["mode"] != "jetstream":
        return
    for key in ("source", "group"):
        if not _JETSTREAM_NAME.fullmatch(values[key]):
            raise ConfigError(
                f"{label}: key {key!r} = {values[key]!r} is no JetStream stream or consumer name:"
                " no '.', '*', '>', '/', '\\' or whitespace (a subject goes in 'subject')"
            )


# An SQS queue name (AWS's rule: up to 80 of these, ``.fifo`` included), or
# a queue URL ending in one.
_SQS_QUEUE_NAME = re.compile(r"[A-Za-z0-9_-]{1,75}(\.fifo)?|[A-Za-z0-9_-]{1,80}")


def sqs_queue_name(source: str) -> str:
    """The queue's name: ``source`` itself, or a queue URL's last segment."""
    return source.rstrip("/").rpartition("/")[2] if "://" in source else source


def _sqs_source(label: str, values: Mapping[str, Any]) -> None:
    if values.get("transport") != "sqs":
        return
    source = values["source"]
    if "://" in source and not source.startswith(("https://", "http://")):
        raise ConfigError(f"{label}: key 'source' must be a queue name or an http(s):// queue URL")
    if "://" in source and "@" in urlsplit(source).netloc:
        raise ConfigError(
            f"{label}: key 'source': a queue URL carries no credentials: AWS's chain gives them"
            " (environment, profile, role)"
        )
    if not _SQS_QUEUE_NAME.fullmatch(sqs_queue_name(source)):
        raise ConfigError(
            f"{label}: key 'source' = {source!r} is no SQS queue name (or URL ending in one): up to 80"
            " letters, digits, '-' and '_', a FIFO queue's ending in '.fifo'"
        )


def _source_rule(label: str, values: Mapping[str, Any]) -> None:
    _jetstream_names(label, values)
    _sqs_source(label, values)
    _cluster_source(label, values)


def hash_tag(key: str) -> str | None:
    """What Redis Cluster hashes of ``key`` in place of the whole key: the
    text between its first ``{`` and the first ``}`` after it, when that is
    not empty (``queue:{jobs}:in`` hashes as ``jobs``); None: the whole key
    is hashed."""
    start = key.find("{")
    end = key.find("}", start + 1) if start >= 0 else -1
    return key[start + 1 : end] if end > start + 1 else None


def list_key_base(source: str, *, cluster: bool = False) -> str:
    """What a list adapter's derived keys (processing lists, consumers,
    heartbeats, recovery locks, removed-markers) begin with
    (:mod:`ingest.adapters.redis.lists` draws the layout): the list's name;
    on a Redis Cluster, a name with no hash tag of its own wrapped in one
    (``jobs``: ``{jobs}``), and a name with one (``{jobs}``,
    ``queue:{jobs}:in``) as it is, its tag pinning every derived key to its
    slot. Config refuses the names neither form keeps in their slot
    (``_cluster_source``), and two lists of one cluster whose keys these
    forms would merge (``jobs`` and ``{jobs}``, ``_list_keys_apart``)."""
    return f"{{{source}}}" if cluster and hash_tag(source) is None else source


def _cluster_source(label: str, values: Mapping[str, Any]) -> None:
    """On a cluster, every key a list adapter derives must hash to the
    list's slot (BLMOVE, the guarded LREM and recovery never span two). A
    name with no hash tag but a '}' (``jobs}``, ``{}jobs``, whose empty
    '{}' is no tag) cannot be wrapped in a tag that hashes as it does."""
    source = values["source"]
    if not values.get("cluster") or values["mode"] != "list":
        return
    derived = f"{list_key_base(source, cluster=True)}:processing:c"
    if hash_tag(derived) != (hash_tag(source) or source):
        raise ConfigError(
            f"{label}: key 'source' = {source!r}: on a cluster (cluster = true) a list's processing lists"
            " are named '{source}:processing:...' to share its hash slot, which a name holding '}' and no"
            " hash tag would not: give the name a hash tag of its own ('{jobs}', 'queue:{jobs}:in') or no"
            " braces"
        )


def _ack_after(where: str, value: Any) -> str:
    if value not in ACK_AFTER:
        raise ConfigError(f'{where} must be "store" or "complete" {got(value, ACK_AFTER)}')
    return str(value)


def _complete_needs_an_ack(label: str, values: Mapping[str, Any]) -> None:
    if values["mode"] == "pubsub" and values["ack_after"] == "complete":
        raise ConfigError(
            f'{label}: key \'ack_after\' = "complete" does not apply to mode = "pubsub": a pub/sub'
            " message has no broker ack to defer"
        )
    if values["mode"] == "jetstream" and values["ack_after"] == "complete":
        raise ConfigError(
            f'{label}: key \'ack_after\' = "complete" does not apply to mode = "jetstream": JetStream'
            " delivers a message again once it is unacked for ack_wait_ms, so an ack held for its todo's"
            ' whole run would bring it back every ack_wait_ms; use ack_after = "store"'
        )
    if values.get("transport") == "sqs" and values["ack_after"] == "complete":
        raise ConfigError(
            f'{label}: key \'ack_after\' = "complete" does not apply to transport = "sqs": a message not'
            " deleted within its visibility timeout (ack_wait_ms) is received again, so a delete held for"
            ' its todo\'s whole run would bring it back every ack_wait_ms; use ack_after = "store"'
        )
    if values.get("transport") == "amqp" and values["ack_after"] == "complete":
        raise ConfigError(
            f'{label}: key \'ack_after\' = "complete" does not apply to transport = "amqp": the ack would'
            " be held on the ingester's channel for the todo's whole run, where RabbitMQ's consumer_timeout"
            " (30 minutes by default) closes the channel and requeues all it holds, and the held deliveries"
            ' fill the prefetch and stop consumption; use ack_after = "store"'
        )


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
AMQP_CONSUMER_TIMEOUT_MS = 1_800_000


def redelivery_horizon_ms(values: Mapping[str, Any]) -> tuple[int, str]:
    """How long after its delivery an adapter's broker may deliver a message
    again, and from which keys: the claim cycle of a stream, the reap cycle of
    a list (pub/sub never redelivers)."""
    if values["mode"] == "stream":
        return values["claim_idle_ms"] + values["claim_interval_ms"], "claim_idle_ms + claim_interval_ms"
    if values["mode"] == "list":
        return values["heartbeat_ttl_ms"] + values["reap_interval_ms"], "heartbeat_ttl_ms + reap_interval_ms"
    if values.get("transport") == "amqp":
        # A delivery comes again only once its channel ends, which RabbitMQ
        # forces on a delivery held unacked past its consumer_timeout.
        return AMQP_CONSUMER_TIMEOUT_MS, "RabbitMQ's consumer_timeout (30 minutes by default)"
    if values["mode"] in ("jetstream", "queue"):
        return values["ack_wait_ms"], "ack_wait_ms"
    return 0, "no redelivery (pub/sub)"


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
            rule=_pubsub_is_at_most_once,
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
            rule=_complete_needs_an_ack,
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
            REDIS_MODES,
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
            default_doc="the transport's name: `redis`, `nats`, `sqs`, `amqp`",
        ),
    ] = DEFAULT_PREFIX
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
            rule=_source_rule,
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
            default_doc=DEFAULT_BROKER,
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
        source = sqs_queue_name(self.source) if self.transport == "sqs" else self.source
        return native_key(self.key_prefix, source, "")

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
    table: Mapping[str, Any], redis_url: str, env: Mapping[str, str] | None = None
) -> AdapterConfig:
    """One ``[[adapters]]`` table, read and checked as a config file's are;
    ``redis_url`` where a Redis adapter names no ``url`` (a NATS adapter's
    default is ``SWITCHBOARD_NATS_URL`` in ``env``, else the built-in). A
    ``schema`` path is taken relative to the working directory."""
    return _adapter(0, table, redis_url, Path.cwd(), env or {})


def read_adapters(
    raw: Mapping[str, Any],
    default_redis_url: str,
    base_dir: Path,
    env: Mapping[str, str],
    *,
    redis_cluster: bool = False,
) -> tuple[AdapterConfig, ...]:
    """The file's ``[[adapters]]``, each read, then checked against the others.
    ``redis_cluster``: ``[redis] cluster``, the default of ``cluster`` for
    the Redis adapters that use ``[redis] url``."""
    adapters = tuple(
        _adapter(i, a, default_redis_url, base_dir, env, redis_cluster=redis_cluster)
        for i, a in enumerate(adapter_tables(raw))
        if not is_webhook(a)
    )
    names = [a.name for a in adapters]
    for n in names:
        if names.count(n) > 1:
            raise ConfigError(f"adapter {n!r}: key 'name' is used by more than one adapter")
    _check_one_reader_each(adapters)
    _list_keys_apart(adapters)
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
    index: int,
    raw: Any,
    default_redis_url: str,
    base_dir: Path,
    env: Mapping[str, str],
    *,
    redis_cluster: bool = False,
) -> AdapterConfig:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"adapters[{index}]: must be a table")
    name = raw.get("name")
    label = f"adapter {name!r}" if isinstance(name, str) and name else f"adapters[{index}]"
    # The defaults that depend on the rest.
    values = ADAPTERS.read(
        label,
        raw,
        defaults={
            "queue": name,
            **_transport_defaults(raw, default_redis_url, env, redis_cluster=redis_cluster),
        },
    )
    # Only the processes that connect to this broker need the variables (the
    # ingester's and the acker's, per role): a missing one is raised when one does.
    values["broker"] = BrokerUrl.resolve(label, values["broker"], env, **_credential_variables(label, values))
    return AdapterConfig(**{**values, **_body_schema(label, values, base_dir)})


def _credential_variables(label: str, values: Mapping[str, Any]) -> dict[str, str | None]:
    """The variables whose values complete the URL. A NATS token is a URL's
    user name without a password (nats-py reads it so), so ``token_env``
    fills that place and excludes the other two. SQS takes none: AWS
    credentials come from AWS's own chain (environment, profile, role)."""
    if values["transport"] == "sqs":
        for key in ("username_env", "password_env"):
            if values[key] is not None:
                raise ConfigError(
                    f"{label}: key {key!r} does not apply to transport = 'sqs': AWS credentials come from"
                    " the AWS chain (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, AWS_PROFILE, an instance"
                    " or task role), never from the config"
                )
        return {"username_env": None, "password_env": None}
    if values.get("token_env") is None:
        return {"username_env": values["username_env"], "password_env": values["password_env"]}
    if values["username_env"] is not None or values["password_env"] is not None:
        raise ConfigError(f"{label}: key 'token_env' excludes 'username_env' and 'password_env': use one way")
    return {"username_env": values["token_env"], "password_env": None}


def _transport_defaults(
    raw: Mapping[str, Any], redis_url: str, env: Mapping[str, str], *, redis_cluster: bool = False
) -> dict[str, Any]:
    """The mode, url and key prefix an adapter of its transport has when its
    table names none (an unknown transport is refused by its own key)."""
    transport = raw.get("transport", "redis")
    if transport == "nats":
        url = env.get(NATS_URL_VARIABLE) or DEFAULT_NATS_URL
        return {"mode": TRANSPORT_MODES["nats"][0], "url": url, "key_prefix": DEFAULT_PREFIXES["nats"]}
    if transport == "sqs":
        url = env.get(SQS_URL_VARIABLE) or AWS_ENDPOINT
        return {"mode": TRANSPORT_MODES["sqs"][0], "url": url, "key_prefix": DEFAULT_PREFIXES["sqs"]}
    if transport == "amqp":
        url = env.get(AMQP_URL_VARIABLE) or DEFAULT_AMQP_URL
        return {"mode": TRANSPORT_MODES["amqp"][0], "url": url, "key_prefix": DEFAULT_PREFIXES["amqp"]}
    # [redis] cluster describes [redis] url: an adapter with a url of its
    # own says itself whether that is a cluster.
    return {"url": redis_url, "cluster": redis_cluster and "url" not in raw}


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
    logs in, and the source there. An SQS queue URL names its account and
    region; a queue name, with the endpoint and the region."""
    source = a.source
    if a.transport == "sqs" and "://" not in source:
        source = f"{a.region or ''}:{source}"
    return (a.transport, a.mode, *a.broker.identity(), source)


def _check_one_reader_each(adapters: tuple[AdapterConfig, ...]) -> None:
    """Two adapters reading one stream with one consumer group (or one list)
    split its messages between them at random, and after a crash a message
    can reach both, as work in two queues: refused. Fan-out on a stream is
    distinct groups; pub/sub delivers every message to every subscriber."""
    readers: dict[tuple[str, ...], AdapterConfig] = {}
    for a in adapters:
        if a.mode == "stream":
            what = (*source_identity(a), a.group)
            key, read = "group", f"stream {a.source!r} with group {a.group!r}"
            hint = "fan-out needs a distinct group"
        elif a.mode == "jetstream":
            what = (*source_identity(a), a.group)
            key, read = "group", f"JetStream stream {a.source!r} with durable consumer {a.group!r}"
            hint = "fan-out needs a distinct group"
        elif a.transport == "sqs":
            what = source_identity(a)
            key, read = "source", f"SQS queue {sqs_queue_name(a.source)!r}"
            hint = "one adapter per queue (fan-out is SNS to several queues); run more ingesters for more"
        elif a.transport == "amqp":
            what = source_identity(a)
            key, read = "source", f"AMQP queue {a.source!r}"
            hint = (
                "one adapter per queue (fan-out is an exchange bound to several queues); run more ingesters"
            )
        elif a.mode == "list":
            what = source_identity(a)
            key, read = "source", f"list {a.source!r}"
            hint = "one adapter per list; run more ingesters for more consumers"
        else:
            continue
        first = readers.setdefault(what, a)
        if first is not a:
            raise ConfigError(
                f"adapter {a.name!r}: key {key!r}: adapter {first.name!r} already reads {read}"
                f" on the same broker; {hint}"
            )


def _list_keys_apart(adapters: tuple[AdapterConfig, ...]) -> None:
    """Two lists of one broker whose derived keys would be the same (on a
    cluster, ``jobs`` wraps into ``{jobs}``, the very name of the list
    ``{jobs}``): their consumers would move onto one processing list, and
    each recovery would redeliver the other's messages as its own. Refused;
    the lists themselves stay apart by :func:`_check_one_reader_each`. A
    cluster is known by its ``url``: two adapters naming two of its nodes
    are not compared."""
    bases: dict[tuple[str, ...], AdapterConfig] = {}
    for a in adapters:
        if a.mode != "list":
            continue
        base = list_key_base(a.source, cluster=a.cluster)
        first = bases.setdefault((*a.broker.identity(), base), a)
        if first is not a:
            raise ConfigError(
                f"adapter {a.name!r}: key 'source' = {a.source!r}: its processing lists would be those of"
                f" the list {first.source!r} of adapter {first.name!r} on the same broker"
                f" ({base}:processing:...), and each adapter's recovery would take the other's messages:"
                " rename one list"
            )
