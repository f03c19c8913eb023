"""What every Redis mode shares: the client with bounded waits, and the one
place Redis error replies are classified (never ``"..." in str(e)`` at call sites)."""

from __future__ import annotations

from enum import Enum

import redis.asyncio as aioredis
from redis.backoff import NoBackoff
from redis.exceptions import RedisError, ResponseError
from redis.retry import Retry

SOCKET_CONNECT_TIMEOUT_S = 5.0
# Headroom above a blocking command's own timeout before the socket gives up.
SOCKET_TIMEOUT_MARGIN_S = 5.0


class RedisErrorKind(Enum):
    BUSYGROUP = "BUSYGROUP"  # group already exists: fine
    NOGROUP = "NOGROUP"  # group or stream vanished: recreate
    LOADING = "LOADING"  # server loading its dataset: transient
    MISCONF = "MISCONF"  # cannot persist: transient
    NOPERM = "NOPERM"  # ACL forbids the command
    OTHER = "OTHER"


def classify(exc: RedisError) -> RedisErrorKind:
    """The error code is the first word of a Redis error reply."""
    if isinstance(exc, ResponseError) and exc.args:
        code = str(exc.args[0]).split(" ", 1)[0]
        try:
            return RedisErrorKind(code)
        except ValueError:
            return RedisErrorKind.OTHER
    return RedisErrorKind.OTHER


def connect(url: str, *, block_ms: int = 0) -> aioredis.Redis:
    """A client whose every call is bounded; retries are the caller's loop's job."""
    return aioredis.Redis.from_url(
        url,
        decode_responses=False,
        socket_connect_timeout=SOCKET_CONNECT_TIMEOUT_S,
        socket_timeout=block_ms / 1000 + SOCKET_TIMEOUT_MARGIN_S,
        socket_keepalive=True,
        health_check_interval=30,
        # One attempt: the poll loop owns backoff and logging, so a dead server
        # is reported at once instead of after hidden retries.
        retry=Retry(NoBackoff(), 0),
    )


def broker_label(client: aioredis.Redis) -> str:
    """host:port/db of a client, for log fields: never the credentials."""
    kw = client.connection_pool.connection_kwargs
    return f"{kw.get('host', kw.get('path', '?'))}:{kw.get('port', '')}/{kw.get('db', 0)}"
