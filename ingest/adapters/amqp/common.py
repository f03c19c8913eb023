"""What the AMQP mode's parts share: connecting, TLS, errors, labels.

Connections are aio-pika's plain (not "robust") ones: a lost connection is
an error the poll loop backs off and retries like any broker error, so its
backoff stays the one retry policy, and the channel whose deliveries are
lost with it is never silently replaced under a batch that still names them.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from typing import Any
from urllib.parse import unquote, urlsplit

import aio_pika
import aiormq.exceptions
import structlog
from aio_pika.abc import AbstractConnection

from ingest.adapters.amqp.settings import AMQP_PORT, AMQPS_PORT, options
from ingest.adapters.amqp.settings import vhost as amqp_vhost
from ingest.config import AdapterConfig
from ingest.errors import wrapped_errors

log = structlog.get_logger(__name__)
# aiormq and aio-pika log each connection failure themselves (a reset with
# its traceback at warning, a refused connect at error): the same failures
# the adapter raises as broker errors, which the poll loop logs once, with
# the adapter, the step and the backoff. Only what they call critical stays.
for _library in ("aiormq", "aio_pika"):
    logging.getLogger(_library).setLevel(logging.CRITICAL)

CONNECT_TIMEOUT_S = 10.0
# Calls that wait for the server's answer (declare, qos, consume, cancel).
CALL_TIMEOUT_S = 10.0


# aiormq ends a connection's reader with a task of its own it keeps no
# reference to (``Connection._on_reader_done``'s ``close_writer_task``): a
# closed connection is over only once that has run too.
_TEARDOWN = "_on_reader_done.<locals>.close_writer_task"


class amqp_errors(wrapped_errors):
    """aio-pika's, aiormq's and the socket's errors as ``error``:
    ``adapter X: what: detail``. Their texts name the server's reply code
    and text (``ACCESS_REFUSED - ...``), never the URL or its password."""

    # aiormq raises RuntimeError (ChannelInvalidStateError among them) for a
    # connection or channel it found closed: a lost connection too.
    caught = (
        aiormq.exceptions.AMQPError,
        aio_pika.exceptions.AMQPException,
        RuntimeError,
        OSError,
        TimeoutError,
    )


def server_label(url: str) -> str:
    """host:port, and the virtual host where it is not ``/``, for log
    fields; never credentials."""
    parts = urlsplit(url)
    port = parts.port or (AMQPS_PORT if parts.scheme == "amqps" else AMQP_PORT)
    vhost = amqp_vhost(url)
    return f"{parts.hostname or 'localhost'}:{port}" + ("" if vhost == "/" else f" vhost {vhost}")


def user_of(url: str) -> str:
    """The user name the URL logs in as (RabbitMQ's default: guest)."""
    return unquote(urlsplit(url).username or "") or "guest"


def tls_context(config: AdapterConfig) -> ssl.SSLContext | None:
    """For an ``amqps://`` URL: the server's certificate verified, against
    ``tls_ca_file`` or the system's CAs, and its host name checked."""
    if urlsplit(config.broker.url()).scheme != "amqps":
        return None
    return ssl.create_default_context(cafile=options(config).tls_ca_file)


async def connect(config: AdapterConfig, *, role: str) -> AbstractConnection:
    """A connection as the adapter's user, named for the server's listings
    (``switchboard ingest NAME``). Raises BrokerError."""
    url = config.broker.url()
    with amqp_errors(config.name, f"connecting to {server_label(url)}"):
        return await aio_pika.connect(
            url,
            timeout=CONNECT_TIMEOUT_S,
            ssl_context=tls_context(config),
            client_properties={"connection_name": f"switchboard {role} {config.name} {config.consumer}"},
        )


async def close_connection(connection: AbstractConnection, *, adapter: str) -> None:
    """Close ``connection`` and wait, bounded, for aiormq's own teardown of
    it: nothing of it outlives the call (a process checks that no task
    outlives its run)."""
    transport = connection.transport
    reader = getattr(transport.connection, "_reader_task", None) if transport is not None else None
    try:
        async with asyncio.timeout(CALL_TIMEOUT_S):
            if not connection.is_closed:
                await connection.close()
            if isinstance(reader, asyncio.Task):
                await asyncio.wait([reader])
            # The reader's done callbacks ran before this resumed: its
            # teardown task exists now, if it made one.
            teardown = [t for t in asyncio.all_tasks() if not t.done() and _is_teardown(t)]
            if teardown:
                await asyncio.wait(teardown)
    except Exception as exc:  # noqa: BLE001 - closing what may have failed already
        log.info("amqp_close_failed", adapter=adapter, error=str(exc) or type(exc).__name__)


def _is_teardown(task: asyncio.Task[Any]) -> bool:
    return getattr(task.get_coro(), "__qualname__", "").endswith(_TEARDOWN)
