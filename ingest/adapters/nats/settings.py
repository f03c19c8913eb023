"""The NATS (JetStream) transport as the config reads it, no client
imported: its URL, its names, its credentials and its rules. Registered in
:mod:`ingest.config.transports`."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import SplitResult, urlsplit

from ingest.config.keys import string
from ingest.config.transport import (
    Adapter,
    DefaultBroker,
    Reader,
    TransportDefinition,
    Values,
    refuse_complete,
)
from ingest.config.url_shape import url_shape_problem
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
    url = string(where, value)
    parts = urlsplit(url)
    if parts.scheme not in ("nats", "tls"):
        raise ConfigError(f"{where} must be a nats:// or tls:// URL")
    problem = url_shape_problem(url)
    if problem is None and (parts.query or parts.path.strip("/")):
        problem = "a NATS URL has no path or query: nats://[USER:PASSWORD@]HOST:PORT"
    if problem is not None:
        raise ConfigError(f"{where} is not a valid URL: {problem}")
    return url


def url_identity(parts: SplitResult) -> tuple[str, ...]:
    return (parts.hostname or "localhost", str(parts.port or DEFAULT_PORT))


def _names(label: str, values: Values) -> None:
    for key in ("source", "group"):
        if not _NAME.fullmatch(values[key]):
            raise ConfigError(
                f"{label}: key {key!r} = {values[key]!r} is no JetStream stream or consumer name:"
                " no '.', '*', '>', '/', '\\' or whitespace (a subject goes in 'subject')"
            )


def _credentials(label: str, values: Values) -> dict[str, str | None]:
    """A NATS token is a URL's user name without a password (nats-py reads
    it so): ``token_env`` fills that place and excludes the other two."""
    if values.get("token_env") is None:
        return {"username_env": values["username_env"], "password_env": values["password_env"]}
    if values["username_env"] is not None or values["password_env"] is not None:
        raise ConfigError(f"{label}: key 'token_env' excludes 'username_env' and 'password_env': use one way")
    return {"username_env": values["token_env"], "password_env": None}


def _reader(a: Adapter, identity: tuple[str, ...]) -> Reader:
    return Reader(
        (*identity, a.group),
        "group",
        f"JetStream stream {a.source!r} with durable consumer {a.group!r}",
        "fan-out needs a distinct group",
    )


def _default_url(env: Mapping[str, str], default: DefaultBroker) -> str:
    return env.get(URL_VARIABLE) or DEFAULT_URL


DEFINITION = TransportDefinition(
    name=NAME,
    modes=("jetstream",),
    key_prefix="nats",
    extra="nats",
    url_schemes=("nats", "tls"),
    check_url=check_url,
    url_identity=url_identity,
    default_url=_default_url,
    default_url_doc=f"NATS `{URL_VARIABLE}`, else `{DEFAULT_URL}`",
    variables={URL_VARIABLE: "NATS adapters' URL when theirs is not set"},
    rules={
        "ack_after": refuse_complete(
            'mode = "jetstream": JetStream delivers a message again once it is unacked for ack_wait_ms,'
            " so an ack held for its todo's whole run would bring it back every ack_wait_ms;"
            ' use ack_after = "store"'
        ),
        "source": _names,
    },
    credentials=_credentials,
    redelivery_horizon=lambda values: (values["ack_wait_ms"], "ack_wait_ms"),
    reader=_reader,
)
