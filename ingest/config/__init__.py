"""Settings: one frozen object built at process start from the TOML file and
the environment (DESIGN.md section 7), validated with messages that name the
adapter and the key. Nothing here runs at import time.

Each setting is defined once, as an attribute of its dataclass: the type, the
default and, for an adapter, an ``Annotated`` :class:`Key` with its bounds and
the modes it applies to. The allowed keys, the checks and an adapter's public
settings are all read from those definitions (see :func:`_adapter_settings`)."""

from __future__ import annotations

import dataclasses
import functools
import re
import socket
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin, get_type_hints
from urllib.parse import quote, urlsplit, urlunsplit

from redis.asyncio.connection import parse_url
from sqlalchemy.engine import make_url

from backhalf.body_schema import DEFAULT_SCHEMA_TIMEOUT_MS, BodySchema, SchemaFileError
from backhalf.db import DatabaseSettings, normalize_url
from backhalf.keys import DEFAULT_PREFIX
from backhalf.normalize import DEFAULT_MAX_MESSAGE_BYTES, BodyFormat
from backhalf.queues import QueueConfig
from ingest.errors import ConfigError

DEFAULT_CONFIG_PATH = "switchboard.toml"
DEFAULT_REDIS_URL = "redis://localhost:6379/0"
DATABASE_URL_VARIABLE = "SWITCHBOARD_DATABASE_URL"
REDIS_URL_VARIABLE = "SWITCHBOARD_REDIS_URL"
METRICS_PORT_VARIABLE = "SWITCHBOARD_METRICS_PORT"
MODES = ("stream", "list", "pubsub")
STREAM = ("stream",)
LIST = ("list",)
PUBSUB = ("pubsub",)


@dataclass(frozen=True, slots=True)
class Key:
    """How an :class:`AdapterConfig` attribute is read from an ``[[adapters]]``
    table; its type and default are the rest of its definition.

    ``modes`` says where a key applies: given for another mode it is an
    error naming the adapter and the key, and only where it applies is it
    published. ``parse`` replaces the check that follows from
    the type (``int``: an integer within ``minimum`` and ``maximum``; ``str``: a
    non-empty string), for keys whose values are a choice. ``rule`` runs after
    the key, given or not, with the values read so far: a rule across keys."""

    modes: tuple[str, ...] = MODES
    minimum: int = 1
    maximum: int | None = None
    public: bool = True  # published in ``adapters.settings``
    toml: str | None = None  # the key in the table, if not the attribute's name
    parse: Callable[[str, Any], Any] | None = None
    rule: Callable[[str, Mapping[str, Any]], None] | None = None


class Derived:
    """Marks an attribute that is no key: it is computed from other keys."""


def _string(where: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where}: must be a non-empty string (got {value!r})")
    return value


