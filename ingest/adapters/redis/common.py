"""What every Redis mode shares: the client with bounded waits, the one
place Redis error replies are classified (never ``"..." in str(e)`` at call
sites), and the one map from redis-py's errors to ours at the boundary:
every Redis call whose failure an adapter or acknowledger raises runs under
``with redis_errors(adapter, what):`` (or ``tolerating(kind, ...)`` where one
reply code is no failure), so each raises ``adapter X: what: <reply>`` of the
caller's :class:`ingest.errors.IngestError` type, the Redis error as its cause.
Best-effort calls that only log a failure (a list's heartbeat, lock release,
marker cleanup) catch ``RedisError`` themselves.
"""

from __future__ import annotations

from enum import Enum
from types import TracebackType
from typing import Any, cast

import redis.asyncio as aioredis
import structlog
from redis.asyncio.cluster import ClusterPipeline
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError, RedisError, ResponseError, TimeoutError
from redis.retry import Retry

from ingest.errors import BrokerError, IngestError

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


def is_no_such_key(exc: RedisError) -> bool:
    """``ERR no such key``: XINFO on a key that does not exist (a stream not
    created yet), a state rather than a failure. Its code is the generic
    ``ERR``, so the text after it is what tells it apart."""
    return isinstance(exc, ResponseError) and "no such key" in str(exc).lower()


def _mapped(
    exc: RedisError,
    adapter: str,
    what: str,
    *,
    error: type[IngestError] = BrokerError,
    nogroup: type[IngestError] | None = None,
) -> IngestError:
    """Our error for a Redis error: ``error("adapter X: what: <reply>")``, or,
    where the caller asks for ``nogroup``, a NOGROUP reply (which names its
    command, stream and group itself) as ``nogroup("adapter X: <reply>")``."""
    if nogroup is not None and classify(exc) is RedisErrorKind.NOGROUP:
        return nogroup(f"adapter {adapter}: {exc}")
    return error(f"adapter {adapter}: {what}: {exc}")


class redis_errors:  # a context manager, named like contextlib's
    """``with redis_errors(adapter, what, error=..., nogroup=...):`` a Redis
    error raised in the block is raised again as :func:`_mapped` says, ``from``
    it. Anything else passes through untouched (our own errors, the
    database's), and nothing is swallowed."""

    __slots__ = ("_adapter", "_error", "_nogroup", "_what")

    def __init__(
        self,
        adapter: str,
        what: str,
        *,
        error: type[IngestError] = BrokerError,
        nogroup: type[IngestError] | None = None,
    ) -> None:
        self._adapter, self._what, self._error, self._nogroup = adapter, what, error, nogroup

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if isinstance(exc, RedisError):
            raise _mapped(exc, self._adapter, self._what, error=self._error, nogroup=self._nogroup) from exc


