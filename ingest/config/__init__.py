"""Settings: one frozen object built at process start from the TOML file and
the environment (DESIGN.md section 7), validated with messages that name the
adapter (or table) and the key. Nothing here runs at import time.

Each setting is defined once, as an attribute of its table's dataclass: its
type, its default and a :class:`~ingest.config.keys.Key` with its bounds, its
check and its line in the config reference (``docs/configuration.md``,
written by :mod:`ingest.config.reference`). Every table is read the same way,
by :meth:`~ingest.config.keys.Section.read`; what is left here is what
crosses tables. The ``[[adapters]]`` definitions are in
:mod:`ingest.config.adapter`, the URL checks in :mod:`ingest.config.urls`."""

from __future__ import annotations

import dataclasses
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

from backhalf.db import DatabaseSettings
from backhalf.lifecycle.queues import QueueConfig
from ingest.config.adapter import (
    ADAPTERS,
    DAY_MS,
    RETENTION,
    adapter_tables,
    dedup_minimum_ms,
    is_webhook,
    read_adapters,
    source_identity,
)
from ingest.config.adapter import AdapterConfig as AdapterConfig
from ingest.config.adapter import adapter_keys as adapter_keys
from ingest.config.adapter import read_adapter as read_adapter
from ingest.config.keys import DAYS_TYPE, Key, Section, check_keys, days, string, table
from ingest.config.transport import DefaultBroker
from ingest.config.transports import default as default_transport
from ingest.config.transports import definitions as transport_definitions
from ingest.config.urls import BrokerUrl as BrokerUrl
from ingest.config.urls import database_url
from ingest.config.urls import with_credentials as with_credentials
from ingest.config.webhook import RECEIVER, SENDER_RETRY_DAYS, WEBHOOKS, ReceiverSettings, read_webhook
from ingest.config.webhook import WebhookConfig as WebhookConfig
from ingest.errors import ConfigError

DEFAULT_CONFIG_PATH = "switchboard.toml"
DATABASE_URL_VARIABLE = "SWITCHBOARD_DATABASE_URL"
METRICS_PORT_VARIABLE = "SWITCHBOARD_METRICS_PORT"
# A claim's lease is extended every third of it: a second at the least.
LEASE_MIN_MS = 3_000
# A prune batch is one short transaction: larger ones hold their locks longer
# and make WAL in bursts, for little more speed (docs/architecture.md, "Retention").
MAX_PRUNE_BATCH_SIZE = 50_000


def _positive(doc: str, *, zero: bool = False, maximum: int | None = None) -> Key:
    """A number above 0 of the attribute's type (a ``float`` takes a
    fraction), in the words ``[ingest]`` and ``[acker]`` have always used;
    ``zero``: 0 too, meaning off."""
    return Key(minimum=None, zero=zero, maximum=maximum, doc=doc)


def _database_url(where: str, value: Any) -> str:
    if not value:  # as good as none, as an empty SWITCHBOARD_DATABASE_URL is
        raise ConfigError(f"{where} is required (or set {DATABASE_URL_VARIABLE})")
    return database_url(where, value)


def _deadline_after_statements(label: str, values: Mapping[str, Any]) -> None:
    # Else a statement the server would let finish is cut off client-side,
    # and its connection thrown away, every time.
    deadline_ms, statement_ms = values["transaction_deadline_ms"], values["statement_timeout_ms"]
    if deadline_ms <= statement_ms:
        raise ConfigError(
            f"{label}: key 'transaction_deadline_ms' must be greater than statement_timeout_ms"
            f" ({deadline_ms} <= {statement_ms})"
        )


HISTORY = "([History in partitions](operating.md#history-in-partitions))"
OPERATING_DATABASE = "([operating.md](operating.md#the-database-commits-deadlines-connections))"

