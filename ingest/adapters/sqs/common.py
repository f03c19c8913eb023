"""What the SQS side shares: one client per process role with every wait
bounded and no hidden retries, the queue looked up by name, and the one map
from botocore's errors to ours.

botocore retries a failed call by itself (up to three attempts, with its own
backoff); here it makes one (``total_max_attempts = 1``): a failure raises
at once, the poll loop (or the acker's drain) backs off as it does for every
broker, and the call is made again. One retry policy, visible in the logs.

Credentials are AWS's chain, never the config (environment, profile, SSO,
an instance or task role): botocore reads them. Nothing here logs a request;
botocore's errors name the operation and the service's code, never a key.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import re
from contextlib import AsyncExitStack
from typing import Any
from urllib.parse import urlsplit

import structlog
from aiobotocore.config import AioConfig
from aiobotocore.session import AioSession, get_session
from aiohttp import ClientError as HttpError
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    DataNotFoundError,
    NoCredentialsError,
    NoRegionError,
)

from ingest.adapters.sqs.settings import AWS_ENDPOINT
from ingest.adapters.sqs.settings import options as own_options
from ingest.adapters.sqs.settings import queue_name as sqs_queue_name
from ingest.config import AdapterConfig
from ingest.errors import BrokerError, IngestError, wrapped_errors

log = structlog.get_logger(__name__)
# botocore says where it found the credentials at INFO, at every client made
# (every reconnect): a line on every `status`, and nothing an operator acts on.
logging.getLogger("botocore.credentials").setLevel(logging.WARNING)

CONNECT_TIMEOUT_S = 5
# A call's answer beyond its long poll: far above a round trip, far below a stall.
REQUEST_TIMEOUT_S = 10
# SQS's own bounds: 10 messages a receive or a batch call, 20 s of long poll.
MAX_PER_CALL = 10
MAX_WAIT_S = 20
# Receives of one read, at most, in flight at once (a batch_size of 500
# would otherwise open 50 connections).
MAX_CONCURRENT_CALLS = 10
_AWS_QUEUE_HOST = re.compile(r"sqs\.([a-z0-9-]+)\.amazonaws\.com(\.cn)?|([a-z0-9-]+)\.queue\.amazonaws\.com")

Client = Any  # aiobotocore's client is generated from the service model: no static type


class sqs_errors(wrapped_errors):
    """botocore's and aiohttp's errors as ``error``: ``adapter X: what: CODE: message``."""

    caught = (BotoCoreError, ClientError, HttpError, OSError, TimeoutError)

    @staticmethod
    def detail(exc: BaseException) -> str:
        return describe_error(exc)


def error_code(exc: BaseException) -> str | None:
    """The service's error code of a ClientError (``AWS.SimpleQueueService.
    NonExistentQueue``, ``AccessDenied``), else None."""
    if isinstance(exc, ClientError):
        code = exc.response.get("Error", {}).get("Code")
        return str(code) if code else None
    return None


def describe_error(exc: BaseException) -> str:
    if isinstance(exc, NoCredentialsError):
        return (
            "no AWS credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or run"
            " with an instance or task role"
        )
    if isinstance(exc, NoRegionError):
        return "no AWS region: set the adapter's 'region', or AWS_REGION (or AWS_DEFAULT_REGION)"
    if isinstance(exc, ClientError):
        error = exc.response.get("Error", {})
        return f"{error.get('Code', 'error')}: {error.get('Message', '')}".rstrip(": ")
    return str(exc) or type(exc).__name__


def is_missing_queue(exc: BaseException) -> bool:
    code = error_code(exc) or ""
    return code.endswith("NonExistentQueue") or code == "QueueDoesNotExist"


def region_of(config: AdapterConfig) -> str | None:
    """The adapter's region: its key, else an AWS queue URL's, else
    ``AWS_REGION`` (the other AWS SDKs' variable, which botocore does not
    read), else None: botocore's chain (``AWS_DEFAULT_REGION``, the profile)."""
    if (region := own_options(config).region) is not None:
        return region
    if "://" in config.source:
        found = _AWS_QUEUE_HOST.fullmatch(urlsplit(config.source).hostname or "")
        if found:
            return found.group(1) or found.group(3)
    return os.environ.get("AWS_REGION") or None


