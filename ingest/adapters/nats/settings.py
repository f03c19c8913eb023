"""The NATS (JetStream) transport as the config reads it, no client
imported: its URL, its names, its credentials and its rules. Registered in
:mod:`ingest.config.transports`."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Any
from urllib.parse import SplitResult, urlsplit

from ingest.config import transport
from ingest.config.keys import Key, string
from ingest.config.network import Unencrypted, unencrypted_at
from ingest.config.url_shape import checked_url
from ingest.config.urls import env_name
from ingest.errors import ConfigError

NAME = "nats"
URL_VARIABLE = "SWITCHBOARD_NATS_URL"
DEFAULT_URL = "nats://127.0.0.1:4222"
DEFAULT_PORT = 4222
# A JetStream stream or consumer name: no subject wildcards or separators,
# no path characters, no whitespace (the server's own rule).
_NAME = re.compile(r"[^.*>/\\\s]+")


def check_url(where: str, value: Any) -> str:
    """A NATS server URL (``nats://`` plain, ``tls://`` TLS), checked
    without ever echoing it; nats-py reads no query."""
    return checked_url(where, value, ("nats", "tls"), "a nats:// or tls:// URL", _url_problem)


def _url_problem(url: str) -> str | None:
    parts = urlsplit(url)
    if parts.query or parts.path.strip("/"):
        return "a NATS URL has no path or query: nats://[USER:PASSWORD@]HOST:PORT"
    return None


def url_identity(parts: SplitResult) -> tuple[str, ...]:
    return (parts.hostname or "localhost", str(parts.port or DEFAULT_PORT))


def _names(label: str, values: transport.Values) -> None:
    for key in ("source", "group"):
        if not _NAME.fullmatch(values[key]):
            raise ConfigError(
                f"{label}: key {key!r} = {values[key]!r} is no JetStream stream or consumer name:"
                " no '.', '*', '>', '/', '\\' or whitespace (a subject goes in 'subject')"
            )


def _credentials(label: str, values: transport.Values) -> dict[str, str | None]:
    """A NATS token is a URL's user name without a password (nats-py reads
    it so): ``token_env`` fills that place and excludes the other two."""
    if values.get("token_env") is None:
        return {"username_env": values["username_env"], "password_env": values["password_env"]}
    if values["username_env"] is not None or values["password_env"] is not None:
        raise ConfigError(f"{label}: key 'token_env' excludes 'username_env' and 'password_env': use one way")
    return {"username_env": values["token_env"], "password_env": None}


def _reader(a: transport.Adapter, identity: tuple[str, ...]) -> transport.Reader:
    group = options(a).group
    return transport.Reader.per_group(
        identity, group, f"JetStream stream {a.source!r} with durable consumer {group!r}"
    )


# A delivery unacked this long comes again; bounded as SQS's visibility is.
MAX_ACK_WAIT_MS = 43_200_000


@dataclass(frozen=True, slots=True, kw_only=True)
class NatsOptions:
    """A NATS adapter's own keys (``AdapterConfig.options``)."""

    group: Annotated[
        str,
        Key(rule=_names, doc="the JetStream durable pull consumer, created when missing"),
    ] = "switchboard"
    subject: Annotated[
        str | None,
        Key(parse=string, doc="a subject filter for the durable consumer", default_doc="none: all"),
    ] = None
    max_ack_pending: Annotated[
        int,
        Key(
            maximum=1_000_000,
            doc="deliveries the consumer may have unacked; past it the server delivers nothing more"
            " ([transports.md](transports.md#nats-jetstream))",
        ),
    ] = 20_000
    ack_wait_ms: Annotated[
        int,
        Key(
            minimum=1000,
            maximum=MAX_ACK_WAIT_MS,
            doc="an unacked delivery is redelivered after this (keep well above read + commit + ack)",
        ),
    ] = 60_000
    credentials_file_env: Annotated[
        str | None,
        Key(
            public=False,
            parse=env_name,
            doc="the variable holding the path of a NATS `.creds` file (JWT and NKey seed)",
        ),
    ] = None
    token_env: Annotated[
        str | None, Key(public=False, parse=env_name, doc="the variable holding a NATS auth token")
    ] = None
    tls_ca_file: Annotated[
        str | None,
        transport.ca_file_key("the server's certificate (a `tls://` URL, or the server requires it)"),
    ] = None


def options(adapter: transport.Adapter) -> NatsOptions:
    """``adapter``'s own keys."""
    return transport.options_of(adapter, NatsOptions)


KEYS = transport.own_keys(
    NAME, NatsOptions, "the NATS JetStream adapters (mode `jetstream`)", "#nats-jetstream"
)


def plaintext(url: str, own: NatsOptions | None) -> Unencrypted | None:
    """A NATS server if remote and reached by ``nats://`` without
    ``tls_ca_file`` (either makes the client speak TLS)."""
    if own is not None and own.tls_ca_file is not None:
        return None
    return unencrypted_at(url, {"nats": DEFAULT_PORT}, "use tls:// (or tls_ca_file) for the NATS server")


# The stream's messages, and the consumer's undelivered, unacked and limit of unacked.
_FIGURES = transport.figures_named(
    {
        "stream_messages": "held",
        "num_pending": "backlog",
        "num_ack_pending": "in_flight",
        "max_ack_pending": "in_flight_limit",
    }
)


DEFINITION = transport.TransportDefinition(
    name=NAME,
    modes=("jetstream",),
    keys=KEYS,
    client_packages=("nats",),
    key_prefix="nats",
    extra="nats",
    url_schemes=("nats", "tls"),
    check_url=check_url,
    plaintext=plaintext,
    url_identity=url_identity,
    **transport.url_from_variable(
        "NATS", URL_VARIABLE, DEFAULT_URL, "NATS adapters' URL when theirs is not set"
    ),
    rules={
        "ack_after": transport.refuse_complete(
            'mode = "jetstream": JetStream delivers a message again once it is unacked for ack_wait_ms,'
            " so an ack held for its todo's whole run would bring it back every ack_wait_ms;"
            ' use ack_after = "store"'
        ),
    },
    credentials=_credentials,
    redelivery_horizon=lambda values: (values["ack_wait_ms"], "ack_wait_ms"),
    reader=_reader,
    figures=_FIGURES,
)
