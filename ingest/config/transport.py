"""What the config knows of a transport: its :class:`TransportDefinition`.

Each transport's package defines its own, client-free, in
``ingest/adapters/<name>/settings.py``; :mod:`ingest.config.transports`
registers them. The reading of ``[[adapters]]`` (:mod:`ingest.config.adapter`)
asks the adapter's definition for everything that differs between
transports, and names none itself."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal, Protocol, TypedDict, TypeVar
from urllib.parse import SplitResult

from ingest.config.keys import Key, Rule, Section, string
from ingest.config.network import Unencrypted
from ingest.errors import ConfigError

Values = Mapping[str, Any]


class Located(Protocol):
    """Where a broker URL reaches (``ingest.config.urls.BrokerUrl``)."""

    def identity(self) -> tuple[str, ...]: ...


class Adapter(Protocol):
    """What a transport's checks read of an adapter read whole
    (``ingest.config.adapter.AdapterConfig``)."""

    @property
    def name(self) -> str: ...
    @property
    def transport(self) -> str: ...
    @property
    def mode(self) -> str: ...
    @property
    def source(self) -> str: ...
    @property
    def broker(self) -> Located: ...
    @property
    def options(self) -> Any: ...  # the transport's own keys, as its ``keys`` section reads them


@dataclass(frozen=True, slots=True)
class DefaultBroker:
    """The file's own broker (the default transport's table): its adapters
    that name no ``url`` use it, and take ``cluster`` from it."""

    url: str
    cluster: bool = False


@dataclass(frozen=True, slots=True)
class Sent:
    """When the broker took a message, read from its id: the moment, the
    words for the timeline, and the step's kind (the console's ``data-step``)."""

    at: datetime
    what: str
    kind: str


@dataclass(frozen=True, slots=True)
class Reader:
    """What one adapter reads, for the one-reader-each check: ``what`` is
    the same for two adapters that would split one source's messages;
    ``key`` the key the refusal names, ``read`` the source in words, ``hint``
    what to do instead."""

    what: tuple[str, ...]
    key: str
    read: str
    hint: str

    @classmethod
    def per_group(cls, identity: tuple[str, ...], group: str, read: str) -> Reader:
        """A source each consumer group reads once (fan-out is a group each)."""
        return cls((*identity, group), "group", read, "fan-out needs a distinct group")

    @classmethod
    def per_source(cls, identity: tuple[str, ...], read: str, hint: str) -> Reader:
        """A source read by one adapter only; ``hint`` says what fans out instead."""
        return cls(identity, "source", read, hint)


def no_credential_rule(label: str, values: Values) -> dict[str, str | None]:
    """User name and password variables as the table gives them."""
    return {"username_env": values["username_env"], "password_env": values["password_env"]}


def no_horizon(values: Values) -> tuple[int, str]:
    return 0, "no redelivery"


# A source's neutral figures, each one broker gauge (backhalf.metrics, set by
# ingest.observe.heartbeat): what the source holds, what it has not yet
# delivered, what is delivered and not yet acknowledged, the consumer's
# limit of those, a list's waiting items, the items on processing lists,
# and what went to a dead-letter queue unstored. A transport maps its own
# ``describe`` figures onto them (its definition's ``figures``).
Figure = Literal[
    "held", "backlog", "in_flight", "in_flight_limit", "list_backlog", "processing", "dead_lettered"
]
Figures = Callable[[Values], Mapping[Figure, float]]


def figures_named(names: Mapping[str, Figure]) -> Figures:
    """A transport's figures, read from the numbers its ``describe`` gives
    under these names (a missing or non-numeric one is left out)."""

    def read(described: Values) -> dict[Figure, float]:
        out: dict[Figure, float] = {}
        for key, figure in names.items():
            value = described.get(key)
            if isinstance(value, int | float) and not isinstance(value, bool):
                out[figure] = float(value)
        return out

    return read


def no_figures(described: Values) -> dict[Figure, float]:
    return {}


def as_written(source: str) -> str:
    return source


@dataclass(frozen=True, slots=True, kw_only=True)
class TransportDefinition:
    """A transport, as the config reads its adapters.

    ``modes``: its modes, the first its default. ``producer_ids``: its
    messages' ids are chosen by their producers, not by the broker.
    ``client_packages``: the top-level packages of its client library, whose
    errors the CLI explains as a broker's (none is imported). ``sent(mode,
    ack_kind, message_id)``: when the broker took a message, where its id
    says so (the first step of ``trace``'s timeline); ``bare_id``: the shape
    of a message id an operator may give alone to ``trace``. ``keys``: the keys of its
    own, read from the adapter's table after the shared ones into a frozen
    dataclass (``AdapterConfig.options``), each applying to the modes its
    Key names. ``key_prefix``: its idempotency keys' default prefix. ``extra``: the install extra that
    brings its client (None: a dependency of Switchboard itself).

    ``file_table``: the file's own table of the transport, ``[<name>]``,
    read for the default transport only: its ``url`` (default
    ``default_url_value``) and ``cluster`` are the :class:`DefaultBroker`.

    Its URL: ``url_schemes`` it speaks, ``check_url(where, value)`` (never
    echoing the URL), ``plaintext(url, options)`` (its server, if remote and
    reached without TLS: the start-up warning; ``options`` None for the
    file's own broker), ``url_identity(parts)`` (which server, whoever logs
    in), ``default_url(env, default_broker)`` where a table names none, and
    ``default_url_doc`` saying so in the reference. ``variables``: the
    environment variables it reads, and what for (``switchboard --help``).

    Its rules: its own keys' rules (in ``keys``), and ``rules`` of the
    shared keys, by key, each run after that key is read;
    ``table_defaults(raw, default_broker)``, values a table that names none
    takes; ``credentials(label, values)``, the variables
    that complete its URL; ``redelivery_horizon(values)``, how long after a
    delivery its broker may deliver a message again, and from which keys;
    ``reader(adapter, identity)``, what an adapter reads (None: any number
    may); ``across(adapters)``, a check over all of this transport's
    adapters of a file; ``queue_name(source)``, the source's name in its
    keys; ``located(adapter)``, the source as the one-reader check tells
    sources apart.

    Its status: ``figures(described)``, its adapters' ``describe`` figures
    as the neutral :data:`Figure` s the broker gauges report."""

    name: str
    modes: tuple[str, ...]
    keys: Section
    producer_ids: bool = False
    client_packages: tuple[str, ...] = ()
    sent: Callable[[str | None, str | None, str | None], Sent | None] | None = None
    bare_id: re.Pattern[str] | None = None
    file_table: Section | None = None
    default_url_value: str | None = None
    key_prefix: str
    extra: str | None = None
    url_schemes: tuple[str, ...]
    check_url: Callable[[str, Any], str]
    plaintext: Callable[[str, Any], Unencrypted | None]
    url_identity: Callable[[SplitResult], tuple[str, ...]]
    default_url: Callable[[Mapping[str, str], DefaultBroker], str]
    default_url_doc: str
    variables: Mapping[str, str] = field(default_factory=dict)
    rules: Mapping[str, Rule] = field(default_factory=dict)
    table_defaults: Callable[[Values, DefaultBroker], dict[str, Any]] | None = None
    credentials: Callable[[str, Values], dict[str, str | None]] = no_credential_rule
    redelivery_horizon: Callable[[Values], tuple[int, str]] = no_horizon
    reader: Callable[[Adapter, tuple[str, ...]], Reader | None]
    across: Callable[[Sequence[Adapter]], None] | None = None
    queue_name: Callable[[str], str] = as_written
    located: Callable[[Adapter], str] | None = None
    figures: Figures = no_figures

    def rule(self, key: str, label: str, values: Values) -> None:
        """This transport's rule of ``key``, if it has one."""
        rule = self.rules.get(key)
        if rule is not None:
            rule(label, values)


def refuse_complete(reason: str) -> Rule:
    """A rule of ``ack_after``: "complete" refused; ``reason`` goes on from
    "does not apply to"."""

    def rule(label: str, values: Values) -> None:
        if values["ack_after"] == "complete":
            raise ConfigError(f"{label}: key 'ack_after' = \"complete\" does not apply to {reason}")

    return rule


_Options = TypeVar("_Options")


def options_of(adapter: Adapter, kind: type[_Options]) -> _Options:
    """``adapter``'s own keys as its transport's ``kind`` (a TypeError for
    another transport's adapter)."""
    found = adapter.options
    if not isinstance(found, kind):
        raise TypeError(f"adapter {adapter.name!r}: its own keys are no {kind.__name__}")
    return found


class UrlFromVariable(TypedDict):
    """A transport definition's ``default_url``, its doc and its variable."""

    default_url: Callable[[Mapping[str, str], DefaultBroker], str]
    default_url_doc: str
    variables: Mapping[str, str]


def url_from_variable(
    label: str, variable: str, fallback: str, purpose: str, fallback_doc: str = ""
) -> UrlFromVariable:
    """Where a table names no URL: ``variable`` when set (``purpose`` says
    what for in ``--help``), else ``fallback``; ``label`` names the
    transport in the reference, ``fallback_doc`` adds to the fallback's."""

    def default_url(env: Mapping[str, str], default: DefaultBroker) -> str:
        return env.get(variable) or fallback

    return UrlFromVariable(
        default_url=default_url,
        default_url_doc=f"{label} `{variable}`, else `{fallback}`{fallback_doc}",
        variables={variable: purpose},
    )


def ca_file_key(verifies: str) -> Key:
    """The ``tls_ca_file`` key of a transport: the CA file that verifies
    ``verifies``."""
    return Key(
        parse=string,
        doc=f"the CA file that verifies {verifies}",
        default_doc="the system's CAs",
    )


def own_keys(transport: str, keys: type, adapters: str, anchor: str = "") -> Section:
    """A transport's own keys as the config reference shows them: a table
    ``[[adapters]] with transport = "<transport>"``, introduced by what
    ``adapters`` are, linked to their section of transports.md."""
    return Section(
        f'[[adapters]] with transport = "{transport}"',
        keys,
        intro=f"The keys of {adapters}, beside the shared ones ([transports.md](transports.md{anchor})).",
    )
