"""The push family's settings (DESIGN.md section 12): ``[receiver]``, and the
``[[adapters]]`` tables with ``transport = "webhook"``, read by their own
definitions (:class:`WebhookConfig`): none of the pull keys (a broker URL, a
batch size, an ack) means anything to a webhook, so none is accepted on one.

Secrets are named, never written: ``secrets_env`` lists the variables that
hold them, read when ``switchboard receive`` starts (the other processes read
a config with webhook adapters without needing their secrets)."""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

from backhalf.writes.body_schema import DEFAULT_SCHEMA_TIMEOUT_MS, BodySchema
from backhalf.writes.keys import native_key
from backhalf.writes.normalize import DEFAULT_MAX_MESSAGE_BYTES, BodyFormat
from ingest.config.body import Format, SchemaTimeoutMs, body_schema
from ingest.config.keys import DAYS_TYPE, Derived, Key, Rule, Section, days, got, string
from ingest.config.urls import env_name
from ingest.errors import ConfigError

WEBHOOK = "webhook"
WEBHOOK_MODES = ("standard-webhooks", "github", "stripe")
TIMESTAMPED = ("standard-webhooks", "stripe")  # the modes whose deliveries carry a signed timestamp
DEFAULT_WEBHOOK_PREFIX = "webhook"
DEFAULT_LISTEN = "127.0.0.1:8080"
DAY_S = 86_400
# How long each sender keeps retrying (or lets an operator redeliver) one
# delivery: the inbox row that dedups it must outlive that, or a retry after
# the row is pruned makes a second todo. Standard Webhooks senders (Svix)
# retry for about 28 hours, Stripe for 3 days, GitHub redelivers on request
# deliveries up to 3 days old.
SENDER_RETRY_DAYS: Mapping[str, float] = {"standard-webhooks": 3, "github": 3, "stripe": 3}
MAX_BODY_BYTES = 64 * 1024 * 1024  # a delivery is held in memory whole while it is checked and stored
STANDARD_SECRET_PREFIX = "whsec_"  # noqa: S105 - a prefix, no secret


_ROUTE_NAME = re.compile(r"[A-Za-z0-9._-]{1,100}")


def _route_name(where: str, value: Any) -> str:
    if not isinstance(value, str) or not _ROUTE_NAME.fullmatch(value):
        raise ConfigError(
            f"{where} must be a name for the route /hooks/NAME: 1 to 100 letters, digits, '.', '_' or '-'"
            f" (got {value!r})"
        )
    return value


def _webhook_mode(where: str, value: Any) -> str:
    if value not in WEBHOOK_MODES:
        raise ConfigError(f"{where} must be one of {', '.join(WEBHOOK_MODES)} {got(value, WEBHOOK_MODES)}")
    return str(value)


def _transport(where: str, value: Any) -> str:
    if value != WEBHOOK:
        raise ConfigError(f"{where} must be {WEBHOOK!r} here (got {value!r})")
    return WEBHOOK


