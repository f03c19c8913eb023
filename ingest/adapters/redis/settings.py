"""The Redis transport as the config reads it (its client imported only to
read a URL's query, as it will): its
modes, its URL, its rules, and the key layout a list's derived keys share
on a Redis Cluster. Registered in :mod:`ingest.config.transports`."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Annotated, Any
from urllib.parse import SplitResult, urlsplit

from ingest.config import transport
from ingest.config.keys import Key, Section, got
from ingest.config.network import Unencrypted, unencrypted_at
from ingest.config.url_shape import checked_url
from ingest.errors import ConfigError

NAME = "redis"
DEFAULT_PORT = 6379
URL_VARIABLE = "SWITCHBOARD_REDIS_URL"

# What redis-py reads from a URL's query (redis.asyncio.connection.parse_url, with
# which it builds its connections); TLS options only for rediss://. Any other
# key would reach the connection as an unexpected keyword and fail there.
_QUERY = frozenset(
    {
        "db", "socket_timeout", "socket_connect_timeout", "socket_read_size", "socket_keepalive",
        "retry_on_timeout", "max_connections", "health_check_interval", "timeout", "protocol",
        "client_name",
    }
)  # fmt: skip
_TLS_QUERY = frozenset(
    {
        "ssl_ca_certs", "ssl_ca_path", "ssl_ca_data", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs",
        "ssl_password", "ssl_check_hostname", "ssl_min_version", "ssl_include_verify_flags",
        "ssl_exclude_verify_flags",
    }
)  # fmt: skip


def _query_problem(url: str) -> str | None:
    """A query parameter redis-py would not take, or take badly; never named
    from the URL itself, which may hold a piece of a password."""
    parts = urlsplit(url)
    allowed = _QUERY | (_TLS_QUERY if parts.scheme == "rediss" else frozenset())
    items = [item.partition("=") for item in parts.query.split("&") if item]
    if {key for key, _, _ in items} - allowed:
        return f"has a query parameter redis-py does not take (allowed: {', '.join(sorted(allowed))})"
    # redis-py's own reading of the values (a base dependency, imported
    # here only when a Redis URL is checked).
    from redis.asyncio.connection import parse_url

    try:
        parse_url(url)
    except ValueError:
        return "has a query parameter whose value redis-py cannot read (a number or a boolean)"
    return None


def check_url(where: str, value: Any) -> str:
    """A Redis URL, checked without ever echoing it: ``where`` names where
    it came from (a config key, or the environment variable)."""
    return checked_url(
        where, value, ("redis", "rediss", "unix"), "a redis://, rediss:// or unix:// URL", _query_problem
    )


def url_identity(parts: SplitResult) -> tuple[str, ...]:
    """The server and database a Redis URL reaches."""
    if parts.scheme == "unix":
        return ("unix", parts.path)
    db = parts.path.strip("/") or "0"
    for item in parts.query.split("&"):
        key, _, value = item.partition("=")
        if key == "db":
            db = value
    return (parts.hostname or "localhost", str(parts.port or DEFAULT_PORT), db)


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
    slot. The rules below refuse the names neither form keeps in their slot
    (``_cluster_source``), and two lists of one cluster whose keys these
    forms would merge (``jobs`` and ``{jobs}``, ``_list_keys_apart``)."""
    return f"{{{source}}}" if cluster and hash_tag(source) is None else source


def _pubsub_is_at_most_once(label: str, values: transport.Values) -> None:
    if values["mode"] == "pubsub" and values["delivery"] != "at-most-once":
        raise ConfigError(
            f'{label}: key \'delivery\' must be "at-most-once" for mode = "pubsub": pub/sub has no '
            "redelivery and loses messages published while the ingester is down"
        )


def _complete_needs_an_ack(label: str, values: transport.Values) -> None:
    if values["mode"] == "pubsub" and values["ack_after"] == "complete":
        raise ConfigError(
            f'{label}: key \'ack_after\' = "complete" does not apply to mode = "pubsub": a pub/sub'
            " message has no broker ack to defer"
        )


def _cluster_source(label: str, values: transport.Values) -> None:
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


