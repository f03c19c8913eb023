"""Settings: one frozen object built at process start from the TOML file and
the environment (DESIGN.md section 7), validated with messages that name the
adapter and the key. Nothing here runs at import time."""

from __future__ import annotations

import re
import socket
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from backhalf.body_schema import BodySchema, SchemaFileError
from backhalf.db import DatabaseSettings, normalize_url
from backhalf.keys import DEFAULT_PREFIX
from backhalf.normalize import DEFAULT_MAX_MESSAGE_BYTES, BodyFormat
from ingest.errors import ConfigError

DEFAULT_CONFIG_PATH = "switchboard.toml"
DEFAULT_REDIS_URL = "redis://localhost:6379/0"
MODES = ("stream", "list", "pubsub")


@dataclass(frozen=True, slots=True)
class AdapterConfig:
    name: str
    mode: str
    source: str
    queue: str
    redis_url: str
    transport: str = "redis"
    group: str = "switchboard"
    consumer: str = field(default_factory=socket.gethostname)
    ack_after: Literal["store", "complete"] = "store"
    batch_size: int = 500
    block_ms: int = 1000
    claim_idle_ms: int = 60_000
    claim_interval_ms: int = 5_000
    start_id: str = "0"
    key_prefix: str = DEFAULT_PREFIX
    body_field: str = "body"
    format: BodyFormat = BodyFormat.JSON
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    delivery: str | None = None
    max_deliveries: int = 10  # delivered this often and never stored: rejected as poison
    heartbeat_ttl_ms: int = 30_000  # list mode: a consumer silent this long is dead
    reap_interval_ms: int = 5_000  # list mode: how often dead consumers' lists are checked
    # A JSON Schema file the decoded body must satisfy, else it is poison.
    schema: str | None = None
    body_schema: BodySchema | None = field(default=None, compare=False, repr=False)

    def public_settings(self) -> dict[str, Any]:
        """What goes into ``adapters.settings``: everything but the broker URL."""
        return {
            "source": self.source,
            "queue": self.queue,
            "group": self.group,
            "consumer": self.consumer,
            "ack_after": self.ack_after,
            "batch_size": self.batch_size,
            "block_ms": self.block_ms,
            "claim_idle_ms": self.claim_idle_ms,
            "start_id": self.start_id,
            "key_prefix": self.key_prefix,
            "body_field": self.body_field,
            "format": str(self.format),
            "max_message_bytes": self.max_message_bytes,
            "max_deliveries": self.max_deliveries,
            **({"schema": self.schema} if self.schema else {}),
            **({"heartbeat_ttl_ms": self.heartbeat_ttl_ms} if self.mode == "list" else {}),
            **({"delivery": self.delivery} if self.mode == "pubsub" else {}),
        }


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


@dataclass(frozen=True, slots=True)
class AckerSettings:
    batch_size: int = 1000
    poll_interval_ms: int = 1000
    shutdown_timeout_s: float = 10.0
    backoff_initial_ms: int = 100
    backoff_max_ms: int = 10_000


@dataclass(frozen=True, slots=True)
class Settings:
    database: DatabaseSettings
    adapters: tuple[AdapterConfig, ...]
    ingest: IngestSettings = IngestSettings()
    acker: AckerSettings = AckerSettings()
    queues: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    metrics_port: int = 0

    def adapter(self, name: str) -> AdapterConfig:
        for a in self.adapters:
            if a.name == name:
                return a
        raise ConfigError(f"no adapter named {name!r} in the config")


_ADAPTER_KEYS = {
    "name", "transport", "mode", "source", "group", "consumer", "queue", "ack_after",
    "batch_size", "block_ms", "claim_idle_ms", "claim_interval_ms", "start_id",
    "key_prefix", "body_field", "format", "max_message_bytes", "url", "delivery",
    "heartbeat_ttl_ms", "reap_interval_ms", "max_deliveries", "schema",
}  # fmt: skip
_START_ID = re.compile(r"\$|\d+(-\d+)?")
_TOP_KEYS = {"database", "redis", "adapters", "ingest", "acker", "queues", "metrics"}


