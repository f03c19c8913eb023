"""The AMQP 0-9-1 (RabbitMQ) transport as the config reads it, no client
imported: its URL and virtual host, and its rules. Registered in
:mod:`ingest.config.transports`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any
from urllib.parse import SplitResult, unquote, urlsplit

from ingest.config import transport
from ingest.config.network import Unencrypted, unencrypted_at
from ingest.config.url_shape import checked_url

NAME = "amqp"
URL_VARIABLE = "SWITCHBOARD_AMQP_URL"
DEFAULT_URL = "amqp://127.0.0.1:5672/"
AMQP_PORT, AMQPS_PORT = 5672, 5671
# A delivery comes again only once its channel ends, which RabbitMQ forces
# on a delivery held unacked past its consumer_timeout (30 minutes by default).
CONSUMER_TIMEOUT_MS = 1_800_000


def check_url(where: str, value: Any) -> str:
    """A RabbitMQ (AMQP 0-9-1) URL: ``amqp://`` plain, ``amqps://`` TLS
    (verified against ``tls_ca_file`` or the system's CAs); its path is the
    virtual host (percent-encoded: ``%2F`` is ``/``, the default when there
    is no path). No query: TLS comes from ``tls_ca_file``, and the client's
    other options are Switchboard's."""
    return checked_url(where, value, ("amqp", "amqps"), "an amqp:// or amqps:// URL", _url_problem)


def _url_problem(url: str) -> str | None:
    parts = urlsplit(url)
    if parts.query or parts.fragment:
        return "an AMQP URL here has no query: amqp[s]://[USER:PASSWORD@]HOST[:PORT][/VHOST]"
    if "/" in parts.path.strip("/"):
        return "the path is the virtual host, one segment (a '/' in its name is written %2F)"
    return None


def vhost(url: str) -> str:
    """The virtual host an AMQP URL names: its path, decoded; ``/`` without one."""
    return unquote(urlsplit(url).path[1:]) or "/"


def url_identity(parts: SplitResult) -> tuple[str, ...]:
    port = parts.port or (AMQPS_PORT if parts.scheme == "amqps" else AMQP_PORT)
    return (parts.hostname or "localhost", str(port), vhost(parts.geturl()))


def _reader(a: transport.Adapter, identity: tuple[str, ...]) -> transport.Reader:
    return transport.Reader.per_source(
        identity,
        f"AMQP queue {a.source!r}",
        "one adapter per queue (fan-out is an exchange bound to several queues); run more ingesters",
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class AmqpOptions:
    """An AMQP adapter's own keys (``AdapterConfig.options``)."""

    tls_ca_file: Annotated[
        str | None, transport.ca_file_key("the server's certificate (an `amqps://` URL)")
    ] = None


def options(adapter: transport.Adapter) -> AmqpOptions:
    """``adapter``'s own keys."""
    return transport.options_of(adapter, AmqpOptions)


KEYS = transport.own_keys(NAME, AmqpOptions, "the AMQP (RabbitMQ) adapters (mode `queue`)", "#amqp-rabbitmq")


def plaintext(url: str, own: AmqpOptions | None) -> Unencrypted | None:
    """A RabbitMQ if remote and reached by ``amqp://`` (not ``amqps://``)."""
    return unencrypted_at(url, {"amqp": AMQP_PORT}, "use amqps:// for RabbitMQ")


# The queue's ready messages, and the deliveries this ingester holds
# unacked (the broker's whole unacked count is not in AMQP).
_FIGURES = transport.figures_named({"ready": "backlog", "held_here": "in_flight"})


DEFINITION = transport.TransportDefinition(
    name=NAME,
    modes=("queue",),
    keys=KEYS,
    client_packages=("aio_pika", "aiormq", "pamqp"),
    # A message's id is its producer's message_id (backhalf.writes.keys.key_id).
    producer_ids=True,
    key_prefix="amqp",
    extra="amqp",
    url_schemes=("amqp", "amqps"),
    check_url=check_url,
    plaintext=plaintext,
    url_identity=url_identity,
    **transport.url_from_variable(
        "AMQP", URL_VARIABLE, DEFAULT_URL, "AMQP (RabbitMQ) adapters' URL when theirs is not set"
    ),
    rules={
        "ack_after": transport.refuse_complete(
            "transport = \"amqp\": the ack would be held on the ingester's channel for the todo's whole"
            " run, where RabbitMQ's consumer_timeout (30 minutes by default) closes the channel and"
            " requeues all it holds, and the held deliveries fill the prefetch and stop consumption;"
            ' use ack_after = "store"'
        ),
    },
    redelivery_horizon=lambda values: (
        CONSUMER_TIMEOUT_MS,
        "RabbitMQ's consumer_timeout (30 minutes by default)",
    ),
    reader=_reader,
    figures=_FIGURES,
)
