"""URLs and broker credentials: checked at load, and never echoed.

A database URL must be PostgreSQL for psycopg 3, a broker URL one redis-py
reads as meant; a broker's user name and password may come from environment
variables the config names (:func:`with_credentials`); a URL whose variables
are unset is a :class:`BrokerUrl` that raises, not a URL without them."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, unquote, urlsplit, urlunsplit

from redis.asyncio.connection import parse_url
from sqlalchemy.engine import make_url

from backhalf.db import normalize_url
from ingest.config.keys import string
from ingest.errors import ConfigError

# Messages about a URL never quote it, nor any piece of it: a password with an
# unencoded reserved character is split at that character by every parser, so
# a "host" or "port" read from such a URL may be part of the password.
_ENCODE_RULE = (
    "a reserved character in the password must be percent-encoded"
    " (@ as %40, / as %2F, ? as %3F, # as %23, % as %25, a space as %20)"
)


def _url_shape_problem(url: str) -> str | None:
    """Why ``url`` cannot be split into its parts as intended, or None."""
    if any(c.isspace() for c in url):
        return f"contains whitespace; {_ENCODE_RULE}"
    try:
        parts = urlsplit(url)
        _ = parts.port  # raises ValueError: a port that is no number, or out of range
    except ValueError:
        return f"has a port that is not a number, or {_ENCODE_RULE}"
    # An unencoded '?' or '#' in the password moves the rest of the URL, its
    # '@' included, into the query or the fragment.
    moved = (parts.path, parts.query, parts.fragment)
    if parts.netloc.count("@") > 1 or any("@" in piece for piece in moved):
        return _ENCODE_RULE
    return None


# What redis-py reads from a URL's query (redis.asyncio.connection.parse_url, with
# which it builds its connections); TLS options only for rediss://. Any other
# key would reach the connection as an unexpected keyword and fail there.
_REDIS_QUERY = frozenset(
    {
        "db", "socket_timeout", "socket_connect_timeout", "socket_read_size", "socket_keepalive",
        "retry_on_timeout", "max_connections", "health_check_interval", "timeout", "protocol",
        "client_name",
    }
)  # fmt: skip
_REDIS_TLS_QUERY = frozenset(
    {
        "ssl_ca_certs", "ssl_ca_path", "ssl_ca_data", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs",
        "ssl_password", "ssl_check_hostname", "ssl_min_version", "ssl_include_verify_flags",
        "ssl_exclude_verify_flags",
    }
)  # fmt: skip


def _redis_query_problem(url: str) -> str | None:
    """A query parameter redis-py would not take, or take badly; never named
    from the URL itself, which may hold a piece of a password."""
    parts = urlsplit(url)
    allowed = _REDIS_QUERY | (_REDIS_TLS_QUERY if parts.scheme == "rediss" else frozenset())
    keys = {item.partition("=")[0] for item in parts.query.split("&") if item}
    if keys - allowed:
        return f"has a query parameter redis-py does not take (allowed: {', '.join(sorted(allowed))})"
    try:
        parse_url(url)
    except ValueError:
        return "has a query parameter whose value redis-py cannot read (a number or a boolean)"
    return None


def check_redis_url(where: str, value: Any) -> str:
    """A broker URL, checked without ever echoing it: ``where`` names where
    it came from (a config key, or the environment variable)."""
    url = string(where, value)
    if urlsplit(url).scheme not in ("redis", "rediss", "unix"):
        raise ConfigError(f"{where} must be a redis://, rediss:// or unix:// URL")
    problem = _url_shape_problem(url) or _redis_query_problem(url)
    if problem is not None:
        raise ConfigError(f"{where} is not a valid URL: {problem}")
    return url


def check_nats_url(where: str, value: Any) -> str:
    """A NATS server URL (``nats://`` plain, ``tls://`` TLS), checked as
    :func:`check_redis_url` checks its own; nats-py reads no query."""
    url = string(where, value)
    parts = urlsplit(url)
    if parts.scheme not in ("nats", "tls"):
        raise ConfigError(f"{where} must be a nats:// or tls:// URL")
    problem = _url_shape_problem(url)
    if problem is None and (parts.query or parts.path.strip("/")):
        problem = "a NATS URL has no path or query: nats://[USER:PASSWORD@]HOST:PORT"
    if problem is not None:
        raise ConfigError(f"{where} is not a valid URL: {problem}")
    return url


# An SQS adapter's ``url`` when neither it nor SWITCHBOARD_SQS_ENDPOINT_URL
# names an endpoint: AWS's own, of the adapter's region (botocore finds it).
AWS_ENDPOINT = "aws://"


def check_sqs_url(where: str, value: Any) -> str:
    """An SQS-compatible endpoint (``https://``, or ``http://`` for an
    emulator), or ``aws://``: AWS's own endpoint of the region. No user
    information: AWS credentials come from AWS's chain, never a URL."""
    url = string(where, value)
    if url == AWS_ENDPOINT:
        return url
    parts = urlsplit(url)
    if parts.scheme not in ("https", "http"):
        raise ConfigError(f"{where} must be an https:// (or http://) SQS endpoint, or {AWS_ENDPOINT}")
    problem = _url_shape_problem(url)
    if problem is None and "@" in parts.netloc:
        problem = (
            "an SQS endpoint carries no credentials: AWS's chain gives them (environment, profile, role)"
        )
    if problem is None and (parts.query or parts.fragment or parts.path.strip("/")):
        problem = "an SQS endpoint has no path or query: https://HOST[:PORT] (a queue URL goes in 'source')"
    if problem is not None:
        raise ConfigError(f"{where} is not a valid URL: {problem}")
    return url


AMQP_PORT, AMQPS_PORT = 5672, 5671


def check_amqp_url(where: str, value: Any) -> str:
    """A RabbitMQ (AMQP 0-9-1) URL: ``amqp://`` plain, ``amqps://`` TLS
    (verified against ``tls_ca_file`` or the system's CAs); its path is the
    virtual host (percent-encoded: ``%2F`` is ``/``, the default when there
    is no path). No query: TLS comes from ``tls_ca_file``, and the client's
    other options are Switchboard's."""
    url = string(where, value)
    parts = urlsplit(url)
    if parts.scheme not in ("amqp", "amqps"):
        raise ConfigError(f"{where} must be an amqp:// or amqps:// URL")
    problem = _url_shape_problem(url)
    if problem is None and (parts.query or parts.fragment):
        problem = "an AMQP URL here has no query: amqp[s]://[USER:PASSWORD@]HOST[:PORT][/VHOST]"
    if problem is None and "/" in parts.path.strip("/"):
        problem = "the path is the virtual host, one segment (a '/' in its name is written %2F)"
    if problem is not None:
        raise ConfigError(f"{where} is not a valid URL: {problem}")
    return url


def amqp_vhost(url: str) -> str:
    """The virtual host an AMQP URL names: its path, decoded; ``/`` without one."""
    return unquote(urlsplit(url).path[1:]) or "/"


# Each transport's URL check, by the transport's name.
URL_CHECKS = {"redis": check_redis_url, "nats": check_nats_url, "sqs": check_sqs_url, "amqp": check_amqp_url}


def check_broker_url(where: str, value: Any) -> str:
    """A URL some transport takes; the adapter's transport then checks it
    as its own (``URL_CHECKS``), once the transport is known."""
    url = string(where, value)
    scheme = urlsplit(url).scheme
    if scheme in ("nats", "tls"):
        return check_nats_url(where, url)
    if scheme in ("http", "https", "aws"):
        return check_sqs_url(where, url)
    if scheme in ("amqp", "amqps"):
        return check_amqp_url(where, url)
    return check_redis_url(where, url)


NATS_PORT = 4222

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def env_name(where: str, value: Any) -> str:
    """The name of an environment variable (a name, never a secret: quoted)."""
    if not isinstance(value, str) or not _ENV_NAME.fullmatch(value):
        raise ConfigError(f"{where} must name an environment variable: letters, digits and _ (got {value!r})")
    return value


def with_credentials(
    where: str, url: str, env: Mapping[str, str], *, username_env: str | None, password_env: str | None
) -> str:
    """``url`` with its user name and password taken from the variables
    named, so a broker password need not be written in the config file. A
    variable unset or empty is an error naming ``where``, the key and the
    variable, never a value. Each is percent-encoded into the URL, so any
    character may be in it."""
    if username_env is None and password_env is None:
        return url

    def read(key: str, variable: str) -> str:
        value = env.get(variable)
        if not value:
            raise ConfigError(
                f"{where}: key {key!r}: the environment variable {variable!r} is not set or empty"
            )
        return quote(value, safe="")

    parts = urlsplit(url)
    userinfo, at, hostinfo = parts.netloc.rpartition("@")
    # What the URL gives stays as it is written (already percent-encoded).
    user, _, password = userinfo.partition(":") if at else ("", "", "")
    if username_env is not None:
        user = read("username_env", username_env)
    if password_env is not None:
        password = read("password_env", password_env)
    userinfo = user + (f":{password}" if password else "")
    return urlunsplit(parts._replace(netloc=f"{userinfo}@{hostinfo}" if userinfo else hostinfo))


def database_url(where: str, value: Any) -> str:
    """A PostgreSQL URL in its psycopg 3 form, checked without echoing it."""
    url = string(where, value)
    if any(c.isspace() for c in url):
        raise ConfigError(f"{where} is not a valid URL: contains whitespace; {_ENCODE_RULE}")
    try:
        parsed = make_url(url)
    except Exception as exc:  # SQLAlchemy's URL parser raises several types; their texts quote the URL
        raise ConfigError(
            f"{where} is not a database URL ({type(exc).__name__}): the form is"
            f" postgresql://USER:PASSWORD@HOST:PORT/DATABASE, and {_ENCODE_RULE}"
        ) from exc
    if parsed.get_backend_name() not in ("postgresql", "postgres"):
        # The scheme is letters, digits and "+.-": no secret in it.
        raise ConfigError(
            f"{where} must be a PostgreSQL URL (postgresql://USER:PASSWORD@HOST:PORT/DATABASE),"
            f" not {parsed.drivername}://"
        )
    if parsed.drivername not in ("postgresql", "postgres", "postgresql+psycopg"):
        raise ConfigError(
            f"{where} must use the psycopg 3 driver (postgresql:// or postgresql+psycopg://),"
            f" not {parsed.drivername}://"
        )
    if "@" in (parsed.host or "") or "@" in (parsed.database or ""):
        raise ConfigError(f"{where} is not a valid URL: {_ENCODE_RULE}")
    return normalize_url(url)


@dataclass(frozen=True, slots=True, eq=False)
class BrokerUrl:
    """A broker's URL, completed with the credentials its ``username_env`` /
    ``password_env`` name, or the ConfigError built at load when one of those
    variables is unset or empty (it names the adapter or ``[dramatiq]``, the
    key and the variable, never a value).

    Only the processes that connect to a broker need its variables: ``migrate``
    and ``worker`` run without the ingester's and acker's, so a missing one is
    no error until :meth:`url` is asked, by whatever connects. There is no
    other way to the URL: nothing can read one that lacks its credentials
    without that error. The repr shows neither."""

    _url: str  # without the credentials when _missing is set
    _missing: ConfigError | None = field(default=None)

    @classmethod
    def resolve(
        cls,
        where: str,
        url: str,
        env: Mapping[str, str],
        *,
        username_env: str | None,
        password_env: str | None,
    ) -> BrokerUrl:
        """``url`` with the credentials of :func:`with_credentials`, or the
        error it raises, kept for :meth:`url`."""
        try:
            return cls(
                with_credentials(where, url, env, username_env=username_env, password_env=password_env)
            )
        except ConfigError as exc:
            return cls(url, exc)

    def url(self) -> str:
        """The complete URL, for what connects to the broker; a ConfigError
        (exit 2) if a credential variable was unset at load."""
        if self._missing is not None:
            raise self._missing.with_traceback(None)
        return self._url

    def identity(self) -> tuple[str, ...]:
        """Which server and database the URL reaches, whoever logs in."""
        parts = urlsplit(self._url)
        if parts.scheme == "unix":
            return ("unix", parts.path)
        if parts.scheme in ("nats", "tls"):
            return (parts.hostname or "localhost", str(parts.port or NATS_PORT))
        if parts.scheme in ("http", "https", "aws"):
            return (parts.scheme, parts.hostname or "", str(parts.port or ""))
        if parts.scheme in ("amqp", "amqps"):
            port = parts.port or (AMQPS_PORT if parts.scheme == "amqps" else AMQP_PORT)
            return (parts.hostname or "localhost", str(port), amqp_vhost(self._url))
        db = parts.path.strip("/") or "0"
        for item in parts.query.split("&"):
            key, _, value = item.partition("=")
            if key == "db":
                db = value
        return (parts.hostname or "localhost", str(parts.port or 6379), db)

    def _compared(self) -> tuple[str, str | None]:
        return self._url, None if self._missing is None else str(self._missing)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BrokerUrl) and self._compared() == other._compared()

    def __hash__(self) -> int:
        return hash(self._compared())

    def __repr__(self) -> str:
        return "BrokerUrl(complete)" if self._missing is None else f"BrokerUrl(missing: {self._missing})"


def broker_name(url: str, what: str = "dramatiq broker") -> str:
    """``dramatiq broker at host:port/db``: where it is, never who logs in
    (a health report's and a status line's name for it)."""
    parts = urlsplit(url)
    if parts.scheme == "unix":
        return f"{what} at {parts.path}"
    return f"{what} at {parts.hostname}:{parts.port or 6379}{parts.path}"