def _positive_int(where: str, value: Any, *, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{where}: must be an integer >= {minimum} (got {value!r})")
    return value


def _string(where: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where}: must be a non-empty string (got {value!r})")
    return value


def _check_keys(where: str, table: Mapping[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r} (allowed: {', '.join(sorted(allowed))})")


def _section(raw: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    value = raw.get(name, {})
    if not isinstance(value, Mapping):
        raise ConfigError(f"[{name}]: must be a table")
    return value


def _body_schema(
    label: str, raw: Mapping[str, Any], body_format: BodyFormat, base_dir: Path
) -> dict[str, Any]:
    """``schema``: a JSON Schema file, relative to the config file's directory."""
    if "schema" not in raw:
        return {}
    path = Path(_string(f"{label}: key 'schema'", raw["schema"]))
    if body_format is BodyFormat.BYTES:
        raise ConfigError(f"{label}: key 'schema' cannot apply to format = \"bytes\" (nothing is decoded)")
    path = path if path.is_absolute() else base_dir / path
    try:
        return {"schema": str(path), "body_schema": BodySchema.load(path)}
    except SchemaFileError as exc:
        raise ConfigError(f"{label}: key 'schema': {exc}") from exc


def _adapter(index: int, raw: Any, default_redis_url: str, base_dir: Path) -> AdapterConfig:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"adapters[{index}]: must be a table")
    name = raw.get("name")
    label = f"adapter {name!r}" if isinstance(name, str) and name else f"adapters[{index}]"
    _check_keys(label, raw, _ADAPTER_KEYS)
    name = _string(f"{label}: key 'name'", name)
    mode = raw.get("mode", "stream")
    if mode not in MODES:
        raise ConfigError(f"{label}: key 'mode' must be one of {', '.join(MODES)} (got {mode!r})")
    if raw.get("delivery", "at-least-once") not in ("at-least-once", "at-most-once"):
        raise ConfigError(
            f'{label}: key \'delivery\' must be "at-least-once" or "at-most-once" (got {raw["delivery"]!r})'
        )
    if mode == "pubsub" and raw.get("delivery") != "at-most-once":
        raise ConfigError(
            f'{label}: key \'delivery\' must be "at-most-once" for mode = "pubsub": pub/sub has no '
            "redelivery and loses messages published while the ingester is down"
        )
    transport = raw.get("transport", "redis")
    if transport != "redis":
        raise ConfigError(f"{label}: key 'transport' must be \"redis\" (got {transport!r})")
    ack_after = raw.get("ack_after", "store")
    if ack_after not in ("store", "complete"):
        raise ConfigError(f'{label}: key \'ack_after\' must be "store" or "complete" (got {ack_after!r})')
    if ack_after == "complete":
        raise ConfigError(
            f"{label}: key 'ack_after' = \"complete\" needs the todo workers, which are not built yet"
        )
    fmt = raw.get("format", "json")
    try:
        body_format = BodyFormat(fmt)
    except ValueError as exc:
        raise ConfigError(f"{label}: key 'format' must be json, text or bytes (got {fmt!r})") from exc
    start_id = raw.get("start_id", "0")
    if not isinstance(start_id, str) or not _START_ID.fullmatch(start_id):
        raise ConfigError(f"{label}: key 'start_id' must be '0', '$' or a stream id (got {start_id!r})")
    options: dict[str, Any] = {}
    for key in ("group", "consumer", "key_prefix", "body_field"):
        if key in raw:
            options[key] = _string(f"{label}: key {key!r}", raw[key])
    for key, minimum in (
        ("batch_size", 1),
        ("block_ms", 1),
        ("claim_idle_ms", 1),
        ("claim_interval_ms", 1),
        ("max_message_bytes", 1),
        ("heartbeat_ttl_ms", 1000),
        ("max_deliveries", 3),
        ("reap_interval_ms", 1),
    ):
        if key in raw:
            options[key] = _positive_int(f"{label}: key {key!r}", raw[key], minimum=minimum)
    if options.get("batch_size", 1) > 10_000:
        raise ConfigError(f"{label}: key 'batch_size' must be at most 10000")
    source = _string(f"{label}: key 'source'", raw.get("source"))
    redis_url = _string(f"{label}: key 'url'", raw.get("url", default_redis_url))
    if urlsplit(redis_url).scheme not in ("redis", "rediss", "unix"):
        raise ConfigError(f"{label}: key 'url' must be a redis://, rediss:// or unix:// URL")
    return AdapterConfig(
        name=name,
        mode=mode,
        source=source,
        queue=_string(f"{label}: key 'queue'", raw.get("queue", name)),
        redis_url=redis_url,
        transport=transport,
        ack_after=ack_after,
        start_id=start_id,
        format=body_format,
        delivery=raw.get("delivery"),
        **_body_schema(label, raw, body_format, base_dir),
        **options,
    )


def from_mapping(raw: Mapping[str, Any], env: Mapping[str, str], base_dir: Path | None = None) -> Settings:
    """``base_dir`` anchors relative paths (the config file's directory)."""
    _check_keys("config", raw, _TOP_KEYS)
    db = _section(raw, "database")
    db_numbers = (
        "statement_timeout_ms",
        "lock_timeout_ms",
        "pool_size",
        "tcp_user_timeout_ms",
        "transaction_deadline_ms",
    )
    _check_keys("[database]", db, {"url", *db_numbers})
    db_url = env.get("SWITCHBOARD_DATABASE_URL") or db.get("url")
    if not db_url:
        raise ConfigError("[database]: key 'url' is required (or set SWITCHBOARD_DATABASE_URL)")
    try:
        db_url = normalize_url(_string("[database]: key 'url'", db_url))
    except ConfigError:
        raise
    except Exception as exc:  # SQLAlchemy's URL parser raises several types
        raise ConfigError(f"[database]: key 'url' is not a database URL ({type(exc).__name__})") from exc
    database = DatabaseSettings(
        url=db_url,
        **{k: _positive_int(f"[database]: key {k!r}", db[k]) for k in db_numbers if k in db},
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
    default_redis = env.get("SWITCHBOARD_REDIS_URL") or redis_section.get("url") or DEFAULT_REDIS_URL
    raw_adapters = raw.get("adapters", [])
    if not isinstance(raw_adapters, list):
        raise ConfigError("[[adapters]]: must be an array of tables")
    anchor = base_dir if base_dir is not None else Path.cwd()
    adapters = tuple(_adapter(i, a, default_redis, anchor) for i, a in enumerate(raw_adapters))
    names = [a.name for a in adapters]
    for n in names:
        if names.count(n) > 1:
            raise ConfigError(f"adapter {n!r}: key 'name' is used by more than one adapter")
    ingest_raw = _section(raw, "ingest")
    _check_keys("[ingest]", ingest_raw, set(IngestSettings.__dataclass_fields__))
    acker_raw = _section(raw, "acker")
    _check_keys("[acker]", acker_raw, set(AckerSettings.__dataclass_fields__))
    queues = _section(raw, "queues")
    for qname, q in queues.items():
        if not isinstance(q, Mapping):
            raise ConfigError(f"[queues.{qname}]: must be a table")
        _check_keys(f"[queues.{qname}]", q, {"handler", "max_attempts"})
    metrics = _section(raw, "metrics")
    _check_keys("[metrics]", metrics, {"port"})
    port = metrics.get("port", 0)
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ConfigError(f"[metrics]: key 'port' must be 0..65535 (got {port!r})")
    return Settings(
        database=database,
        adapters=adapters,
        ingest=IngestSettings(**{k: _number(f"[ingest]: key {k!r}", v) for k, v in ingest_raw.items()}),
        acker=AckerSettings(**{k: _number(f"[acker]: key {k!r}", v) for k, v in acker_raw.items()}),
        queues=dict(queues),
        metrics_port=port,
    )


def _number(where: str, value: Any) -> Any:
    # Durations in seconds (``_s``) may be fractional; counts and ``_ms`` may not.
    allowed = int | float if where.endswith("_s'") else int
    if isinstance(value, bool) or not isinstance(value, allowed) or value <= 0:
        kind = "number" if allowed is not int else "integer"
        raise ConfigError(f"{where}: must be a positive {kind} (got {value!r})")
    return value


def load(path: str | Path, env: Mapping[str, str]) -> Settings:
    path = Path(path)
    try:
        with path.open("rb") as f:
            raw = tomllib.load(f)
    except FileNotFoundError as exc:
        raise ConfigError(
            f"config file {str(path)!r} not found (use --config or SWITCHBOARD_CONFIG)"
        ) from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {str(path)!r}: invalid TOML: {exc}") from exc
    return from_mapping(raw, env, path.resolve().parent)
