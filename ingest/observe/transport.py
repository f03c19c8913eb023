"""A warning at start for each server a long-running process reaches
without TLS over the network (issue 32): the database without an
``sslmode`` that requires TLS, a broker by its plain-text scheme rather
than its TLS one. Loopback and unix sockets are exempt: nothing crosses a
network there.

What counts, read from the URL alone (nothing is resolved or connected):

* the database: its hosts (``host``, or ``hostaddr`` when given, else
  ``PGHOST``) and its ``sslmode`` (else ``PGSSLMODE``, else libpq's
  ``prefer``). ``prefer`` and ``allow`` try TLS but fall back to plain text
  without a word, which anyone on the path can force: only ``require``,
  ``verify-ca`` and ``verify-full`` (or ``gssencmode=require``) count as
  encrypted. No host at all is libpq's unix socket. A host name other than
  ``localhost`` counts as remote even if it resolves to loopback.
* a broker: by its transport's own rule (its definition's ``plaintext``,
  in its folder's ``settings``); ``unix://`` and a loopback host are exempt.

Each warning (``plaintext_connection``) names the server by its role, host
and port, never by its URL: no user name or password reaches the log.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import psycopg
import structlog
from psycopg.conninfo import conninfo_to_dict

from backhalf.db import libpq_url
from ingest.config import Settings
from ingest.config.network import Unencrypted, is_local
from ingest.config.transports import default as default_transport
from ingest.config.transports import definitions
from ingest.errors import ConfigError

log = structlog.get_logger(__name__)

DATABASE_HINT = "add sslmode=verify-full and sslrootcert=... to the database URL"
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
    hint: str = ""  # how to encrypt it


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
                "database",
                host,
                int(port) if port.strip().isdigit() else 5432,
                (),
                f"sslmode={sslmode}",
                DATABASE_HINT,
            )
        )
    return found


def _brokers(settings: Settings, verb: str) -> Iterator[tuple[str, Unencrypted | None]]:
    """(who uses it, its broker if remote in plain text) for each broker
    ``verb`` connects to, by its transport's own rule; one whose credential
    variables are unset is left out (the process stops on it)."""
    if verb not in ("ingest", "ack"):
        return
    for a in settings.adapters:
        try:
            yield f"adapter {a.name!r}", definitions()[a.transport].plaintext(a.broker.url(), a.options)
        except ConfigError:
            continue
    if verb == "ack" and not settings.adapters:  # for the adapters table's adapters
        home = default_transport()
        yield f"[{home.name}] url", home.plaintext(settings.default_broker_url, None)


def plaintext_servers(settings: Settings, verb: str, env: Mapping[str, str] | None = None) -> list[Plaintext]:
    """Every remote server ``verb`` reaches without TLS, each once with all its users."""
    env = os.environ if env is None else env
    found: dict[tuple[str, str, int | None, str], list[str]] = {}
    hints: dict[tuple[str, str, int | None, str], str] = {}
    for db in database_plaintext(settings.database.url, env):
        found.setdefault((db.server, db.host, db.port, db.tls), []).append(settings.database_url_origin)
    for who, broker in _brokers(settings, verb):
        if broker is not None:
            key = ("broker", broker.host, broker.port, broker.scheme)
            found.setdefault(key, []).append(who)
            hints[key] = broker.hint
    return [
        Plaintext(s, h, p, tuple(dict.fromkeys(users)), tls, hints.get((s, h, p, tls), DATABASE_HINT))
        for (s, h, p, tls), users in found.items()
    ]


def warn_plaintext(settings: Settings, verb: str, env: Mapping[str, str] | None = None) -> None:
    """Log ``plaintext_connection`` (a warning) for each server of
    :func:`plaintext_servers`."""
    for p in plaintext_servers(settings, verb, env):
        log.warning(
            "plaintext_connection",
            server=p.server,
            host=p.host,
            port=p.port,
            used_by=list(p.used_by),
            tls=p.tls,
            hint=f"{p.hint} (docs/security.md#tls)",
        )
