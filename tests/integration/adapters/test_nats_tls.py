"""NATS over TLS: a nats-server that requires TLS, its certificate signed
by the suite's throwaway CA (tests/support/tls.py). With ``tls_ca_file``
naming that CA the pipeline stores and acks, over TLS (the server's own
connection list says so), whether the URL says ``tls://`` or ``nats://``
(the server asks for TLS, the client upgrades); without it the system's
CAs refuse the certificate, and the error says so without the password."""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import urllib.request
from collections.abc import AsyncIterator, Iterator
from typing import Any

import nats
import pytest

from backhalf.records import AckClaim
from ingest.adapters.factory import make_acknowledger, make_adapter
from ingest.adapters.nats.jetstream import ACK_KIND
from ingest.config import AdapterConfig
from ingest.embedded.nats_server import NatsServer
from ingest.errors import AckError, BrokerError, IngestError
from tests.support.db import query, scalar
from tests.support.in_process import pipeline, settings, wait_until
from tests.support.nats import Streams, adapter_table, owned_nats
from tests.support.processes import SECRET
from tests.support.tls import Authority, make_authority

USER = "switchboard"
STREAM, GROUP, SUBJECT = "ORDERS", "switchboard", "ORDERS.new"
NAME = "orders"
# The server's TLS handshake deadline (0.5 s by default), generous on a busy machine.
HANDSHAKE_TIMEOUT_S = 5


@pytest.fixture(scope="module")
def authority(tmp_path_factory: pytest.TempPathFactory) -> Authority:
    return make_authority(tmp_path_factory.mktemp("nats-tls"))


@pytest.fixture(scope="module")
def server(authority: Authority) -> Iterator[NatsServer]:
    """TLS required of every client; one user, the planted secret its password."""
    access = (
        f'tls {{ cert_file: "{authority.server.cert}", key_file: "{authority.server.key}",'
        f" timeout: {HANDSHAKE_TIMEOUT_S} }}\n"
        f'authorization {{ users = [ {{ user: "{USER}", password: "{SECRET}" }} ] }}\n'
    )
    with owned_nats(access=access) as s:
        yield s


@pytest.fixture
def registered() -> tuple[tuple[str, str], ...]:
    return ()  # the pipeline registers its adapter itself


def url(server: NatsServer, scheme: str) -> str:
    return server.url_as(USER, SECRET).replace("nats://", f"{scheme}://", 1)


@pytest.fixture
async def broker(server: NatsServer, authority: Authority) -> AsyncIterator[Streams]:
    """The test's own client, verified against the CA: ORDERS made afresh."""
    context = ssl.create_default_context(cafile=str(authority.ca))
    client = await nats.connect(
        url(server, "tls"), tls=context, tls_hostname="127.0.0.1", allow_reconnect=False, connect_timeout=5
    )
    try:
        s = Streams(client)
        await s.reset()
        await s.create(STREAM)
        yield s
    finally:
        await client.close()


def table(url: str, **keys: Any) -> dict[str, Any]:
    return adapter_table(url, **keys)


def tls_connections(server: NatsServer) -> dict[str, str]:
    """Connection name -> TLS version, from the server's monitoring endpoint."""
    connz = f"http://127.0.0.1:{server.monitor_port}/connz"
    with urllib.request.urlopen(connz, timeout=5) as reply:
        connections = json.load(reply)["connections"]
    return {c.get("name", ""): c.get("tls_version", "") for c in connections}


@pytest.mark.parametrize("scheme", ["tls", "nats"])
async def test_with_the_ca_the_pipeline_stores_and_acks_over_tls(
    scheme: str, server: NatsServer, authority: Authority, broker: Streams, db_url: str, redis_url: str
) -> None:
    s = settings(db_url, redis_url, table(url(server, scheme), tls_ca_file=str(authority.ca)))
    sent = [json.dumps({"n": n}).encode() for n in range(10)]
    for body in sent:
        await broker.publish(SUBJECT, body)
    async with pipeline(s):
        await wait_until(lambda: scalar(db_url, "SELECT count(*) FROM inbox") >= len(sent))
        await wait_until(lambda: broker.settled(STREAM, GROUP))
        await wait_until(
            lambda: scalar(db_url, "SELECT count(*) FROM inbox WHERE ack_state = 'acked'") == len(sent)
        )
        connections = tls_connections(server)
    # The ingester's and the acker's connections, each over TLS (1.2 at least).
    ours = {name: version for name, version in connections.items() if name.endswith(f"-{NAME}")}
    assert set(ours) == {f"switchboard-ingest-{NAME}", f"switchboard-ack-{NAME}"}, connections
    assert all(version in ("1.2", "1.3") for version in ours.values()), ours
    rows = query(db_url, "SELECT body, status, ack_state FROM inbox")
    assert sorted(bytes(b) for b, _, _ in rows) == sorted(sent)
    assert {(status, state) for _, status, state in rows} == {("stored", "acked")}
    assert query(db_url, "SELECT DISTINCT verify_detail FROM events") == [(f"nats user: {USER}",)]