def _positive_int(where: str, value: Any, *, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{where}: must be an integer >= {minimum} (got {value!r})")
    return value


def _number(where: str, value: Any, kind: type) -> Any:
    """A positive number of the field's declared type: a ``float`` field takes
    an integer or a fraction, an ``int`` field only an integer."""
    allowed = (int, float) if kind is float else (int,)
    if isinstance(value, bool) or not isinstance(value, allowed) or value <= 0:
        noun = "number" if kind is float else "integer"
        raise ConfigError(f"{where}: must be a positive {noun} (got {value!r})")
    return value


def _database_number(where: str, value: Any, kind: type) -> Any:
    # A [database] integer's message has always named its minimum.
    return _positive_int(where, value) if kind is int else _number(where, value, kind)


def _mode(where: str, value: Any) -> str:
    if value not in MODES:
        raise ConfigError(f"{where} must be one of {', '.join(MODES)} (got {value!r})")
    return str(value)


def _delivery(where: str, value: Any) -> str:
    if value not in ("at-least-once", "at-most-once"):
        raise ConfigError(f'{where} must be "at-least-once" or "at-most-once" (got {value!r})')
    return str(value)


def _pubsub_is_at_most_once(label: str, values: Mapping[str, Any]) -> None:
    if values["mode"] == "pubsub" and values["delivery"] != "at-most-once":
        raise ConfigError(
            f'{label}: key \'delivery\' must be "at-most-once" for mode = "pubsub": pub/sub has no '
            "redelivery and loses messages published while the ingester is down"
        )


def _transport(where: str, value: Any) -> str:
    if value != "redis":
        raise ConfigError(f'{where} must be "redis" (got {value!r})')
    return "redis"


def _ack_after(where: str, value: Any) -> str:
    if value not in ("store", "complete"):
        raise ConfigError(f'{where} must be "store" or "complete" (got {value!r})')
    return str(value)


def _complete_needs_an_ack(label: str, values: Mapping[str, Any]) -> None:
    if values["mode"] == "pubsub" and values["ack_after"] == "complete":
        raise ConfigError(
            f'{label}: key \'ack_after\' = "complete" does not apply to mode = "pubsub": a pub/sub'
            " message has no broker ack to defer"
        )


def _format(where: str, value: Any) -> BodyFormat:
    try:
        return BodyFormat(value)
    except ValueError as exc:
        raise ConfigError(f"{where} must be json, text or bytes (got {value!r})") from exc


_START_ID = re.compile(r"\$|\d+(-\d+)?")


def _start_id(where: str, value: Any) -> str:
    if not isinstance(value, str) or not _START_ID.fullmatch(value):
        raise ConfigError(f"{where} must be '0', '$' or a stream id (got {value!r})")
    return value


# Messages about a URL never quote it, nor any piece of it: a password with an
# unencoded reserved character is split at that character by every parser, so
# a "host" or "port" read from such a URL may be part of the password.
_ENCODE_RULE = (
    "a reserved character in the password must be percent-encoded"
    " (@ as %40, / as %2F, ? as %3F, # as %23, % as %25, a space as %20)"
)


def _url_shape_problem(url: str) -> str | None:
    """Why ``url`` cannot be split into its parts as intended, or None."""
    if any(c.isspace() for c in url):
        return f"contains whitespace; {_ENCODE_RULE}"
    try:
        parts = urlsplit(url)
        _ = parts.port  # raises ValueError: a port that is no number, or out of range
    except ValueError:
        return f"has a port that is not a number, or {_ENCODE_RULE}"
    # An unencoded '?' or '#' in the password moves the rest of the URL, its
    # '@' included, into the query or the fragment.
    moved = (parts.path, parts.query, parts.fragment)
    if parts.netloc.count("@") > 1 or any("@" in piece for piece in moved):
        return _ENCODE_RULE
    return None


# What redis-py reads from a URL's query (redis.asyncio.connection.parse_url, with
# which it builds its connections); TLS options only for rediss://. Any other
# key would reach the connection as an unexpected keyword and fail there.
_REDIS_QUERY = frozenset(
    {
        "db", "socket_timeout", "socket_connect_timeout", "socket_read_size", "socket_keepalive",
        "retry_on_timeout", "max_connections", "health_check_interval", "timeout", "protocol",
        "client_name",
    }
)  # fmt: skip
_REDIS_TLS_QUERY = frozenset(
    {
        "ssl_ca_certs", "ssl_ca_path", "ssl_ca_data", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs",
        "ssl_password", "ssl_check_hostname", "ssl_min_version", "ssl_include_verify_flags",
        "ssl_exclude_verify_flags",
    }
)  # fmt: skip


def _redis_query_problem(url: str) -> str | None:
    """A query parameter redis-py would not take, or take badly; never named
    from the URL itself, which may hold a piece of a password."""
    parts = urlsplit(url)
    allowed = _REDIS_QUERY | (_REDIS_TLS_QUERY if parts.scheme == "rediss" else frozenset())
    keys = {item.partition("=")[0] for item in parts.query.split("&") if item}
    if keys - allowed:
        return f"has a query parameter redis-py does not take (allowed: {', '.join(sorted(allowed))})"
    try:
        parse_url(url)
    except ValueError:
        return "has a query parameter whose value redis-py cannot read (a number or a boolean)"
    return None


def check_redis_url(where: str, value: Any) -> str:
    """A broker URL, checked without ever echoing it: ``where`` names where
    it came from (a config key, or the environment variable)."""
    url = _string(where, value)
    if urlsplit(url).scheme not in ("redis", "rediss", "unix"):
        raise ConfigError(f"{where} must be a redis://, rediss:// or unix:// URL")
    problem = _url_shape_problem(url) or _redis_query_problem(url)
    if problem is not None:
        raise ConfigError(f"{where} is not a valid URL: {problem}")
    return url


_redis_url = check_redis_url

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _env_name(where: str, value: Any) -> str:
    """The name of an environment variable (a name, never a secret: quoted)."""
    if not isinstance(value, str) or not _ENV_NAME.fullmatch(value):
        raise ConfigError(f"{where} must name an environment variable: letters, digits and _ (got {value!r})")
    return value


def _optional_env_name(where: str, section: Mapping[str, Any], key: str) -> str | None:
    return _env_name(f"{where}: key {key!r}", section[key]) if key in section else None


def with_credentials(
    where: str, url: str, env: Mapping[str, str], *, username_env: str | None, password_env: str | None
) -> str:
    """``url`` with its user name and password taken from the variables
    named, so a broker password need not be written in the config file. A
    variable unset or empty is an error naming ``where``, the key and the
    variable, never a value. Each is percent-encoded into the URL, so any
    character may be in it."""
    if username_env is None and password_env is None:
        return url

    def read(key: str, variable: str) -> str:
        value = env.get(variable)
        if not value:
            raise ConfigError(
                f"{where}: key {key!r}: the environment variable {variable!r} is not set or empty"
            )
        return quote(value, safe="")

    parts = urlsplit(url)
    userinfo, at, hostinfo = parts.netloc.rpartition("@")
    # What the URL gives stays as it is written (already percent-encoded).
    user, _, password = userinfo.partition(":") if at else ("", "", "")
    if username_env is not None:
        user = read("username_env", username_env)
    if password_env is not None:
        password = read("password_env", password_env)
    userinfo = user + (f":{password}" if password else "")
    return urlunsplit(parts._replace(netloc=f"{userinfo}@{hostinfo}" if userinfo else hostinfo))


def _database_url(where: str, value: Any) -> str:
    """A PostgreSQL URL in its psycopg 3 form, checked without echoing it."""
    url = _string(where, value)
    if any(c.isspace() for c in url):
        raise ConfigError(f"{where} is not a valid URL: contains whitespace; {_ENCODE_RULE}")
    try:
        parsed = make_url(url)
    except Exception as exc:  # SQLAlchemy's URL parser raises several types; their texts quote the URL
        raise ConfigError(
            f"{where} is not a database URL ({type(exc).__name__}): the form is"
            f" postgresql://USER:PASSWORD@HOST:PORT/DATABASE, and {_ENCODE_RULE}"
        ) from exc
    if parsed.get_backend_name() not in ("postgresql", "postgres"):
        # The scheme is letters, digits and "+.-": no secret in it.
        raise ConfigError(
            f"{where} must be a PostgreSQL URL (postgresql://USER:PASSWORD@HOST:PORT/DATABASE),"
            f" not {parsed.drivername}://"
        )
    if parsed.drivername not in ("postgresql", "postgres", "postgresql+psycopg"):
        raise ConfigError(
            f"{where} must use the psycopg 3 driver (postgresql:// or postgresql+psycopg://),"
            f" not {parsed.drivername}://"
        )
    if "@" in (parsed.host or "") or "@" in (parsed.database or ""):
        raise ConfigError(f"{where} is not a valid URL: {_ENCODE_RULE}")
    return normalize_url(url)


DEFAULT_IDLE_POLL_MS = 50

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
MAX_RETAIN_DAYS = 36_500  # a century; more is a typo, and overflows a timedelta soon after


def _days(where: str, value: Any) -> float:
    """A number of days, fractional allowed (0.5 is twelve hours)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= MAX_RETAIN_DAYS:
        raise ConfigError(f"{where} must be a number of days, > 0 and <= {MAX_RETAIN_DAYS} (got {value!r})")
    return float(value)


def redelivery_horizon_ms(values: Mapping[str, Any]) -> tuple[int, str]:
    """How long after its delivery an adapter's broker may deliver a message
    again, and from which keys: the claim cycle of a stream, the reap cycle of
    a list (pub/sub never redelivers)."""
    if values["mode"] == "stream":
        return values["claim_idle_ms"] + values["claim_interval_ms"], "claim_idle_ms + claim_interval_ms"
    if values["mode"] == "list":
        return values["heartbeat_ttl_ms"] + values["reap_interval_ms"], "heartbeat_ttl_ms + reap_interval_ms"
    return 0, "no redelivery (pub/sub)"


def _retention_rule(key: str) -> Callable[[str, Mapping[str, Any]], None]:
    def covers_redelivery(label: str, values: Mapping[str, Any]) -> None:
        days = values.get(key)
        if days is None:
            return
        horizon_ms, keys = redelivery_horizon_ms(values)
        minimum_ms = max(RETENTION_HORIZON_FACTOR * horizon_ms, RETENTION_FLOOR_MS)
        if days * DAY_MS < minimum_ms:
            raise ConfigError(
                f"{label}: key {key!r} ({days:g} days) is shorter than the adapter can redeliver: an entry"
                f" is deduplicated only while its inbox row is kept, and {keys} is {horizon_ms} ms; keep"
                f" rows at least {RETENTION_HORIZON_FACTOR}x that and at least"
                f" {RETENTION_FLOOR_MS // 60_000} minutes ({minimum_ms / DAY_MS:.6g} days)"
            )

    return covers_redelivery


@dataclass(frozen=True, slots=True, kw_only=True)
class AdapterConfig:
    """One ``[[adapters]]`` table. The attributes are declared in the order
    their keys are checked: of several errors in a table, the first declared
    is reported."""

    name: Annotated[str, Key(public=False)]
    mode: Annotated[str, Key(public=False, parse=_mode)] = "stream"  # its own column
    delivery: Annotated[str | None, Key(PUBSUB, parse=_delivery, rule=_pubsub_is_at_most_once)] = None
    transport: Annotated[str, Key(public=False, parse=_transport)] = "redis"  # its own column
    ack_after: Annotated[Literal["store", "complete"], Key(parse=_ack_after, rule=_complete_needs_an_ack)] = (
        "store"
    )
    format: Annotated[BodyFormat, Key(parse=_format)] = BodyFormat.JSON
    start_id: Annotated[str, Key(STREAM, parse=_start_id)] = "0"
    group: Annotated[str, Key(STREAM)] = "switchboard"
    consumer: str = field(default_factory=socket.gethostname)
    key_prefix: str = DEFAULT_PREFIX
    body_field: Annotated[str, Key(STREAM)] = "body"
    batch_size: Annotated[int, Key(maximum=10_000)] = 500
    block_ms: int = 1000
    claim_idle_ms: Annotated[int, Key(STREAM)] = 60_000
    claim_interval_ms: Annotated[int, Key(STREAM)] = 5_000
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    # A consumer silent this long is dead.
    heartbeat_ttl_ms: Annotated[int, Key(LIST, minimum=1000)] = 30_000
    # Delivered this often and never stored: rejected as poison.
    max_deliveries: Annotated[int, Key(minimum=3)] = 10
    # How often dead consumers' lists are checked.
    reap_interval_ms: Annotated[int, Key(LIST)] = 5_000
    source: str
    redis_url: Annotated[str, Key(public=False, toml="url", parse=_redis_url)]  # default: [redis] url
    # The broker's user name and password from these environment variables
    # (never from the TOML), in place of the url's; not published.
    username_env: Annotated[str | None, Key(public=False, parse=_env_name)] = None
    password_env: Annotated[str | None, Key(public=False, parse=_env_name)] = None
    queue: str  # default: the name
    # A JSON Schema file the decoded body must satisfy, else it is poison;
    # relative to the config file's directory.
    schema: Annotated[str | None, Key(parse=_string)] = None
    # A body whose validation against the schema runs longer is poison
    # (validation_timeout), so a producer cannot stall the ingester.
    schema_timeout_ms: Annotated[int, Key(minimum=1)] = DEFAULT_SCHEMA_TIMEOUT_MS
    # Retention (the acker's pruner, `switchboard prune`): stored rows whose
    # ack is done, and rejected ones (kept longer: operators replay them),
    # deleted with their events this many days after they were stored.
    # Unset: kept forever. Checked against the redelivery horizon above.
    retain_acked_days: Annotated[
        float | None, Key(parse=_days, rule=_retention_rule("retain_acked_days"))
    ] = None
    retain_rejected_days: Annotated[
        float | None, Key(parse=_days, rule=_retention_rule("retain_rejected_days"))
    ] = None
    body_schema: Annotated[BodySchema | None, Derived()] = field(default=None, compare=False, repr=False)
    # Why ``redis_url`` lacks its credentials (a username_env / password_env
    # unset), raised by whatever connects to the broker; None: complete.
    credentials_error: Annotated[str | None, Derived()] = field(default=None, compare=False, repr=False)

    def public_settings(self) -> dict[str, Any]:
        """What goes into ``adapters.settings``: the settings that apply to
        this adapter's mode, never the broker URL; an unset ``schema`` is left
        out."""
        public: dict[str, Any] = {}
        for s in _adapter_settings():
            value = getattr(self, s.attr)
            if s.key.public and self.mode in s.key.modes and value is not None:
                public[s.name] = value.value if isinstance(value, Enum) else value
        return public


@dataclass(frozen=True, slots=True)
class IngestSettings:
    shutdown_timeout_s: float = 10.0
    # A batch whose bodies add up to more is stored in several transactions,
    # each under this size, so one statement never nears PostgreSQL's 1 GB
    # message limit or its statement_timeout.
    max_batch_bytes: int = 32 * 1024 * 1024
    enabled_refresh_ms: int = 1000
    backoff_initial_ms: int = 100
    backoff_max_ms: int = 10_000
    # Store transactions of one stream adapter that may run at once (each on
    # its own connection, each one core of PostgreSQL); 1 turns overlap off.
    # List and pub/sub adapters always commit one batch at a time.
    commits_in_flight: int = 2
    # Bytes of messages one adapter may hold read and not yet committed (the
    # batch read ahead plus the commits in flight). A read asks for at most
    # as many messages as fit at max_message_bytes each, so memory is bounded
    # by bytes whatever the messages' sizes, not by batch_size alone. Each
    # byte held costs 2 to 6.5 bytes of RSS (its decoded text beside it), so
    # the default keeps a backlog of 1 MiB messages under 1 GiB, half of a
    # 2 GiB host (512 MiB took 1.2 to 3.3 GiB; docs/operating.md, "Memory is
    # bounded by bytes"; tests/unit/test_inflight_bound.py).
    max_inflight_bytes: int = 128 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class MetricsSettings:
    """``[metrics]``: the Prometheus and ``/healthz`` endpoint of ``ingest``,
    ``ack`` and ``worker``. Port 0: off."""

    port: int = 0
    # Loopback unless said otherwise: a scraper elsewhere needs "0.0.0.0"
    # (or the host's address), a choice to make, not a default to inherit.
    address: str = "127.0.0.1"
    # How often the backlog gauges (broker lag and lengths, pending acks,
    # active todos) are read: each read is a few broker calls or queries.
    refresh_interval_ms: int = 5_000


@dataclass(frozen=True, slots=True)
class AckerSettings:
    batch_size: int = 1000
    poll_interval_ms: int = 1000
    shutdown_timeout_s: float = 10.0
    backoff_initial_ms: int = 100
    backoff_max_ms: int = 10_000
    # The dispatch relay (inside `switchboard ack`): todos claimed and
    # enqueued to dramatiq per transaction.
    dispatch_batch_size: int = 500
    # The rescuer: how often it looks for stuck work, and how long a todo may
    # stay dispatched with no progress (its message lost) before it is
    # dispatched again (a queue's max_backoff_ms is added: a retry waits that
    # long at most).
    rescue_interval_ms: int = 5_000
    dispatch_timeout_ms: int = 300_000
    # Retention: how often the acker prunes (0: never; `switchboard prune`
    # still does), rows examined per batch (one short transaction each), and
    # the pause between batches that lets autovacuum and replicas keep up.
    prune_interval_ms: int = 60_000
    prune_batch_size: int = 2_000
    prune_pause_ms: int = 10


# [acker] keys for which 0 means "off" rather than nothing at all.
_ACKER_ZERO_ALLOWED = frozenset({"prune_interval_ms", "prune_pause_ms"})
# A prune batch is one short transaction: larger ones hold their locks longer
# and make WAL in bursts, for little more speed (docs/architecture.md, "Retention").
MAX_PRUNE_BATCH_SIZE = 50_000


def _acker_value(key: str, value: Any, kind: type) -> Any:
    where = f"[acker]: key {key!r}"
    if key in _ACKER_ZERO_ALLOWED and value == 0 and not isinstance(value, bool):
        return 0
    number = _number(where, value, kind)
    if key == "prune_batch_size" and number > MAX_PRUNE_BATCH_SIZE:
        raise ConfigError(f"{where} must be at most {MAX_PRUNE_BATCH_SIZE} (got {value!r})")
    return number


def _handler(where: str, value: Any) -> str:
    """``module:attribute``: imported by the worker only (ingest and ack never
    run user code), so only its shape is checked here."""
    text = _string(where, value)
    module, sep, attr = text.partition(":")
    if not sep or not module or not attr or " " in text:
        raise ConfigError(f"{where} must be 'module:function' (got {text!r})")
    return text


# dramatiq's TimeLimit looks at running actors once a second: a lease must
# outlast the limit by more than that, or a run on time could be rescued.
LEASE_MARGIN_MIN_MS = 2_000
_DRAMATIQ_QUEUE_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9._-]*")
_QUEUE_INTS = ("max_attempts", "time_limit_ms", "min_backoff_ms", "max_backoff_ms", "lease_margin_ms")
_QUEUE_DAYS = ("retain_done_days", "retain_failed_days")


def _queue(name: str, raw: Any) -> QueueConfig:
    where = f"[queues.{name}]"
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: must be a table")
    _check_keys(where, raw, {"handler", "dramatiq_queue", *_QUEUE_INTS, *_QUEUE_DAYS})
    if "handler" not in raw:
        raise ConfigError(f"{where}: key 'handler' is required ('module:function' that does the todos)")
    values: dict[str, Any] = {"handler": _handler(f"{where}: key 'handler'", raw["handler"])}
    for key in _QUEUE_INTS:
        if key in raw:
            minimum = LEASE_MARGIN_MIN_MS if key == "lease_margin_ms" else 1
            values[key] = _positive_int(f"{where}: key {key!r}", raw[key], minimum=minimum)
    for key in _QUEUE_DAYS:
        if key in raw:
            values[key] = _days(f"{where}: key {key!r}", raw[key])
    if "dramatiq_queue" in raw:
        values["dramatiq_queue"] = _string(f"{where}: key 'dramatiq_queue'", raw["dramatiq_queue"])
    queue = QueueConfig(name=name, **values)
    if not _DRAMATIQ_QUEUE_NAME.fullmatch(queue.broker_queue):
        # dramatiq refuses it when the worker declares the actor, and a
        # refusal at worker boot is only logged: the queue would go unserved.
        key = "dramatiq_queue" if queue.dramatiq_queue else "the queue's name"
        raise ConfigError(
            f"{where}: {key} {queue.broker_queue!r} is not a dramatiq queue name (letters, digits, '.', '_',"
            " '-', not starting with a digit, '.' or '-'): set dramatiq_queue"
        )
    if queue.min_backoff_ms > queue.max_backoff_ms:
        raise ConfigError(
            f"{where}: key 'min_backoff_ms' ({queue.min_backoff_ms}) must not exceed max_backoff_ms"
            f" ({queue.max_backoff_ms})"
        )
    return queue


@dataclass(frozen=True, slots=True)
class Settings:
    database: DatabaseSettings
    adapters: tuple[AdapterConfig, ...]
    ingest: IngestSettings = IngestSettings()
    acker: AckerSettings = AckerSettings()
    queues: Mapping[str, QueueConfig] = field(default_factory=dict)
    metrics: MetricsSettings = MetricsSettings()
    # dramatiq's broker: [dramatiq] url, else the default broker (redis_url).
    dramatiq_url: str = DEFAULT_REDIS_URL
    # [dramatiq] idle_poll_ms: the longest a worker's consumer sleeps between
    # fetches from an empty queue (dramatiq's worker_timeout, 1000 ms by
    # default, which adds up to a second to a todo arriving at a quiet queue).
    dramatiq_idle_poll_ms: int = DEFAULT_IDLE_POLL_MS
    # Why dramatiq_url lacks its credentials (see dramatiq_broker_url); None: complete.
    dramatiq_credentials_error: str | None = None
    # Where ``database.url`` came from, for messages: the variable or the key.
    database_url_origin: str = "[database] url"
    # The broker of adapters that name none: SWITCHBOARD_REDIS_URL, else
    # [redis] url, else the default; also that of adapters known only from
    # the adapters table (``ack`` and ``status`` with no adapters configured).
    redis_url: str = DEFAULT_REDIS_URL

    def dramatiq_broker_url(self) -> str:
        """``dramatiq_url``, for what connects to it (the relay, the workers):
        a ConfigError if its username_env / password_env is unset."""
        if self.dramatiq_credentials_error is not None:
            raise ConfigError(self.dramatiq_credentials_error)
        return self.dramatiq_url

    def adapter(self, name: str) -> AdapterConfig:
        for a in self.adapters:
            if a.name == name:
                return a
        raise ConfigError(f"no adapter named {name!r} in the config: use the config that defines it")


@dataclass(frozen=True, slots=True)
class _Setting:
    """One adapter key, as read from its attribute's definition."""

    attr: str
    name: str  # the key in the table
    key: Key
    default: Any  # dataclasses.MISSING: required, or made by a factory
    required: bool
    parse: Callable[[str, Any], Any]


@functools.cache
def _adapter_settings() -> tuple[_Setting, ...]:
    hints = get_type_hints(AdapterConfig, include_extras=True)
    settings = []
    for f in dataclasses.fields(AdapterConfig):
        hint = hints[f.name]
        extras = get_args(hint)[1:] if get_origin(hint) is Annotated else ()
        if any(isinstance(e, Derived) for e in extras):
            continue
        key = next((e for e in extras if isinstance(e, Key)), Key())
        settings.append(
            _Setting(
                attr=f.name,
                name=key.toml or f.name,
                key=key,
                default=f.default,
                required=f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
                parse=key.parse or _parser(f.name, get_args(hint)[0] if extras else hint, key),
            )
        )
    return tuple(settings)


def _parser(attr: str, kind: Any, key: Key) -> Callable[[str, Any], Any]:
    """The check that follows from an adapter attribute's type."""
    if kind is str:
        return _string
    if kind is int:

        def integer(where: str, value: Any) -> int:
            number = _positive_int(where, value, minimum=key.minimum)
            if key.maximum is not None and number > key.maximum:
                raise ConfigError(f"{where} must be at most {key.maximum}")
            return number

        return integer
    raise TypeError(f"AdapterConfig.{attr}: no check for type {kind!r}: give its Key a parse")


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    """Each field of a settings dataclass, with its declared type."""
    hints = get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


_TOP_KEYS = {"database", "redis", "adapters", "ingest", "acker", "queues", "metrics", "dramatiq"}
# DatabaseSettings fields that no [database] key sets: every other field is a
# key. These two never were, and making them keys would change what loads.
_DATABASE_FIXED = frozenset({"connect_timeout_s", "pool_checkout_timeout_s"})


def _check_keys(where: str, table: Mapping[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r} (allowed: {', '.join(sorted(allowed))})")


def _section(raw: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    value = raw.get(name, {})
    if not isinstance(value, Mapping):
        raise ConfigError(f"[{name}]: must be a table")
    return value


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


def adapter_keys() -> frozenset[str]:
    """The keys of an ``[[adapters]]`` table."""
    return frozenset(s.name for s in _adapter_settings())


def read_adapter(
    table: Mapping[str, Any], redis_url: str, env: Mapping[str, str] | None = None
) -> AdapterConfig:
    """One ``[[adapters]]`` table, read and checked as a config file's are;
    ``redis_url`` where it names no ``url``. A ``schema`` path is taken
    relative to the working directory."""
    return _adapter(0, table, redis_url, Path.cwd(), env or {})


def _adapter(
    index: int, raw: Any, default_redis_url: str, base_dir: Path, env: Mapping[str, str]
) -> AdapterConfig:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"adapters[{index}]: must be a table")
    name = raw.get("name")
    label = f"adapter {name!r}" if isinstance(name, str) and name else f"adapters[{index}]"
    settings = _adapter_settings()
    _check_keys(label, raw, {s.name for s in settings})
    table = {"url": default_redis_url, "queue": name, **raw}  # the defaults that depend on the rest
    values: dict[str, Any] = {}
    for s in settings:
        if s.name in raw and "mode" in values and values["mode"] not in s.key.modes:
            # DESIGN.md 6b: a key that does not apply to the adapter's mode
            # is an error naming it, never silently ignored.
            raise ConfigError(
                f"{label}: key {s.name!r} does not apply to mode = {values['mode']!r}"
                f" (it applies to mode {' or '.join(repr(m) for m in s.key.modes)})"
            )
        if s.name in table:
            values[s.attr] = s.parse(f"{label}: key {s.name!r}", table[s.name])
        elif s.required:  # refused, with what was expected
            values[s.attr] = s.parse(f"{label}: key {s.name!r}", None)
        elif s.default is not dataclasses.MISSING:
            values[s.attr] = s.default
        if s.key.rule is not None:
            s.key.rule(label, values)
    try:
        values["redis_url"] = with_credentials(
            label,
            values["redis_url"],
            env,
            username_env=values["username_env"],
            password_env=values["password_env"],
        )
    except ConfigError as exc:
        # Only the processes that connect to this broker need the variables
        # (the ingester's and the acker's, per role): raised when one does.
        values["credentials_error"] = str(exc)
    return AdapterConfig(**{**values, **_body_schema(label, values, base_dir)})


def check_metrics_port(where: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 65535:
        raise ConfigError(f"{where} must be 0..65535 (got {value!r})")
    return value


_METRICS_DEFAULTS = MetricsSettings()


def _metrics(raw: Mapping[str, Any], env: Mapping[str, str]) -> MetricsSettings:
    """``[metrics]``; ``SWITCHBOARD_METRICS_PORT`` overrides its port (and
    ``--metrics-port`` overrides both, per process: see the CLI)."""
    section = _section(raw, "metrics")
    _check_keys("[metrics]", section, {"port", "address", "refresh_interval_ms"})
    port = check_metrics_port("[metrics]: key 'port'", section.get("port", 0))
    if env.get(METRICS_PORT_VARIABLE):
        text = env[METRICS_PORT_VARIABLE]
        port = check_metrics_port(METRICS_PORT_VARIABLE, int(text) if text.isdigit() else text)
    address = _string("[metrics]: key 'address'", section.get("address", _METRICS_DEFAULTS.address))
    refresh = _positive_int(
        "[metrics]: key 'refresh_interval_ms'",
        section.get("refresh_interval_ms", _METRICS_DEFAULTS.refresh_interval_ms),
        minimum=100,
    )
    return MetricsSettings(port=port, address=address, refresh_interval_ms=refresh)


def _broker_identity(url: str) -> tuple[str, ...]:
    """Which server and database a broker URL reaches, whoever logs in."""
    parts = urlsplit(url)
    if parts.scheme == "unix":
        return ("unix", parts.path)
    db = parts.path.strip("/") or "0"
    for item in parts.query.split("&"):
        key, _, value = item.partition("=")
        if key == "db":
            db = value
    return (parts.hostname or "localhost", str(parts.port or 6379), db)


def _check_one_reader_each(adapters: tuple[AdapterConfig, ...]) -> None:
    """Two adapters reading one stream with one consumer group (or one list)
    split its messages between them at random, and after a crash a message
    can reach both, as work in two queues: refused. Fan-out on a stream is
    distinct groups; pub/sub delivers every message to every subscriber."""
    readers: dict[tuple[str, ...], AdapterConfig] = {}
    for a in adapters:
        if a.mode == "stream":
            what = (a.mode, *_broker_identity(a.redis_url), a.source, a.group)
            key, read = "group", f"stream {a.source!r} with group {a.group!r}"
            hint = "fan-out needs a distinct group"
        elif a.mode == "list":
            what = (a.mode, *_broker_identity(a.redis_url), a.source)
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


def _check_inflight_room(ingest: IngestSettings, adapters: tuple[AdapterConfig, ...]) -> None:
    """Room in flight for one message of the largest size allowed: else an
    adapter could never read without passing the bound it is meant to keep."""
    for a in adapters:
        if a.max_message_bytes > ingest.max_inflight_bytes:
            raise ConfigError(
                f"[ingest]: key 'max_inflight_bytes' ({ingest.max_inflight_bytes}) must be at least adapter"
                f" {a.name!r}'s max_message_bytes ({a.max_message_bytes})"
            )


# Too many statements, let be: rewritten with the typed config (issue 23).
def from_mapping(raw: Mapping[str, Any], env: Mapping[str, str], base_dir: Path | None = None) -> Settings:  # noqa: PLR0915
    """``base_dir`` anchors relative paths (the config file's directory)."""
    _check_keys("config", raw, _TOP_KEYS)
    db = _section(raw, "database")
    db_types = _field_types(DatabaseSettings)
    db_numbers = [k for k in db_types if k != "url" and k not in _DATABASE_FIXED]
    _check_keys("[database]", db, {"url", *db_numbers})
    db_where = DATABASE_URL_VARIABLE if env.get(DATABASE_URL_VARIABLE) else "[database]: key 'url'"
    db_url = env.get(DATABASE_URL_VARIABLE) or db.get("url")
    if not db_url:
        raise ConfigError(f"[database]: key 'url' is required (or set {DATABASE_URL_VARIABLE})")
    db_url = _database_url(db_where, db_url)
    database = DatabaseSettings(
        url=db_url,
        **{k: _database_number(f"[database]: key {k!r}", db[k], db_types[k]) for k in db_numbers if k in db},
    )
    if database.transaction_deadline_ms <= database.statement_timeout_ms:
        # Else a statement the server would let finish is cut off client-side,
        # and its connection thrown away, every time.
        raise ConfigError(
            "[database]: key 'transaction_deadline_ms' must be greater than statement_timeout_ms"
            f" ({database.transaction_deadline_ms} <= {database.statement_timeout_ms})"
        )
    redis_section = _section(raw, "redis")
    _check_keys("[redis]", redis_section, {"url"})
    if env.get(REDIS_URL_VARIABLE):
        default_redis = check_redis_url(REDIS_URL_VARIABLE, env[REDIS_URL_VARIABLE])
    elif "url" in redis_section:
        default_redis = check_redis_url("[redis]: key 'url'", redis_section["url"])
    else:
        default_redis = DEFAULT_REDIS_URL
    raw_adapters = raw.get("adapters", [])
    if not isinstance(raw_adapters, list):
        raise ConfigError("[[adapters]]: must be an array of tables")
    anchor = base_dir if base_dir is not None else Path.cwd()
    adapters = tuple(_adapter(i, a, default_redis, anchor, env) for i, a in enumerate(raw_adapters))
    names = [a.name for a in adapters]
    for n in names:
        if names.count(n) > 1:
            raise ConfigError(f"adapter {n!r}: key 'name' is used by more than one adapter")
    _check_one_reader_each(adapters)
    ingest_raw = _section(raw, "ingest")
    ingest_types = _field_types(IngestSettings)
    _check_keys("[ingest]", ingest_raw, set(ingest_types))
    ingest = IngestSettings(
        **{k: _number(f"[ingest]: key {k!r}", v, ingest_types[k]) for k, v in ingest_raw.items()}
    )
    _check_inflight_room(ingest, adapters)
    acker_raw = _section(raw, "acker")
    acker_types = _field_types(AckerSettings)
    _check_keys("[acker]", acker_raw, set(acker_types))
    queues = {name: _queue(name, q) for name, q in _section(raw, "queues").items()}
    dramatiq_section = _section(raw, "dramatiq")
    _check_keys("[dramatiq]", dramatiq_section, {"url", "idle_poll_ms", "username_env", "password_env"})
    idle_poll_ms = (
        _positive_int("[dramatiq]: key 'idle_poll_ms'", dramatiq_section["idle_poll_ms"])
        if "idle_poll_ms" in dramatiq_section
        else DEFAULT_IDLE_POLL_MS
    )
    dramatiq_url = (
        check_redis_url("[dramatiq]: key 'url'", dramatiq_section["url"])
        if "url" in dramatiq_section
        else default_redis
    )
    dramatiq_credentials_error = None
    dramatiq_user_env = _optional_env_name("[dramatiq]", dramatiq_section, "username_env")
    dramatiq_password_env = _optional_env_name("[dramatiq]", dramatiq_section, "password_env")
    try:
        dramatiq_url = with_credentials(
            "[dramatiq]",
            dramatiq_url,
            env,
            username_env=dramatiq_user_env,
            password_env=dramatiq_password_env,
        )
    except ConfigError as exc:  # needed by the relay and the workers only: raised there
        dramatiq_credentials_error = str(exc)
    return Settings(
        dramatiq_credentials_error=dramatiq_credentials_error,
        database_url_origin=DATABASE_URL_VARIABLE if env.get(DATABASE_URL_VARIABLE) else "[database] url",
        database=database,
        adapters=adapters,
        ingest=ingest,
        acker=AckerSettings(**{k: _acker_value(k, v, acker_types[k]) for k, v in acker_raw.items()}),
        queues=queues,
        dramatiq_url=dramatiq_url,
        dramatiq_idle_poll_ms=idle_poll_ms,
        metrics=_metrics(raw, env),
        redis_url=default_redis,
    )


def load(path: str | Path, env: Mapping[str, str]) -> Settings:
    path = Path(path)
    try:
        with path.open("rb") as f:
            raw = tomllib.load(f)
    except FileNotFoundError as exc:
        raise ConfigError(
            f"config file {str(path)!r} not found (use --config or SWITCHBOARD_CONFIG)"
        ) from exc
    except IsADirectoryError as exc:
        raise ConfigError(
            f"config file {str(path)!r} is a directory: give --config the TOML file itself"
        ) from exc
    except OSError as exc:
        raise ConfigError(f"config file {str(path)!r} cannot be read: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {str(path)!r} is not UTF-8 text (TOML must be)") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {str(path)!r}: invalid TOML: {exc}") from exc
    return from_mapping(raw, env, path.resolve().parent)
