"""What every Redis mode shares: the client with bounded waits, and the one
place Redis error replies are classified (never ``"..." in str(e)`` at call sites)."""

from __future__ import annotations

from enum import Enum

import redis.asyncio as aioredis
import structlog
from redis.backoff import NoBackoff
from redis.exceptions import RedisError, ResponseError
from redis.retry import Retry

log = structlog.get_logger(__name__)

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


def as_text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def as_bytes(value: bytes | str) -> bytes:
    return value if isinstance(value, bytes) else value.encode()


class RedisEndpoint:
    """What every Redis adapter shares: its bounded client and who it is to
    the broker (the events' ``verify_detail``)."""

    def __init__(self, name: str, url: str, *, block_ms: int) -> None:
        self.name = name
        self._client = connect(url, block_ms=block_ms)
        self._identity = "redis acl: unknown"

    @property
    def identity(self) -> str:
        return self._identity

    @property
    def broker(self) -> str:
        return broker_label(self._client)

    async def _learn_identity(self) -> None:
        """ACL WHOAMI; an ACL that forbids it still lets us consume, and the
        events say the identity is unknown. Other errors propagate."""
        try:
            self._identity = f"redis acl: {as_text(await self._client.acl_whoami())}"
        except ResponseError as exc:
            log.warning("acl_whoami_failed", adapter=self.name, error_kind=classify(exc).value)