def _redelivery_horizon(values: transport.Values) -> tuple[int, str]:
    """The claim cycle of a stream, the reap cycle of a list; pub/sub never
    redelivers."""
    if values["mode"] == "stream":
        return values["claim_idle_ms"] + values["claim_interval_ms"], "claim_idle_ms + claim_interval_ms"
    if values["mode"] == "list":
        return values["heartbeat_ttl_ms"] + values["reap_interval_ms"], "heartbeat_ttl_ms + reap_interval_ms"
    return 0, "no redelivery (pub/sub)"


def _reader(a: transport.Adapter, identity: tuple[str, ...]) -> transport.Reader | None:
    """A stream is read once per group (fan-out is distinct groups); a list
    once; pub/sub delivers every message to every subscriber."""
    if a.mode == "stream":
        group = options(a).group
        return transport.Reader.per_group(identity, group, f"stream {a.source!r} with group {group!r}")
    if a.mode == "list":
        return transport.Reader.per_source(
            identity, f"list {a.source!r}", "one adapter per list; run more ingesters for more consumers"
        )
    return None


def _list_keys_apart(adapters: Sequence[transport.Adapter]) -> None:
    """Two lists of one broker whose derived keys would be the same (on a
    cluster, ``jobs`` wraps into ``{jobs}``, the very name of the list
    ``{jobs}``): their consumers would move onto one processing list, and
    each recovery would redeliver the other's messages as its own. Refused;
    the lists themselves stay apart by the one-reader check. A cluster is
    known by its ``url``: two adapters naming two of its nodes are not
    compared."""
    bases: dict[tuple[str, ...], transport.Adapter] = {}
    for a in adapters:
        if a.mode != "list":
            continue
        base = list_key_base(a.source, cluster=options(a).cluster)
        first = bases.setdefault((*a.broker.identity(), base), a)
        if first is not a:
            raise ConfigError(
                f"adapter {a.name!r}: key 'source' = {a.source!r}: its processing lists would be those of"
                f" the list {first.source!r} of adapter {first.name!r} on the same broker"
                f" ({base}:processing:...), and each adapter's recovery would take the other's messages:"
                " rename one list"
            )


def _table_defaults(raw: transport.Values, default: transport.DefaultBroker) -> dict[str, Any]:
    """``[redis] cluster`` describes ``[redis] url``: an adapter with a url
    of its own says itself whether that is a cluster (a default of its own
    key ``cluster``)."""
    return {"cluster": default.cluster and "url" not in raw}


def _default_url(env: Mapping[str, str], default: transport.DefaultBroker) -> str:
    return default.url


STREAM = ("stream",)
LIST = ("list",)
PUBSUB = ("pubsub",)
DELIVERIES = ("at-least-once", "at-most-once")
_START_ID = re.compile(r"\$|\d+(-\d+)?")


def _delivery(where: str, value: Any) -> str:
    if value not in DELIVERIES:
        raise ConfigError(f'{where} must be "at-least-once" or "at-most-once" {got(value, DELIVERIES)}')
    return str(value)


def _start_id(where: str, value: Any) -> str:
    if not isinstance(value, str) or not _START_ID.fullmatch(value):
        raise ConfigError(f"{where} must be '0', '$' or a stream id (got {value!r})")
    return value


@dataclass(frozen=True, slots=True, kw_only=True)
class RedisOptions:
    """A Redis adapter's own keys (``AdapterConfig.options``)."""

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
            rule=_cluster_source,
            doc="the Redis is a Redis (or Valkey) Cluster: keys live in slots, a list's processing lists and"
            " markers share its hash slot ([transports.md](transports.md#redis-cluster))",
        ),
    ] = False
    group: Annotated[str, Key(STREAM, doc="the consumer group, created with MKSTREAM when missing")] = (
        "switchboard"
    )
    body_field: Annotated[
        str, Key(STREAM, doc="the field holding the message; entries without it are taken as their field map")
    ] = "body"
    claim_idle_ms: Annotated[
        int, Key(STREAM, doc="claim (XCLAIM) entries idle longer than this (keep well above ack lag)")
    ] = 60_000
    claim_interval_ms: Annotated[int, Key(STREAM, doc="how often the claim sweep runs")] = 5_000
    heartbeat_ttl_ms: Annotated[
        int, Key(LIST, minimum=1000, doc="a consumer silent this long is dead; its processing list is reaped")
    ] = 30_000
    reap_interval_ms: Annotated[int, Key(LIST, doc="how often dead consumers' lists are checked")] = 5_000