# backhalf.db.DatabaseSettings cannot import Key (backhalf never imports
# ingest): its keys are declared here, by field. None: no key sets it (never
# was: making one would change what loads).
DATABASE = Section(
    "[database]",
    DatabaseSettings,
    keys={
        "url": Key(
            parse=_database_url,
            env=DATABASE_URL_VARIABLE,
            required=f"or set {DATABASE_URL_VARIABLE}",
            doc="the PostgreSQL database ([URLs](#urls)); `SWITCHBOARD_DATABASE_URL` takes its place",
            default_doc=f"none: required, unless `{DATABASE_URL_VARIABLE}` is set",
        ),
        "statement_timeout_ms": Key(doc="every statement of every transaction"),
        "lock_timeout_ms": Key(doc="the sessions' `lock_timeout`"),
        "connect_timeout_s": None,
        "pool_checkout_timeout_s": None,
        "pool_size": Key(doc=f"connections per process, plus 2 overflow {OPERATING_DATABASE}"),
        "tcp_user_timeout_ms": Key(doc="a silent peer (no reset) is given up after this"),
        "transaction_deadline_ms": Key(
            rule=_deadline_after_statements,
            doc="the client-side bound on a whole transaction, checkout to COMMIT reply; must be greater"
            f" than `statement_timeout_ms` {OPERATING_DATABASE}",
        ),
    },
)


@dataclass(frozen=True, slots=True)
class IngestSettings:
    shutdown_timeout_s: Annotated[
        float, _positive("a graceful stop's deadline: loops still running then are cancelled")
    ] = 10.0
    # Each transaction under this size, so one statement never nears
    # PostgreSQL's 1 GB message limit or its statement_timeout.
    max_batch_bytes: Annotated[int, _positive("a larger batch is stored in several transactions")] = (
        32 * 1024 * 1024
    )
    enabled_refresh_ms: Annotated[int, _positive("how soon `switchboard adapters disable` takes effect")] = (
        1000
    )
    backoff_initial_ms: Annotated[
        int, _positive("the first wait of the exponential, jittered, capped backoff")
    ] = 100
    backoff_max_ms: Annotated[int, _positive("the backoff's cap")] = 10_000
    # Each on its own connection, each one core of PostgreSQL. List and
    # pub/sub adapters always commit one batch at a time.
    commits_in_flight: Annotated[
        int, _positive("stream adapters: store transactions that may run at once (1 = none overlap)")
    ] = 2
    # Bytes of messages one adapter may hold read and not yet committed (the
    # batch read ahead plus the commits in flight). A read asks for at most
    # as many messages as fit at max_message_bytes each, so memory is bounded
    # by bytes whatever the messages' sizes, not by batch_size alone. Each
    # byte held costs 2 to 6.5 bytes of RSS (its decoded text beside it), so
    # the default keeps a backlog of 1 MiB messages under 1 GiB, half of a
    # 2 GiB host (512 MiB took 1.2 to 3.3 GiB; docs/operating.md, "Memory is
    # bounded by bytes"; tests/unit/config/test_inflight_bound.py).
    max_inflight_bytes: Annotated[
        int,
        _positive(
            "per adapter: bytes read and not yet committed; at least every adapter's `max_message_bytes`"
            " ([Memory](operating.md#memory-is-bounded-by-bytes))"
        ),
    ] = 128 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class AckerSettings:
    batch_size: Annotated[int, _positive("acks claimed per drain")] = 1000
    poll_interval_ms: Annotated[int, _positive("fallback when a NOTIFY is missed")] = 1000
    shutdown_timeout_s: Annotated[float, _positive("a graceful stop's deadline")] = 10.0
    backoff_initial_ms: Annotated[int, _positive("the first wait of the backoff")] = 100
    backoff_max_ms: Annotated[int, _positive("the backoff's cap")] = 10_000
    # The rescuer: claims whose lease lapsed go back to pending.
    rescue_interval_ms: Annotated[
        int,
        _positive("how often lapsed claims are looked for ([Workers](workers.md#leases-and-the-rescuer))"),
    ] = 5_000
    prune_interval_ms: Annotated[
        int,
        _positive(
            "how often the acker prunes what a `retain_*` key lets go (0 = never; `switchboard prune`"
            f" still does) {RETENTION}",
            zero=True,
        ),
    ] = 60_000
    prune_batch_size: Annotated[
        int,
        _positive("rows examined per prune batch, one short transaction each", maximum=MAX_PRUNE_BATCH_SIZE),
    ] = 2_000
    prune_pause_ms: Annotated[
        int,
        _positive("pause between prune batches, so autovacuum and replicas keep up (0 = none)", zero=True),
    ] = 10
    # The history tables' partitions (backhalf.housekeeping.partitions, issue 45).
    retain_history_days: Annotated[
        float | None,
        _kept(
            "days the history (`inbox`, `events`, `todo_events`) is kept: a partition whose newest row is"
            " older is dropped whole, nothing owed in it; also how long a native id is deduplicated"
            f" {HISTORY}"
        ),
    ] = None
    partition_hours: Annotated[
        int,
        _positive(f"hours of history one partition holds, begun when its first row is this old {HISTORY}"),
    ] = 24


