"""The SQS transport as the config reads it, no client imported: its
endpoint, its queue names and URLs, and its rules. Registered in
:mod:`ingest.config.transports`."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Any
from urllib.parse import SplitResult, urlsplit

from ingest.config import transport
from ingest.config.keys import Key, string
from ingest.config.network import Unencrypted, unencrypted_at
from ingest.config.url_shape import checked_url
from ingest.errors import ConfigError

NAME = "sqs"
URL_VARIABLE = "SWITCHBOARD_SQS_ENDPOINT_URL"
# An SQS adapter's ``url`` when neither it nor the variable names an
# endpoint: AWS's own, of the adapter's region (botocore finds it).
AWS_ENDPOINT = "aws://"
# An SQS queue name (AWS's rule: up to 80 of these, ``.fifo`` included), or
# a queue URL ending in one.
_QUEUE_NAME = re.compile(r"[A-Za-z0-9_-]{1,75}(\.fifo)?|[A-Za-z0-9_-]{1,80}")


def queue_name(source: str) -> str:
    """The queue's name: ``source`` itself, or a queue URL's last segment."""
    return source.rstrip("/").rpartition("/")[2] if "://" in source else source


def check_url(where: str, value: Any) -> str:
    """An SQS-compatible endpoint (``https://``, or ``http://`` for an
    emulator), or ``aws://``: AWS's own endpoint of the region. No user
    information: AWS credentials come from AWS's chain, never a URL."""
    if value == AWS_ENDPOINT:
        return AWS_ENDPOINT
    must_be = f"an https:// (or http://) SQS endpoint, or {AWS_ENDPOINT}"
    return checked_url(where, value, ("https", "http"), must_be, _url_problem)


def _url_problem(url: str) -> str | None:
    parts = urlsplit(url)
    if "@" in parts.netloc:
        return "an SQS endpoint carries no credentials: AWS's chain gives them (environment, profile, role)"
    if parts.query or parts.fragment or parts.path.strip("/"):
        return "an SQS endpoint has no path or query: https://HOST[:PORT] (a queue URL goes in 'source')"
    return None


def url_identity(parts: SplitResult) -> tuple[str, ...]:
    return (parts.scheme, parts.hostname or "", str(parts.port or ""))


def _source(label: str, values: transport.Values) -> None:
    source = values["source"]
    if "://" in source and not source.startswith(("https://", "http://")):
        raise ConfigError(f"{label}: key 'source' must be a queue name or an http(s):// queue URL")
    if "://" in source and "@" in urlsplit(source).netloc:
        raise ConfigError(
            f"{label}: key 'source': a queue URL carries no credentials: AWS's chain gives them"
            " (environment, profile, role)"
        )
    if not _QUEUE_NAME.fullmatch(queue_name(source)):
        raise ConfigError(
            f"{label}: key 'source' = {source!r} is no SQS queue name (or URL ending in one): up to 80"
            " letters, digits, '-' and '_', a FIFO queue's ending in '.fifo'"
        )


def _one_endpoint(label: str, values: transport.Values) -> None:
    """A queue URL names its endpoint: a second one in 'url' is either the
    same (said twice) or another (which would the calls go to?)."""
    if (
        "://" in values["source"]
        and values["broker"] != AWS_ENDPOINT
        and urlsplit(values["source"]).netloc != urlsplit(values["broker"]).netloc
    ):
        raise ConfigError(
            f"{label}: key 'source' is a queue URL on another endpoint than key 'url': name the queue once,"
            " by its URL in 'source' (no 'url'), or by its name in 'source' with the endpoint in 'url'"
        )


def _credentials(label: str, values: transport.Values) -> dict[str, str | None]:
    """None: AWS credentials come from AWS's own chain (environment,
    profile, role)."""
    for key in ("username_env", "password_env"):
        if values[key] is not None:
            raise ConfigError(
                f"{label}: key {key!r} does not apply to transport = 'sqs': AWS credentials come from"
                " the AWS chain (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, AWS_PROFILE, an instance"
                " or task role), never from the config"
            )
    return {"username_env": None, "password_env": None}


def _located(a: transport.Adapter) -> str:
    """A queue URL names its account and region; a queue name, with the
    endpoint and the region."""
    return a.source if "://" in a.source else f"{options(a).region or ''}:{a.source}"


def _reader(a: transport.Adapter, identity: tuple[str, ...]) -> transport.Reader:
    return transport.Reader.per_source(
        identity,
        f"SQS queue {queue_name(a.source)!r}",
        "one adapter per queue (fan-out is SNS to several queues); run more ingesters for more",
    )


# SQS's longest visibility timeout (12 hours), and so the bound of ack_wait_ms.
MAX_VISIBILITY_MS = 43_200_000


@dataclass(frozen=True, slots=True, kw_only=True)
class SqsOptions:
    """An SQS adapter's own keys (``AdapterConfig.options``)."""

    ack_wait_ms: Annotated[
        int,
        Key(
            minimum=1000,
            maximum=MAX_VISIBILITY_MS,
            doc="the visibility timeout of each receive, in whole seconds: an undeleted message is"
            " received again after this (keep well above read + commit + delete)",
        ),
    ] = 60_000
    region: Annotated[
        str | None,
        Key(
            parse=string,
            doc="the AWS region of the queue",
            default_doc="a queue URL's, else the AWS environment's (`AWS_REGION`, `AWS_DEFAULT_REGION`,"
            " the profile)",
        ),
    ] = None
    tls_ca_file: Annotated[str | None, transport.ca_file_key("an `https://` endpoint's certificate")] = None


def options(adapter: transport.Adapter) -> SqsOptions:
    """``adapter``'s own keys."""
    return transport.options_of(adapter, SqsOptions)


KEYS = transport.own_keys(NAME, SqsOptions, "the SQS adapters (mode `queue`)", "#sqs")


def plaintext(url: str, own: SqsOptions | None) -> Unencrypted | None:
    """An SQS-compatible endpoint if remote and ``http://`` (AWS's own
    endpoints, the default, are HTTPS)."""
    return unencrypted_at(url, {"http": 80}, "use https:// for the SQS endpoint")


# Waiting, received and not deleted, and moved to the dead-letter queue unstored.
_FIGURES = transport.figures_named(
    {"visible": "backlog", "in_flight": "in_flight", "dead_letter_messages": "dead_lettered"}
)


DEFINITION = transport.TransportDefinition(
    name=NAME,
    modes=("queue",),
    keys=KEYS,
    client_packages=("aiobotocore", "botocore"),
    key_prefix="sqs",
    extra="sqs",
    url_schemes=("http", "https", "aws"),
    check_url=check_url,
    plaintext=plaintext,
    url_identity=url_identity,
    **transport.url_from_variable(
        "SQS",
        URL_VARIABLE,
        AWS_ENDPOINT,
        "an SQS-compatible endpoint (without it: AWS, by region and AWS_* credentials)",
        " (AWS's own endpoint of the region)",
    ),
    rules={
        "ack_after": transport.refuse_complete(
            'transport = "sqs": a message not deleted within its visibility timeout (ack_wait_ms) is'
            " received again, so a delete held for its todo's whole run would bring it back every"
            ' ack_wait_ms; use ack_after = "store"'
        ),
        "source": _source,
        "url": _one_endpoint,
    },
    credentials=_credentials,
    redelivery_horizon=lambda values: (values["ack_wait_ms"], "ack_wait_ms"),
    reader=_reader,
    queue_name=queue_name,
    located=_located,
    figures=_FIGURES,
)