class tolerating:  # a context manager, named like contextlib's
    """``with tolerating(kind, adapter, what, error=...) as reply:`` as
    :class:`redis_errors`, except that an error reply of ``kind`` (by
    :func:`classify`) ends the block quietly and sets ``reply.tolerated``."""

    __slots__ = ("_adapter", "_error", "_kind", "_what", "tolerated")

    def __init__(
        self, kind: RedisErrorKind, adapter: str, what: str, *, error: type[IngestError] = BrokerError
    ) -> None:
        self._kind, self._adapter, self._what, self._error = kind, adapter, what, error
        self.tolerated = False

    def __enter__(self) -> tolerating:
        return self

    def __exit__(
        self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        if not isinstance(exc, RedisError):
            return False
        if classify(exc) is self._kind:
            self.tolerated = True
            return True
        raise _mapped(exc, self._adapter, self._what, error=self._error) from exc


class _Cluster(aioredis.RedisCluster):
    """redis-py's cluster client, made to reload the slot map before the
    next call after any node's connection error. redis-py 8.1 does so after
    a plain command's failure only: after a failover, a pipeline went on
    calling the dead master for good, and so did XREADGROUP, whose keys it
    first asks through its key parser (``COMMAND GETKEYS``), bound for good
    to the node it first met, the dead master named in the URL (found by
    ``tests/system/test_redis_cluster_faults.py``). So a failure marks the
    map stale (redis-py's own flag, which that test keeps honest) and
    moves the default node to another master."""

    def _stale(self) -> None:
        self._initialize = True
        self.replace_default_node()
        # The parser that asks a command's keys keeps the node it was first
        # given (redis-py never moves it): the new default, alive.
        self.commands_parser.node = self.get_default_node()

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().execute_command(*args, **kwargs)
        except (ConnectionError, TimeoutError):
            self._stale()
            raise

    def pipeline(self, transaction: Any | None = None, shard_hint: Any | None = None) -> ClusterPipeline:
        pipe = super().pipeline(transaction, shard_hint)
        execute = pipe.execute

        async def execute_marking(*args: Any, **kwargs: Any) -> Any:
            try:
                return await execute(*args, **kwargs)
            except (ConnectionError, TimeoutError):
                self._stale()
                raise

        pipe.execute = execute_marking  # type: ignore[method-assign]
        return pipe


def connect(url: str, *, block_ms: int = 0, cluster: bool = False) -> aioredis.Redis:
    """A client whose every call is bounded; retries are the caller's loop's job.

    ``cluster``: a Redis Cluster client that finds the other nodes from the
    URL's, follows MOVED and ASK redirects (the cluster's own answers, not
    retries), and makes one attempt per call otherwise: a node that fails
    is a ConnectionError the poll loop backs off from (redis-py then
    refreshes its view of the slots before the next call). It serves the
    same commands, so it is typed as the single-node client."""
    if cluster:
        return cast(
            "aioredis.Redis",
            _Cluster.from_url(
                url,
                decode_responses=False,
                socket_connect_timeout=SOCKET_CONNECT_TIMEOUT_S,
                socket_timeout=block_ms / 1000 + SOCKET_TIMEOUT_MARGIN_S,
                health_check_interval=30,
                socket_keepalive=True,
                retry=Retry(NoBackoff(), 0),
                # A master down leaves its slots uncovered, not the others'.
                require_full_coverage=False,
                driver_info=None,
            ),
        )
    # TCP keepalive is a TCP socket's option: a unix socket's connection refuses it.
    tcp = {} if url.startswith("unix:") else {"socket_keepalive": True}
    return aioredis.Redis.from_url(
        url,
        decode_responses=False,
        socket_connect_timeout=SOCKET_CONNECT_TIMEOUT_S,
        socket_timeout=block_ms / 1000 + SOCKET_TIMEOUT_MARGIN_S,
        health_check_interval=30,
        **tcp,
        # One attempt: the poll loop owns backoff and logging, so a dead server
        # is reported at once instead of after hidden retries.
        retry=Retry(NoBackoff(), 0),
        # No CLIENT SETINFO: Redis 7.0 has no such command, and the ACL users
        # of ops/redis-users.acl (which must load there) are not granted it.
        driver_info=None,
    )


def broker_label(client: aioredis.Redis) -> str:
    """host:port/db of a client, for log fields: never the credentials (a
    cluster's: the node it was given, ``cluster``)."""
    as_cluster: object = client  # typed as the single-node client (see connect)
    if isinstance(as_cluster, aioredis.RedisCluster):
        nodes = list(as_cluster.nodes_manager.startup_nodes.values())
        first = nodes[0] if nodes else None
        return f"{first.host}:{first.port} (cluster)" if first else "cluster"
    kw = client.connection_pool.connection_kwargs
    return f"{kw.get('host', kw.get('path', '?'))}:{kw.get('port', '')}/{kw.get('db', 0)}"


def as_text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def as_bytes(value: bytes | str) -> bytes:
    return value if isinstance(value, bytes) else value.encode()


class RedisEndpoint:
    """What every Redis adapter shares: its bounded client and who it is to
    the broker (the events' ``verify_detail``)."""

    def __init__(self, name: str, url: str, *, block_ms: int, cluster: bool = False) -> None:
        self.name = name
        self._client = connect(url, block_ms=block_ms, cluster=cluster)
        self.identity = "redis acl: unknown"
        self.broker = broker_label(self._client)  # for log fields: never a credential

    async def _node_figure(self, key: str) -> dict[str, object]:
        """On a cluster, ``node``: the master serving ``key``'s slot as the
        client last learnt it (``status`` names where each source lives);
        nothing on a single server."""
        as_cluster: object = self._client  # typed as the single-node client (see connect)
        if not isinstance(as_cluster, aioredis.RedisCluster):
            return {}
        await as_cluster.initialize()  # a no-op once it knows the slots
        node = as_cluster.get_node_from_key(key)
        return {"node": f"{node.host}:{node.port}" if node is not None else None}

    async def _learn_identity(self) -> None:
        """ACL WHOAMI; an ACL that forbids it still lets us consume, and the
        events say the identity is unknown. Other errors propagate."""
        try:
            self.identity = f"redis acl: {as_text(await self._client.acl_whoami())}"
        except ResponseError as exc:
            log.warning("acl_whoami_failed", adapter=self.name, error_kind=classify(exc).value)