def options(adapter: transport.Adapter) -> RedisOptions:
    """``adapter``'s own keys."""
    return transport.options_of(adapter, RedisOptions)


KEYS = transport.own_keys(NAME, RedisOptions, "the Redis adapters (`stream`, `list` and `pubsub` modes)")


DEFAULT_URL = "redis://localhost:6379/0"


@dataclass(frozen=True, slots=True)
class RedisTable:
    """``[redis]``: the file's own broker, that of the adapters naming no
    ``url`` (:class:`~ingest.config.transport.DefaultBroker`)."""

    url: Annotated[
        str,
        Key(
            parse=check_url,
            env=URL_VARIABLE,
            doc=f"the broker of adapters without their own `url`; `{URL_VARIABLE}` takes its place",
        ),
    ] = DEFAULT_URL
    cluster: Annotated[
        bool,
        Key(
            doc="`url` is a Redis (or Valkey) Cluster: the default of `cluster` for the adapters that use"
            " `url`",
        ),
    ] = False


def plaintext(url: str, own: RedisOptions | None) -> Unencrypted | None:
    """A Redis server if remote and reached by ``redis://`` (not ``rediss://``)."""
    return unencrypted_at(
        url, {"redis": DEFAULT_PORT}, "use rediss:// with ssl_ca_certs=... in the broker URL"
    )


# A stream entry id as stored: milliseconds, a dash, a sequence number.
ENTRY_ID = re.compile(r"^([0-9]+)-([0-9]+)$")


def _sent(mode: str | None, ack_kind: str | None, message_id: str | None) -> transport.Sent | None:
    """A stream entry id is ``<ms>-<seq>``, the milliseconds being Redis's
    clock when the producer's XADD ran; a list or pub/sub message has no id
    that is a time."""
    if mode != "stream" and ack_kind != "xack":
        return None
    match = ENTRY_ID.match(message_id or "")
    if match is None:
        return None
    try:
        at = datetime.fromtimestamp(int(match.group(1)) / 1000, UTC)
    except (OverflowError, ValueError, OSError):  # an explicit id far beyond any clock
        return None
    return transport.Sent(at, f"XADD {message_id} (the entry id's time, on Redis's clock)", "xadd")


_NAMED_FIGURES = transport.figures_named(
    {"stream_length": "held", "lag": "backlog", "broker_pending": "in_flight", "list_length": "list_backlog"}
)


def _figures(described: transport.Values) -> dict[transport.Figure, float]:
    """A stream's length, lag and PEL; a list's length, and the sum of its
    consumers' processing lists."""
    figures = dict(_NAMED_FIGURES(described))
    consumers = described.get("consumers")
    if isinstance(consumers, Mapping):
        lengths = [c.get("processing_length") for c in consumers.values() if isinstance(c, Mapping)]
        figures["processing"] = float(sum(n for n in lengths if isinstance(n, int)))
    return figures


DEFINITION = transport.TransportDefinition(
    name=NAME,
    modes=("stream", "list", "pubsub"),
    keys=KEYS,
    client_packages=("redis",),
    sent=_sent,
    bare_id=ENTRY_ID,
    file_table=Section("[redis]", RedisTable),
    default_url_value=DEFAULT_URL,
    key_prefix="redis",
    url_schemes=("redis", "rediss", "unix"),
    check_url=check_url,
    plaintext=plaintext,
    url_identity=url_identity,
    default_url=_default_url,
    default_url_doc=f"Redis `{URL_VARIABLE}`, else `[redis] url`",
    variables={URL_VARIABLE: "Redis adapters' URL when theirs is not set, over [redis] url"},
    rules={"ack_after": _complete_needs_an_ack},
    table_defaults=_table_defaults,
    redelivery_horizon=_redelivery_horizon,
    reader=_reader,
    across=_list_keys_apart,
    figures=_figures,
)
