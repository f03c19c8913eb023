"""What a transport says of its broker's URL for the plaintext warning
(``ingest.observe.transport``, issue 32): a remote broker reached without
TLS. Each transport's definition answers for its own schemes
(``TransportDefinition.plaintext``); this module holds the rule they share. Nothing
is resolved or connected: the URL alone decides, and a name other than
``localhost`` counts as remote."""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from typing import NamedTuple
from urllib.parse import urlsplit


class Unencrypted(NamedTuple):
    """A remote broker reached in plain text: where, the scheme that says so,
    and how to encrypt it instead."""

    host: str
    port: int
    scheme: str
    hint: str


def is_local(host: str) -> bool:
    """A unix socket (a path, or Linux's abstract ``@name``), ``localhost``,
    or a loopback address."""
    if not host or host.startswith(("/", "@")):
        return True
    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name: counted as remote, never resolved here


def unencrypted_at(
    url: str, plain: Mapping[str, int], hint: str, *, default_host: str = "localhost"
) -> Unencrypted | None:
    """``url``'s broker if its scheme is one of ``plain`` (scheme: default
    port) and its host is not local; None otherwise (a TLS scheme, a socket)."""
    parts = urlsplit(url)
    if parts.scheme not in plain:
        return None
    try:
        host, port = parts.hostname or default_host, parts.port
    except ValueError:  # no port a URL parser reads: the server says, at connect
        host, port = parts.hostname or default_host, None
    if is_local(host):
        return None
    return Unencrypted(host, port or plain[parts.scheme], f"{parts.scheme}://", hint)