def config(server: NatsServer, scheme: str, db_url: str, redis_url: str) -> AdapterConfig:
    (cfg,) = settings(db_url, redis_url, table(url(server, scheme))).adapters
    assert cfg.options.tls_ca_file is None  # the system's CAs, which never signed the suite's CA
    return cfg


def messages(exc: BaseException) -> str:
    """The error's text and its causes'."""
    texts = []
    cause: BaseException | None = exc
    while cause is not None:
        texts.append(f"{type(cause).__name__}: {cause}")
        cause = cause.__cause__ or cause.__context__
    return "\n".join(texts)


async def ack_once(cfg: AdapterConfig) -> None:
    """One +ACK by the acker's code, to a well-formed ack subject of the consumer."""
    claim = AckClaim(inbox_id=1, adapter=NAME, kind=ACK_KIND, key=STREAM, group=GROUP,
                     ref=f"$JS.ACK.{STREAM}.{GROUP}.1.1.1.1.0", copies=1, body=None)  # fmt: skip
    acker = make_acknowledger(cfg)
    try:
        await acker.ack([claim])
    finally:
        await acker.close()


@pytest.mark.parametrize("scheme", ["tls", "nats"])
async def test_without_the_ca_the_certificate_is_refused(
    scheme: str, server: NatsServer, broker: Streams, db_url: str, redis_url: str
) -> None:
    cfg = config(server, scheme, db_url, redis_url)
    adapter = make_adapter(cfg, ledger=None)
    try:
        with pytest.raises(BrokerError) as raised:
            await adapter.start()
    finally:
        await adapter.close()
    text = str(raised.value)
    assert "certificate verify failed" in text.lower(), text
    assert f"127.0.0.1:{server.port}" in text
    assert SECRET not in messages(raised.value)
    assert isinstance(raised.value.__cause__, ssl.SSLCertVerificationError)

    # The acker's connection is refused alike, before any +ACK is sent.
    with pytest.raises(IngestError) as refused:
        await ack_once(cfg)
    assert "certificate verify failed" in str(refused.value).lower(), refused.value
    assert SECRET not in messages(refused.value)
    # Nothing reached the consumer: the adapter never got to create it.
    assert await broker.consumer(STREAM, GROUP) is None


async def test_the_ackers_refused_connection_is_an_ack_error(
    server: NatsServer, broker: Streams, db_url: str, redis_url: str
) -> None:
    with pytest.raises(AckError):
        await ack_once(config(server, "tls", db_url, redis_url))


@pytest.mark.parametrize("keys", [{"scheme": "tls"}, {"scheme": "nats", "tls_ca_file": True}])
async def test_a_server_that_offers_no_tls_never_sees_the_password(
    keys: dict[str, Any], authority: Authority, db_url: str, redis_url: str
) -> None:
    """nats-py upgrades only when the server's INFO asks for TLS: a server (or
    a man in the middle) that does not would have been sent CONNECT with the
    password in clear. A listener that answers like a plain nats-server and
    records every byte: the adapter refuses it before sending anything."""
    received = bytearray()

    async def plain_server(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        info = {"server_id": "x", "version": "2.15.1", "proto": 1, "headers": True, "auth_required": True}
        writer.write(b"INFO " + json.dumps(info).encode() + b"\r\n")
        await writer.drain()
        with contextlib.suppress(OSError, TimeoutError):
            async with asyncio.timeout(3):
                while data := await reader.read(4096):
                    received.extend(data)
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()

    listener = await asyncio.start_server(plain_server, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    target = f"{keys['scheme']}://{USER}:{SECRET}@127.0.0.1:{port}"
    extra = {"tls_ca_file": str(authority.ca)} if keys.get("tls_ca_file") else {}
    (cfg,) = settings(db_url, redis_url, table(target, **extra)).adapters
    adapter = make_adapter(cfg, ledger=None)
    try:
        async with listener:
            with pytest.raises(BrokerError, match="does not offer TLS"):
                await adapter.start()
    finally:
        await adapter.close()
    assert SECRET.encode() not in bytes(received)
    assert b"CONNECT" not in bytes(received)