def endpoint(config: AdapterConfig) -> str | None:
    """The endpoint the calls go to: ``url``, else a queue URL's own origin
    (an AWS queue URL's is its region's endpoint), else None: botocore's,
    of the region."""
    url = config.broker.url()
    if url != AWS_ENDPOINT:
        return url
    if "://" in config.source:
        parts = urlsplit(config.source)
        return f"{parts.scheme}://{parts.netloc}"
    return None


def endpoint_label(config: AdapterConfig) -> str:
    """Where the queue is, for log fields: the endpoint's host:port, or
    ``aws:REGION``; never credentials (an SQS URL carries none)."""
    url = endpoint(config)
    if url is None:
        return f"aws:{region_of(config) or '(default region)'}"
    parts = urlsplit(url)
    return f"{parts.hostname}:{parts.port or (443 if parts.scheme == 'https' else 80)}"


async def open_client(
    config: AdapterConfig, stack: AsyncExitStack, *, service: str = "sqs", calls: int = 1, wait_s: int = 0
) -> Client:
    """A client of ``service`` for the adapter's endpoint and region, closed
    with ``stack``: at most ``calls`` requests in flight, each answered
    within ``wait_s`` (a long poll) plus REQUEST_TIMEOUT_S. TLS is verified
    (``tls_ca_file``, else the system's CAs, through certifi)."""
    url = endpoint(config)
    options: dict[str, Any] = {
        "region_name": region_of(config),
        "verify": own_options(config).tls_ca_file or True,
        "config": AioConfig(
            retries={"total_max_attempts": 1, "mode": "standard"},
            connect_timeout=CONNECT_TIMEOUT_S,
            read_timeout=wait_s + REQUEST_TIMEOUT_S,
            max_pool_connections=max(calls, 1),
            user_agent_extra="switchboard",
        ),
    }
    if url is not None:
        options["endpoint_url"] = url
    with sqs_errors(config.name, f"creating the {service} client for {endpoint_label(config)}"):
        # The session reads AWS's config files first (a profile named there
        # that does not exist is an error of its own, ProfileNotFound).
        session = _session()
        # botocore reads the service's model and the endpoint rules from JSON
        # files as it makes a client (0.2 s for SQS): in a thread, once, into
        # the session's cache, so the event loop never stops for it.
        await asyncio.to_thread(_load_models, session, service)
        return await stack.enter_async_context(session.create_client(service, **options))


def _session() -> AioSession:
    """A session of its own per client, so the credentials are read from
    AWS's chain each time a client is made; one loader for them all, whose
    cache keeps the models every client reads."""
    session = get_session()
    session.register_component("data_loader", _loader())
    return session


@functools.cache
def _loader() -> Any:
    return get_session().get_component("data_loader")


def _load_models(session: AioSession, service: str) -> None:
    """What a new client reads from disk, into the loader's cache."""
    loader = session.get_component("data_loader")
    for kind in ("service-2", "endpoint-rule-set-1", "paginators-1"):
        with contextlib.suppress(DataNotFoundError):
            loader.load_service_model(service, kind)
    loader.load_data("partitions")
    loader.load_data("sdk-default-configuration")


async def queue_url(client: Client, config: AdapterConfig) -> str:
    """The queue's URL: ``source`` where it is one, else asked by name; a
    queue that does not exist is a BrokerError saying to create it."""
    if "://" in config.source:
        return config.source
    name = sqs_queue_name(config.source)
    with sqs_errors(config.name, f"looking up the SQS queue {name}"):
        try:
            reply = await client.get_queue_url(QueueName=name)
        except ClientError as exc:
            if not is_missing_queue(exc):
                raise
            raise BrokerError(
                f"adapter {config.name}: the SQS queue {name!r} does not exist at {endpoint_label(config)}:"
                " create it (Switchboard never creates queues); retrying"
            ) from exc
    return str(reply["QueueUrl"])


async def caller_arn(config: AdapterConfig, stack: AsyncExitStack) -> str:
    """The identity the credentials are (STS GetCallerIdentity, which needs
    no permission), for the events' ``verify_detail``; ``(unknown)`` where
    it cannot be asked (an endpoint without STS)."""
    try:
        sts = await open_client(config, stack, service="sts")
        reply = await sts.get_caller_identity()
        return str(reply.get("Arn") or "(unknown)")
    except (BotoCoreError, ClientError, HttpError, OSError, TimeoutError, IngestError) as exc:
        log.info("aws_identity_unavailable", adapter=config.name, error=describe_error(exc))
        return "(unknown)"