def _handler(where: str, value: Any) -> str:
    """``module:attribute``: imported by the worker only (ingest and ack never
    run user code), so only its shape is checked here."""
    text = string(where, value)
    module, sep, attr = text.partition(":")
    if not sep or not module or not attr or " " in text:
        raise ConfigError(f"{where} must be 'module:function' (got {text!r})")
    return text


def _kept(doc: str) -> Key:
    return Key(parse=days, doc=doc, default_doc="none: kept forever", type_doc=DAYS_TYPE)


# backhalf.lifecycle.queues.QueueConfig cannot import Key: its keys are declared here.
QUEUES = Section(
    "[queues.NAME]",
    QueueConfig,
    intro="Who does the todos of queue NAME (the adapter's `queue`), with `switchboard worker`: see"
    " [workers.md](workers.md).",
    keys={
        "name": None,  # the table's name
        "handler": Key(
            parse=_handler,
            required="'module:function' that does the todos",
            doc="module:function, sync or async, or an existing @dramatiq.actor",
        ),
        "max_attempts": Key(doc="runs in all; then the todo is `failed`"),
        "time_limit_ms": Key(doc="a run past it is stopped by dramatiq's TimeLimit and fails"),
        "min_backoff_ms": Key(
            doc="dramatiq's exponential backoff between attempts; not above `max_backoff_ms`"
        ),
        "max_backoff_ms": Key(doc="the backoff's cap"),
        "retain_done_days": _kept(
            "days `done` and `cancelled` todos are kept after they ended; with every queue's set and"
            f" `[acker] retain_history_days`, they go with whole partitions at the longest {HISTORY},"
            f" else row by row {RETENTION}"
        ),
        "retain_failed_days": _kept("days `failed` ones are kept (longer: operators retry them)"),
    },
)


def _queue(name: str, raw: Any) -> QueueConfig:
    where = f"[queues.{name}]"
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: must be a table")
    queue = QueueConfig(name=name, **QUEUES.read(where, raw))
    if queue.min_backoff_ms > queue.max_backoff_ms:
        raise ConfigError(
            f"{where}: key 'min_backoff_ms' ({queue.min_backoff_ms}) must not exceed max_backoff_ms"
            f" ({queue.max_backoff_ms})"
        )
    return queue


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    """``[worker]``: how ``switchboard worker`` claims todos (DESIGN.md section 7b)."""

    # Extended every third of it while the worker holds the claim: only a
    # worker gone (killed, cut off) lets it lapse, whatever the time limit.
    lease_ms: Annotated[
        int,
        Key(
            minimum=LEASE_MIN_MS,
            doc="a claim's lease, extended every third of it while its worker lives; a killed worker's"
            " claims are put back by the acker's rescuer once it lapses"
            " ([Workers](workers.md#leases-and-the-rescuer))",
        ),
    ] = 30_000
    # A NOTIFY wakes the workers at once; the poll covers a lost one and the
    # end of a retry's backoff.
    poll_interval_ms: Annotated[
        int,
        Key(maximum=1_000, doc="longest wait between claims of a worker with free threads (at most 1000)"),
    ] = 1_000


