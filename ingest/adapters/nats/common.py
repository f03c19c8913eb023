"""What the NATS side shares: the connection with every wait bounded and no
hidden retries, and the one map from nats-py's errors to ours.

nats-py reconnects by itself and buffers what is published meanwhile; here
it does neither (``allow_reconnect=False``): a connection lost raises at the
next call, the poll loop (or the acker's drain) backs off as it does for
Redis, and the next call connects afresh. One retry policy, visible in the
logs, instead of a client's silent one beneath it.
"""

from __future__ import annotations

import asyncio
import json
import os
import ssl
from collections.abc import Awaitable, Callable
from urllib.parse import unquote, urlsplit, urlunsplit

import structlog
from nats.aio.client import Client
from nats.errors import Error as NatsError

from ingest.adapters.nats.settings import options
from ingest.config import AdapterConfig
from ingest.errors import ConfigError, wrapped_errors

log = structlog.get_logger(__name__)

CONNECT_TIMEOUT_S = 5
# A JetStream API call (stream and consumer info, consumer creation) and an
# ack's answer: far above a loopback round trip, far below a stalled server.
REQUEST_TIMEOUT_S = 5.0
# The server asks the account's user info of the system account.
USER_INFO_SUBJECT = "$SYS.REQ.USER.INFO"


class nats_errors(wrapped_errors):
    """nats-py's errors (and a lost socket's) as ``error``: ``adapter X: what: ...``."""

    caught = (NatsError, OSError, TimeoutError)


def _tls_context(config: AdapterConfig, scheme: str) -> ssl.SSLContext | None:
    """TLS with the server's certificate verified: ``tls://`` or a CA file
    given; never an unverified context."""
    if scheme != "tls" and options(config).tls_ca_file is None:
        return None
    context = ssl.create_default_context(cafile=options(config).tls_ca_file)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


def _credentials_file(config: AdapterConfig) -> str | None:
    variable = options(config).credentials_file_env
    if variable is None:
        return None
    path = os.environ.get(variable)
    if not path:
        raise ConfigError(
            f"adapter {config.name!r}: key 'credentials_file_env': the environment variable {variable!r}"
            " is not set or empty"
        )
    return path


def _without_credentials(url: str) -> tuple[str, dict[str, str]]:
    """The URL without its user information, and that information as
    nats-py's options, percent-decoded: nats-py sends a URL's user name and
    password as they are written, so a password with a reserved character
    (written encoded, as ``username_env`` / ``password_env`` write it) would
    never log in. A user name alone is a token."""
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    bare = urlunsplit(parts._replace(netloc=host))
    if parts.username is None:
        return bare, {}
    if parts.password is None:
        return bare, {"token": unquote(parts.username)}
    return bare, {"user": unquote(parts.username), "password": unquote(parts.password)}


AsyncErrors = Callable[[Exception], None]


async def connect(config: AdapterConfig, *, role: str, on_error: AsyncErrors | None = None) -> Client:
    """A connection to the adapter's server, named for the process role
    (``monitor`` shows it); raises BrokerError if none can be made now.
    ``on_error`` is told of every asynchronous error the server reports
    (a permission violation answers a publish that way, not at the call)."""
    url = config.broker.url()
    parts = urlsplit(url)
    bare, credentials = _without_credentials(url)
    # nats-py reads tls:// itself, but a CA file needs the context: the URL
    # keeps its scheme either way.
    options: dict[str, object] = {
        "servers": [bare],
        "name": f"switchboard-{role}-{config.name}",
        "connect_timeout": CONNECT_TIMEOUT_S,
        "allow_reconnect": False,
        "max_reconnect_attempts": 0,
        "error_cb": _error_cb(config.name, on_error),
        **credentials,
    }
    tls = _tls_context(config, parts.scheme)
    if tls is not None:
        options["tls"] = tls
        options["tls_hostname"] = parts.hostname
    credentials_file = _credentials_file(config)
    if credentials_file is not None:
        options["user_credentials"] = credentials_file
    client = _TlsOnlyClient() if tls is not None else Client()
    try:
        with nats_errors(config.name, f"connecting to {server_label(url)}"):
            await client.connect(**options)  # type: ignore[arg-type]  # nats-py's options, spread
    except BaseException:
        await _close_quietly(client)  # nats-py leaves a refused connection's socket open
        raise
    return client


async def _close_quietly(client: Client) -> None:
    try:
        transport = client._transport
        if transport is not None:
            transport.close()  # type: ignore[no-untyped-call]
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                await transport.wait_closed()  # type: ignore[no-untyped-call]
        await client.close()
    except Exception as exc:  # noqa: BLE001 - closing what already failed
        log.info("nats_close_failed", error=str(exc) or type(exc).__name__)


class TlsNotOffered(NatsError):
    """The server did not ask for TLS, though the adapter requires it."""


class _TlsOnlyClient(Client):
    """nats-py upgrades a connection to TLS only when the server's INFO says
    ``tls_required``, whatever the URL's scheme or the context given: to a
    server that does not (or a man in the middle) it would send CONNECT, the
    password in it, in clear. Refused here, before CONNECT is written; the
    one hook nats-py has between its INFO and its CONNECT is
    ``_connect_command`` (nats-py is pinned in constraints.txt, and
    ``test_nats_tls`` holds this to a server that offers no TLS)."""

    def _connect_command(self) -> bytes:
        if not self._server_info.get("tls_required", False):
            raise TlsNotOffered(
                "the server does not offer TLS, which the adapter requires (a tls:// URL or tls_ca_file):"
                " refused before sending any credential"
            )
        command: bytes = super()._connect_command()
        return command


def _error_cb(adapter: str, on_error: AsyncErrors | None) -> Callable[[Exception], Awaitable[None]]:
    """nats-py reports asynchronous errors (a permission violation, a slow
    consumer) here, not at a call: logged, handed to ``on_error``, never
    raised into its reader task."""

    async def report(exc: Exception) -> None:
        log.warning("nats_async_error", adapter=adapter, error=str(exc), error_type=type(exc).__name__)
        if on_error is not None:
            on_error(exc)

    return report


def server_label(url: str) -> str:
    """host:port of a NATS URL, never its credentials."""
    parts = urlsplit(url)
    return f"{parts.hostname}:{parts.port or 4222}"


async def user_name(client: Client, url: str) -> str:
    """The user the connection logged in as: the URL's, else the one the
    server knows it as (``$SYS.REQ.USER.INFO``, NATS 2.10+: a creds file's
    user), else how it authenticated. The URL's is taken first: a user the
    server denies that request times out asking it, which would hold up every
    connect."""
    parts = urlsplit(url)
    if parts.username and parts.password is not None:
        return unquote(parts.username)
    try:
        reply = await client.request(USER_INFO_SUBJECT, b"", timeout=REQUEST_TIMEOUT_S)
        user = json.loads(reply.data).get("data", {}).get("user")
        if isinstance(user, str) and user:
            return user
    except (NatsError, OSError, TimeoutError, ValueError) as exc:
        log.info("nats_user_info_unavailable", error=str(exc) or type(exc).__name__)
    if parts.username:
        return "(token)"  # never the token itself
    return "(anonymous)"
