"""A warning at start for each server a long-running process reaches
without TLS over the network (issue 32): the database without an
``sslmode`` that requires TLS, a broker by ``redis://`` rather than
``rediss://``. Loopback and unix sockets are exempt: nothing crosses a
network there.

What counts, read from the URL alone (nothing is resolved or connected):

* the database: its hosts (``host``, or ``hostaddr`` when given, else
  ``PGHOST``) and its ``sslmode`` (else ``PGSSLMODE``, else libpq's
  ``prefer``). ``prefer`` and ``allow`` try TLS but fall back to plain text
  without a word, which anyone on the path can force: only ``require``,
  ``verify-ca`` and ``verify-full`` (or ``gssencmode=require``) count as
  encrypted. No host at all is libpq's unix socket. A host name other than
  ``localhost`` counts as remote even if it resolves to loopback.
* a broker: ``unix://`` and a loopback host are exempt, ``rediss://`` is TLS.

Each warning (``plaintext_connection``) names the server by its role, host
and port, never by its URL: no user name or password reaches the log.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

import psycopg
import structlog
from psycopg.conninfo import conninfo_to_dict

from backhalf.db import libpq_url
from ingest.config import BrokerUrl, Settings
from ingest.errors import ConfigError

log = structlog.get_logger(__name__)

ENCRYPTING_SSLMODES = frozenset({"require", "verify-ca", "verify-full"})
LIBPQ_DEFAULT_SSLMODE = "prefer"


@dataclass(frozen=True, slots=True)
class Plaintext:
    """One server reached without TLS over the network."""

    server: str  # "database", "broker"
    host: str
    port: int | None
    used_by: tuple[str, ...]  # "[database] url", "adapter 'orders'", "[dramatiq]"
    tls: str  # what the URL says instead: "sslmode=prefer", "redis://"


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


def database_plaintext(url: str, env: Mapping[str, str]) -> list[Plaintext]:
    """The database's remote hosts reached without TLS (none when TLS is
    required, or every host is local)."""
    try:
        params = conninfo_to_dict(libpq_url(url))
    except (psycopg.ProgrammingError, ValueError):
        return []  # not libpq's to read: the connection says why, at start
    sslmode = str(params.get("sslmode") or env.get("PGSSLMODE") or LIBPQ_DEFAULT_SSLMODE)
    if sslmode in ENCRYPTING_SSLMODES or str(params.get("requiressl", "")) == "1":
        return []
    if str(params.get("gssencmode") or env.get("PGGSSENCMODE") or "") == "require":
        return []  # encrypted by GSSAPI instead
    hosts = str(params.get("hostaddr") or params.get("host") or env.get("PGHOST") or "").split(",")
    ports = str(params.get("port") or env.get("PGPORT") or "").split(",")
    found = []
    for i, host in enumerate(h.strip() for h in hosts):
        if is_local(host):
            continue
        port = ports[i] if i < len(ports) else ports[0]
        found.append(
            Plaintext(
                "database", host, int(port) if port.strip().isdigit() else 5432, (), f"sslmode={sslmode}"
            )
        )
    return found


def broker_plaintext(url: str) -> Plaintext | None:
    """The broker at ``url`` if it is remote and reached without TLS."""
    parts = urlsplit(url)
    if parts.scheme == "http":  # an SQS-compatible endpoint without TLS
        host = parts.hostname or ""
        return None if is_local(host) else Plaintext("broker", host, parts.port or 80, (), "http://")
    if parts.scheme != "redis":  # rediss:// and https:// are TLS, unix:// a socket
        return None
    host = parts.hostname or "localhost"  # redis-py's default host
    if is_local(host):
        return None
    return Plaintext("broker", host, parts.port or 6379, (), "redis://")


def _brokers(settings: Settings, verb: str) -> Iterator[tuple[str, str]]:
    """(who uses it, URL) for each broker ``verb`` connects to; one whose
    credential variables are unset is left out (the process stops on it)."""
    named: list[tuple[str, BrokerUrl]] = []
    if verb in ("ingest", "ack"):
        named += [(f"adapter {a.name!r}", a.broker) for a in settings.adapters]
    if verb == "ack" and not settings.adapters:
        named.append(("[redis] url", BrokerUrl(settings.redis_url)))  # for the adapters table's adapters
    for who, broker in named:
        try:
            yield who, broker.url()
        except ConfigError:
            continue


def plaintext_servers(settings: Settings, verb: str, env: Mapping[str, str] | None = None) -> list[Plaintext]:
    """Every remote server ``verb`` reaches without TLS, each once with all its users."""
    env = os.environ if env is None else env
    found: dict[tuple[str, str, int | None, str], list[str]] = {}
    for db in database_plaintext(settings.database.url, env):
        found.setdefault((db.server, db.host, db.port, db.tls), []).append(settings.database_url_origin)
    for who, url in _brokers(settings, verb):
        broker = broker_plaintext(url)
        if broker is not None:
            found.setdefault((broker.server, broker.host, broker.port, broker.tls), []).append(who)
    return [Plaintext(s, h, p, tuple(dict.fromkeys(users)), tls) for (s, h, p, tls), users in found.items()]


def warn_plaintext(settings: Settings, verb: str, env: Mapping[str, str] | None = None) -> None:
    """Log ``plaintext_connection`` (a warning) for each server of
    :func:`plaintext_servers`."""
    for p in plaintext_servers(settings, verb, env):
        hint = (
            "add sslmode=verify-full and sslrootcert=... to the database URL"
            if p.server == "database"
            else "use https:// for the SQS endpoint"
            if p.tls == "http://"
            else "use rediss:// with ssl_ca_certs=... in the broker URL"
        )
        log.warning(
            "plaintext_connection",
            server=p.server,
            host=p.host,
            port=p.port,
            used_by=list(p.used_by),
            tls=p.tls,
            hint=f"{hint} (docs/security.md#tls)",
        )
