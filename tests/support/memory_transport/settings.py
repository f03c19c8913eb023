"""The in-memory transport as the config reads it: ``memory://NAME`` URLs,
one mode (``queue``), no keys of its own."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import SplitResult, urlsplit

from ingest.config.keys import string
from ingest.config.network import Unencrypted
from ingest.config.transport import (
    Adapter,
    DefaultBroker,
    Reader,
    TransportDefinition,
    figures_named,
    own_keys,
)
from ingest.errors import ConfigError

NAME = "memory"


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryOptions:
    """No keys of its own."""


KEYS = own_keys(NAME, MemoryOptions, "the in-memory test transport", "#memory")


def check_url(where: str, value: Any) -> str:
    url = string(where, value)
    parts = urlsplit(url)
    if parts.scheme != "memory" or not parts.netloc:
        raise ConfigError(f"{where} must be a memory://NAME URL")
    return url


def url_identity(parts: SplitResult) -> tuple[str, ...]:
    return (parts.netloc,)


def _plaintext(url: str, own: Any) -> Unencrypted | None:
    return None  # nothing leaves the process


def _default_url(env: Mapping[str, str], broker: DefaultBroker) -> str:
    return "memory://default"


def _reader(a: Adapter, identity: tuple[str, ...]) -> Reader | None:
    return None  # competing consumers: any number may read one queue


DEFINITION = TransportDefinition(
    name=NAME,
    modes=("queue",),
    keys=KEYS,
    key_prefix="memory",
    url_schemes=("memory",),
    check_url=check_url,
    plaintext=_plaintext,
    url_identity=url_identity,
    default_url=_default_url,
    default_url_doc="`memory://default`",
    reader=_reader,
    figures=figures_named({"ready": "backlog", "unacked": "in_flight"}),
)
