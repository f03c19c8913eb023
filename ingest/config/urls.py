"""URLs and broker credentials: checked at load, and never echoed.

A database URL must be PostgreSQL for psycopg 3, a broker URL one its
transport reads as meant (its own ``check_url``); a broker's user name and password may come from environment
variables the config names (:func:`with_credentials`); a URL whose variables
are unset is a :class:`BrokerUrl` that raises, not a URL without them."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

from sqlalchemy.engine import make_url

from backhalf.db import normalize_url
from ingest.config.keys import string
from ingest.config.transports import of_scheme
from ingest.config.url_shape import ENCODE_RULE
from ingest.errors import ConfigError


def check_broker_url(where: str, value: Any) -> str:
    """A URL some transport takes, checked by the transport its scheme names
    (the default transport's check, which names its own schemes, for any
    other); the adapter's transport then checks it as its own, once known."""
    url = string(where, value)
    scheme = urlsplit(url).scheme
    return of_scheme(scheme).check_url(where, url)


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
        raise ConfigError(f"{where} is not a valid URL: contains whitespace; {ENCODE_RULE}")
    try:
        parsed = make_url(url)
    except Exception as exc:  # SQLAlchemy's URL parser raises several types; their texts quote the URL
        raise ConfigError(
            f"{where} is not a database URL ({type(exc).__name__}): the form is"
            f" postgresql://USER:PASSWORD@HOST:PORT/DATABASE, and {ENCODE_RULE}"
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
        raise ConfigError(f"{where} is not a valid URL: {ENCODE_RULE}")
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
        return of_scheme(parts.scheme).url_identity(parts)

    def _compared(self) -> tuple[str, str | None]:
        return self._url, None if self._missing is None else str(self._missing)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BrokerUrl) and self._compared() == other._compared()

    def __hash__(self) -> int:
        return hash(self._compared())

    def __repr__(self) -> str:
        return "BrokerUrl(complete)" if self._missing is None else f"BrokerUrl(missing: {self._missing})"