def check_metrics_port(where: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 65535:
        raise ConfigError(f"{where} must be 0..65535 (got {value!r})")
    return value


@dataclass(frozen=True, slots=True)
class MetricsSettings:
    """``[metrics]``: the Prometheus and ``/healthz`` endpoint of ``ingest``,
    ``ack`` and ``worker``. Port 0: off."""

    port: Annotated[
        int,
        Key(
            parse=check_metrics_port,
            doc=f"0: off; `{METRICS_PORT_VARIABLE}`, or `--metrics-port`, overrides it (processes on one"
            " host need one port each)",
            type_doc="integer 0..65535",
        ),
    ] = 0
    # Loopback unless said otherwise: a scraper elsewhere needs "0.0.0.0"
    # (or the host's address), a choice to make, not a default to inherit.
    address: Annotated[str, Key(doc="`0.0.0.0` (or the host's address) for a scraper on another host")] = (
        "127.0.0.1"
    )
    # Each read is a few broker calls or queries.
    refresh_interval_ms: Annotated[
        int,
        Key(
            minimum=100,
            doc="how often the backlog gauges (broker lag and lengths, pending acks, active todos) are read",
        ),
    ] = 5_000


INGEST = Section("[ingest]", IngestSettings)
ACKER = Section("[acker]", AckerSettings)
WORKER = Section(
    "[worker]",
    WorkerSettings,
    intro="How `switchboard worker` claims todos from PostgreSQL ([workers.md](workers.md)).",
)
METRICS = Section(
    "[metrics]",
    MetricsSettings,
    intro="The `/metrics` and `/healthz` endpoint of `ingest`, `ack` and `worker`: see"
    ' "[Metrics, health and liveness](operating.md#metrics-health-and-liveness)".',
)
# Every table, in the order of the config reference.
SECTIONS = (DATABASE, ADAPTERS, WEBHOOKS, RECEIVER, INGEST, ACKER, QUEUES, WORKER, METRICS)


def sections() -> tuple[Section, ...]:
    """Every table of the file: the default transport's own table after
    ``[database]``, each transport's own adapter keys after the shared ones
    (a function: the transports' definitions load on first use)."""
    home = default_transport().file_table
    own = tuple(d.keys for d in transport_definitions().values())
    at = SECTIONS.index(ADAPTERS)
    return (*SECTIONS[:at], *((home,) if home else ()), ADAPTERS, *own, *SECTIONS[at + 1 :])


def default_broker_url() -> str:
    """The default transport's own default URL (no file, no variable)."""
    home = default_transport()
    if home.default_url_value is None:
        raise TypeError(f"transport {home.name!r}, the default, has no default URL")
    return home.default_url_value


def _default_broker(raw: Mapping[str, Any], env: Mapping[str, str]) -> DefaultBroker:
    """The file's own broker: the default transport's table, ``[<name>]``."""
    home = default_transport()
    if home.file_table is None:
        raise TypeError(f"transport {home.name!r}, the default, has no file table")
    values = home.file_table.read(home.file_table.title, table(raw, home.name), env=env)
    return DefaultBroker(values.get("url", default_broker_url()), values.get("cluster", False))


_TOP_KEYS = {"database", "adapters", "receiver", "ingest", "acker", "queues", "worker", "metrics"}
# Keys of the dramatiq relay the workers on PostgreSQL replaced (DESIGN.md
# section 7b): a config written for it keeps loading, each key said once.
_RELAY_GONE = "the workers take their todos from PostgreSQL, with no relay and no dramatiq Redis"
RETIRED_KEYS: Mapping[tuple[str, str], str] = {
    ("dramatiq", "url"): _RELAY_GONE,
    ("dramatiq", "username_env"): _RELAY_GONE,
    ("dramatiq", "password_env"): _RELAY_GONE,
    ("dramatiq", "idle_poll_ms"): "a worker wakes on the store's NOTIFY; see [worker] poll_interval_ms",
    ("acker", "dispatch_batch_size"): _RELAY_GONE,
    ("acker", "dispatch_timeout_ms"): _RELAY_GONE,
    ("queues", "lease_margin_ms"): "a claim's lease is [worker] lease_ms, extended while its worker lives",
    ("queues", "dramatiq_queue"): "every queue's actor is on dramatiq's queue 'switchboard'",
}


@dataclass(frozen=True, slots=True)
class Settings:
    database: DatabaseSettings
    adapters: tuple[AdapterConfig, ...]
    ingest: IngestSettings = IngestSettings()
    acker: AckerSettings = AckerSettings()
    queues: Mapping[str, QueueConfig] = field(default_factory=dict)
    worker: WorkerSettings = WorkerSettings()
    metrics: MetricsSettings = MetricsSettings()
    # Where ``database.url`` came from, for messages: the variable or the key.
    database_url_origin: str = "[database] url"
    # The broker of adapters that name none: the default transport's
    # variable, else its table's url, else its default; also that of adapters
    # known only from the adapters table (``ack`` and ``status`` with no
    # adapters configured).
    default_broker_url: str = field(default_factory=default_broker_url)
    # The push adapters ([[adapters]] with transport = "webhook"), served by
    # `switchboard receive`; every other process leaves them be.
    webhooks: tuple[WebhookConfig, ...] = ()
    receiver: ReceiverSettings = field(default_factory=ReceiverSettings)
    # Keys the file holds that this version ignores (RETIRED_KEYS), one line
    # each, said by every command at start.
    notices: tuple[str, ...] = ()

    def adapter(self, name: str) -> AdapterConfig:
        for a in self.adapters:
            if a.name == name:
                return a
        raise ConfigError(f"no adapter named {name!r} in the config: use the config that defines it")

    def any_adapter(self, name: str) -> AdapterConfig | WebhookConfig:
        """A pull adapter or a webhook adapter by name."""
        for w in self.webhooks:
            if w.name == name:
                return w
        return self.adapter(name)


def _check_inflight_room(ingest: IngestSettings, adapters: tuple[AdapterConfig, ...]) -> None:
    """Room in flight for one message of the largest size allowed: else an
    adapter could never read without passing the bound it is meant to keep."""
    for a in adapters:
        if a.max_message_bytes > ingest.max_inflight_bytes:
            raise ConfigError(
                f"[ingest]: key 'max_inflight_bytes' ({ingest.max_inflight_bytes}) must be at least adapter"
                f" {a.name!r}'s max_message_bytes ({a.max_message_bytes})"
            )


def _metrics(raw: Mapping[str, Any], env: Mapping[str, str]) -> MetricsSettings:
    """``[metrics]``; ``SWITCHBOARD_METRICS_PORT`` overrides its port, after
    the file's is checked (and ``--metrics-port`` overrides both, per
    process: see the CLI)."""
    metrics = MetricsSettings(**METRICS.read("[metrics]", table(raw, "metrics")))
    text = env.get(METRICS_PORT_VARIABLE)
    if not text:
        return metrics
    port = check_metrics_port(METRICS_PORT_VARIABLE, int(text) if text.isdigit() else text)
    return dataclasses.replace(metrics, port=port)


def _without_retired(raw: Mapping[str, Any]) -> tuple[dict[str, Any], tuple[str, ...]]:
    """The file without the keys :data:`RETIRED_KEYS` names, and a notice
    for each one it held."""
    notices: list[str] = []
    kept = dict(raw)

    def strip(where: str, section: str, values: Any) -> Any:
        if not isinstance(values, Mapping):
            return values
        left = dict(values)
        for (table_name, key), why in RETIRED_KEYS.items():
            if table_name == section and key in left:
                del left[key]
                notices.append(f"{where}: key {key!r} is no longer used and is ignored: {why}")
        return left

    if "dramatiq" in kept:
        kept["dramatiq"] = strip("[dramatiq]", "dramatiq", table(kept, "dramatiq"))
        if not kept["dramatiq"]:
            del kept["dramatiq"]
        else:
            unknown = sorted(kept["dramatiq"])[0]
            raise ConfigError(
                f"[dramatiq]: unknown key {unknown!r} (the table is no longer used: {_RELAY_GONE})"
            )
    if "acker" in kept:
        kept["acker"] = strip("[acker]", "acker", kept["acker"])
    if isinstance(kept.get("queues"), Mapping):
        kept["queues"] = {name: strip(f"[queues.{name}]", "queues", q) for name, q in kept["queues"].items()}
    return kept, tuple(notices)


def _history_covers_redelivery(
    acker: AckerSettings, adapters: tuple[AdapterConfig, ...], webhooks: tuple[WebhookConfig, ...]
) -> None:
    """A native id is deduplicated while its partition is kept: the history
    must outlast every adapter's redelivery, as an inbox row's retention must
    (``retain_acked_days``), and a webhook sender's retry span."""
    days = acker.retain_history_days
    if days is None:
        return
    for cfg in adapters:
        minimum_ms, horizon_ms, keys = dedup_minimum_ms(cfg.values())
        if days * DAY_MS < minimum_ms:
            raise ConfigError(
                f"[acker]: key 'retain_history_days' ({days:g} days) is shorter than adapter {cfg.name!r}"
                f" can redeliver ({keys} is {horizon_ms} ms): keep at least {minimum_ms / DAY_MS:.6g} days"
            )
    for hook in webhooks:
        span = SENDER_RETRY_DAYS[hook.mode]
        if days < span:
            raise ConfigError(
                f"[acker]: key 'retain_history_days' ({days:g} days) is shorter than webhook adapter"
                f" {hook.name!r}'s senders retry ({span:g} days): keep at least that"
            )


def from_mapping(raw: Mapping[str, Any], env: Mapping[str, str], base_dir: Path | None = None) -> Settings:
    """``base_dir`` anchors relative paths (the config file's directory)."""
    raw, notices = _without_retired(raw)
    check_keys("config", raw, _TOP_KEYS | {default_transport().name})
    database = DatabaseSettings(**DATABASE.read("[database]", table(raw, "database"), env=env))
    default_broker = _default_broker(raw, env)
    adapters = read_adapters(raw, default_broker, base_dir if base_dir is not None else Path.cwd(), env)
    webhooks = _webhooks(raw, base_dir if base_dir is not None else Path.cwd())
    _names_unique(adapters, webhooks)
    _key_spaces_apart(adapters, webhooks)
    ingest = IngestSettings(**INGEST.read("[ingest]", table(raw, "ingest")))
    _check_inflight_room(ingest, adapters)
    acker = AckerSettings(**ACKER.read("[acker]", table(raw, "acker")))
    _history_covers_redelivery(acker, adapters, webhooks)
    queues = {name: _queue(name, q) for name, q in table(raw, "queues").items()}
    return Settings(
        database=database,
        database_url_origin=DATABASE_URL_VARIABLE if env.get(DATABASE_URL_VARIABLE) else "[database] url",
        adapters=adapters,
        ingest=ingest,
        acker=acker,
        queues=queues,
        worker=WorkerSettings(**WORKER.read("[worker]", table(raw, "worker"))),
        metrics=_metrics(raw, env),
        default_broker_url=default_broker.url,
        webhooks=webhooks,
        receiver=ReceiverSettings(**RECEIVER.read("[receiver]", table(raw, "receiver"))),
        notices=notices,
    )


def _webhooks(raw: Mapping[str, Any], base_dir: Path) -> tuple[WebhookConfig, ...]:
    found = []
    for i, t in enumerate(adapter_tables(raw)):
        if is_webhook(t):
            name = t.get("name")
            label = f"adapter {name!r}" if isinstance(name, str) and name else f"adapters[{i}]"
            found.append(read_webhook(label, t, base_dir))
    return tuple(found)


def _names_unique(adapters: tuple[AdapterConfig, ...], webhooks: tuple[WebhookConfig, ...]) -> None:
    pulled = {a.name for a in adapters}
    names = [w.name for w in webhooks]
    for n in names:
        if n in pulled or names.count(n) > 1:
            raise ConfigError(f"adapter {n!r}: key 'name' is used by more than one adapter")


def _key_spaces_apart(adapters: tuple[AdapterConfig, ...], webhooks: tuple[WebhookConfig, ...]) -> None:
    """Two adapters whose keys begin alike (``{key_prefix}:{source}:``, DESIGN.md
    sections 5, 6b and 12) take a message of one and a message of the other
    that carry the same id for one message: one todo, where their queue is
    the same (the todos dedup on queue and key), and a trail that cannot
    tell them apart. Refused, unless both read the very same messages (a
    stream's groups, a channel's subscribers on one server), where the same
    key is the same message. A webhook's delivery ids are its sender's, so
    its keys are its own."""
    owners: dict[str, AdapterConfig | WebhookConfig] = {}
    every: list[AdapterConfig | WebhookConfig] = [*adapters, *webhooks]
    for a in every:
        first = owners.setdefault(a.key_space, a)
        if first is a:
            continue
        if (
            isinstance(first, AdapterConfig)
            and isinstance(a, AdapterConfig)
            and source_identity(first) == source_identity(a)
        ):
            continue
        raise ConfigError(
            f"adapter {a.name!r}: keys 'key_prefix' and 'source' make the keys of adapter {first.name!r}"
            f" ({a.key_space}...) from another source (broker, database, region, transport, mode or"
            " sender): a message of each with the same id would be taken for one, a single todo where"
            " their queue is the same; only adapters reading the very same messages (a stream's groups,"
            " a channel's subscribers) may share keys: give one of them a distinct key_prefix"
        )
    _key_spaces_not_nested(every)


def _key_spaces_not_nested(every: list[AdapterConfig | WebhookConfig]) -> None:
    """A key space inside another (``p:orders:`` and ``p:orders:eu:``) is
    refused where the outer one's ids are a producer's or a sender's (a
    transport's ``producer_ids``, a webhook's delivery id): the outer's
    message ``eu`` sent again with another body is stored under
    ``p:orders:eu:<digest>`` (a reused id's key), which the inner's message
    with that digest for its id spells too. A broker's own ids (a stream
    entry, a sequence number) cannot be ``eu``: nested spaces are fine there
    (streams ``orders`` and ``orders:eu``)."""
    for outer in every:
        if not _ids_from_outside(outer):
            continue
        for inner in every:
            if inner.key_space != outer.key_space and inner.key_space.startswith(outer.key_space):
                raise ConfigError(
                    f"adapter {inner.name!r}: its keys ({inner.key_space}...) lie inside those of adapter"
                    f" {outer.name!r} ({outer.key_space}...), whose ids its producers choose: a message of"
                    f" {outer.name!r} sent again under its id with another body takes a key that a message of"
                    f" {inner.name!r} can spell too: give one of them a distinct key_prefix"
                )


def _ids_from_outside(a: AdapterConfig | WebhookConfig) -> bool:
    return isinstance(a, WebhookConfig) or transport_definitions()[a.transport].producer_ids


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