def _secret_names(where: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{where} must be a list of environment variable names, at least one")
    names = tuple(env_name(where, v) for v in value)
    if len(set(names)) != len(names):
        raise ConfigError(f"{where} names a variable twice")
    return names


def _covers_sender_retries(key: str) -> Rule:
    def rule(label: str, values: Mapping[str, Any]) -> None:
        kept = values.get(key)
        span = SENDER_RETRY_DAYS[values["mode"]]
        if kept is not None and kept < span:
            raise ConfigError(
                f"{label}: key {key!r} ({kept:g} days) is shorter than {values['mode']} senders retry a"
                f" delivery ({span:g} days): a retry that comes after its inbox row is pruned would make a"
                f" second todo; keep rows at least {span:g} days"
            )

    return rule


def _retention(key: str, doc: str) -> Key:
    return Key(
        parse=days,
        rule=_covers_sender_retries(key),
        doc=doc,
        default_doc="none: kept forever",
        type_doc=DAYS_TYPE,
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class WebhookConfig:
    """One ``[[adapters]]`` table with ``transport = "webhook"``."""

    name: Annotated[
        str,
        Key(
            public=False,
            parse=_route_name,
            doc="the adapter's name: its route is `POST /hooks/{name}`",
            type_doc="letters, digits, `.`, `_`, `-`",
        ),
    ]
    transport: Annotated[str, Key(public=False, parse=_transport, doc='`"webhook"`')] = WEBHOOK
    mode: Annotated[
        str,
        Key(
            public=False,
            parse=_webhook_mode,
            doc="how deliveries are signed: `standard-webhooks`, `github` or `stripe`"
            " ([webhooks.md](webhooks.md))",
        ),
    ] = "standard-webhooks"
    source: Annotated[str, Key(doc="the key's middle part", default_doc="the adapter's `name`")]
    queue: Annotated[str, Key(doc="the todo queue", default_doc="the adapter's `name`")]
    key_prefix: Annotated[str, Key(doc="idempotency keys: `{key_prefix}:{source}:{delivery id}`")] = (
        DEFAULT_WEBHOOK_PREFIX
    )
    secrets_env: Annotated[
        tuple[str, ...],
        Key(
            public=False,
            parse=_secret_names,
            doc="the variables holding the signing secrets; every one is tried, so a new secret is added"
            " before the old one goes ([webhooks.md](webhooks.md#rotating-a-secret))",
            type_doc="list of variable names",
        ),
    ]
    # GitHub's deliveries carry no timestamp: the dedup horizon
    # (retain_acked_days) is that mode's only replay defence.
    tolerance_s: Annotated[
        int,
        Key(
            TIMESTAMPED,
            maximum=86_400,
            doc="a delivery whose signed timestamp is further than this from now is refused (401)",
        ),
    ] = 300
    format: Format = BodyFormat.JSON
    max_message_bytes: Annotated[
        int, Key(maximum=MAX_BODY_BYTES, doc="a larger body is refused (413), nothing stored")
    ] = DEFAULT_MAX_MESSAGE_BYTES
    schema: Annotated[
        str | None,
        Key(
            parse=string,
            doc="a JSON Schema file the body must satisfy, else it is stored as rejected (and answered 200);"
            " relative to the config file",
        ),
    ] = None
    schema_timeout_ms: SchemaTimeoutMs = DEFAULT_SCHEMA_TIMEOUT_MS
    retain_acked_days: Annotated[
        float | None,
        _retention(
            "retain_acked_days",
            "days stored rows are kept, with their events: the dedup horizon, at least the senders' retry"
            " span (3 days)",
        ),
    ] = None
    retain_rejected_days: Annotated[
        float | None,
        _retention("retain_rejected_days", "days rejected rows are kept (at least the senders' retry span)"),
    ] = None
    body_schema: Annotated[BodySchema | None, Derived()] = field(default=None, compare=False, repr=False)

    @property
    def key_space(self) -> str:
        """What each of this adapter's idempotency keys begins with:
        ``{key_prefix}:{source}:``, the delivery id after it."""
        return native_key(self.key_prefix, self.source, "")

    def public_settings(self) -> dict[str, Any]:
        """What goes into ``adapters.settings``: never the secrets' names."""
        return WEBHOOKS.public_values(self, self.mode)


WEBHOOKS = Section(
    '[[adapters]] with transport = "webhook"',
    WebhookConfig,
    intro="A push adapter: `switchboard receive` serves its deliveries at `POST /hooks/{name}`"
    " ([webhooks.md](webhooks.md)). None of the pull keys applies.",
)


def read_webhook(label: str, raw: Mapping[str, Any], base_dir: Path) -> WebhookConfig:
    name = raw.get("name")
    values = WEBHOOKS.read(label, raw, defaults={"queue": name, "source": name})
    return WebhookConfig(**{**values, **body_schema(label, values, base_dir)})


@dataclass(frozen=True, slots=True)
class Secret:
    """One signing secret: the variable it came from (named in events and
    messages, as the label of the secret that matched) and its key bytes.
    The repr shows the name only."""

    name: str
    key: bytes = field(repr=False)


def resolve_secrets(cfg: WebhookConfig, env: Mapping[str, str]) -> tuple[Secret, ...]:
    """The secrets of ``cfg`` from ``env``: an unset or empty variable, or a
    Standard Webhooks secret that is no base64, is a ConfigError naming the
    adapter and the variable, never a value."""
    label = f"adapter {cfg.name!r}: key 'secrets_env'"
    secrets = []
    for name in cfg.secrets_env:
        text = env.get(name, "")
        if not text:
            raise ConfigError(f"{label}: variable {name} is unset or empty")
        secrets.append(Secret(name, _key_bytes(label, cfg.mode, name, text)))
    return tuple(secrets)


_BASE64 = re.compile(r"[A-Za-z0-9+/]+={0,2}")


def _key_bytes(label: str, mode: str, name: str, text: str) -> bytes:
    """The HMAC key: a Standard Webhooks secret is ``whsec_`` and base64 (the
    key is the decoded bytes); GitHub's and Stripe's are used as written
    (Stripe's whole ``whsec_...`` string is its key)."""
    if mode != "standard-webhooks":
        return text.encode()
    # Padding optional, as the reference library takes it.
    encoded = text.removeprefix(STANDARD_SECRET_PREFIX).rstrip("=")
    encoded += "=" * (-len(encoded) % 4)
    not_base64 = ConfigError(
        f"{label}: variable {name} is no Standard Webhooks secret: 'whsec_' and base64 expected"
    )
    if not _BASE64.fullmatch(encoded):
        raise not_base64
    try:
        key = base64.b64decode(encoded, validate=True)
    except binascii.Error as exc:
        raise not_base64 from exc
    if len(key) < 16:
        raise ConfigError(f"{label}: variable {name} holds a key of {len(key)} bytes: at least 16 expected")
    return key


def check_listen(where: str, value: Any) -> str:
    """``HOST:PORT`` (``[::1]:8080`` for an IPv6 address)."""
    text = string(where, value)
    host, port = split_listen(text)
    if not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise ConfigError(f"{where} must be HOST:PORT, such as 127.0.0.1:8080 (got {text!r})")
    return text


def split_listen(text: str) -> tuple[str, str]:
    host, _, port = text.rpartition(":")
    return host.removeprefix("[").removesuffix("]"), port


def _body_within_respond(label: str, values: Mapping[str, Any]) -> None:
    if "respond_within_ms" in values and values["body_timeout_ms"] >= values["respond_within_ms"]:
        raise ConfigError(
            f"{label}: key 'body_timeout_ms' ({values['body_timeout_ms']}) must be below respond_within_ms"
            f" ({values['respond_within_ms']}): the body is read inside the request's deadline"
        )


@dataclass(frozen=True, slots=True)
class ReceiverSettings:
    """``[receiver]``: the HTTP server of ``switchboard receive``."""

    listen: Annotated[
        str,
        Key(
            parse=check_listen,
            doc="where `switchboard receive` listens, `HOST:PORT`; `--listen` overrides it",
            type_doc="HOST:PORT",
        ),
    ] = DEFAULT_LISTEN
    # Below the shortest sender's own timeout (GitHub's 10 s): past it the
    # sender retries anyway, so an answer later than that helps nobody.
    respond_within_ms: Annotated[
        int,
        Key(
            minimum=100,
            maximum=60_000,
            doc="each request is answered within this; a store not committed by then is answered 503 (the"
            " sender retries, the key dedups)",
        ),
    ] = 8_000
    body_timeout_ms: Annotated[
        int,
        Key(
            minimum=100,
            rule=_body_within_respond,
            doc="a body that has not fully arrived within this is answered 408",
        ),
    ] = 5_000


RECEIVER = Section(
    "[receiver]",
    ReceiverSettings,
    intro="The HTTP server of `switchboard receive` ([webhooks.md](webhooks.md)).",
)
