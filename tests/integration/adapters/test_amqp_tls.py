"""AMQP over TLS: a RabbitMQ with a TLS listener beside its plain one, its
certificate signed by the suite's throwaway CA (tests/support/tls.py). With
an ``amqps://`` URL and ``tls_ca_file`` naming that CA the pipeline stores
and acks, over TLS (the broker's own connection list says so); with another
CA, or none (the system's CAs), the certificate is refused: a BrokerError
naming the verification, without the password, and nothing is stored."""

from __future__ import annotations

import asyncio
import json
import re
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ingest.adapters.factory import make_adapter
from ingest.embedded.rabbitmq_server import AmqpTls, RabbitMqServer
from ingest.errors import BrokerError
from tests.support.amqp import declare_queue, owned_rabbitmq, publish, purge_queue, queue_counts
from tests.support.db import query, scalar
from tests.support.in_process import pipeline, settings, wait_until
from tests.support.processes import SECRET
from tests.support.tls import Authority, make_authority

USER = "switchboard"
NAME = "orders"
QUEUE = "orders"
# Each connection's name (the client's ``connection_name``, as a string:
# erl_call prints a binary as #Bin<bytes>) and whether it is TLS.
CONNECTIONS = (
    '[{case lists:keyfind(<<"connection_name">>, 1, proplists:get_value(client_properties, I)) of'
    ' {_, _, N} -> binary_to_list(N); false -> "" end, proplists:get_value(ssl, I)}'
    " || I <- rabbit_networking:connection_info_all([client_properties, ssl])]."
)


@pytest.fixture(scope="module")
def authority(tmp_path_factory: pytest.TempPathFactory) -> Authority:
    return make_authority(tmp_path_factory.mktemp("amqp-tls"))


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA that never signed the broker's certificate."""
    return make_authority(tmp_path_factory.mktemp("amqp-tls-other")).ca


@pytest.fixture(scope="module")
def server(authority: Authority) -> Iterator[RabbitMqServer]:
    tls = AmqpTls(certfile=authority.server.cert, keyfile=authority.server.key, cacertfile=authority.ca)
    with owned_rabbitmq(tls=tls) as s:
        declare_queue(s.url, QUEUE)
        yield s


@pytest.fixture
def registered() -> tuple[tuple[str, str], ...]:
    return ()  # the pipeline registers its adapter itself


@pytest.fixture
def queue(server: RabbitMqServer) -> str:
    purge_queue(server.url, QUEUE)
    return QUEUE


def table(server: RabbitMqServer, **keys: Any) -> dict[str, Any]:
    url = server.tls_url_as(USER, SECRET)
    return {
        "name": NAME,
        "transport": "amqp",
        "source": QUEUE,
        "url": url,
        "consumer": "c1",
        "block_ms": 100,
        **keys,
    }


def connections(server: RabbitMqServer) -> dict[str, bool]:
    """Connection name -> over TLS, from the broker itself."""
    found = re.findall(r'\{"([^"]*)",\s*(true|false)\}', server.evaluate(CONNECTIONS))
    return {name: tls == "true" for name, tls in found}


def bodies(n: int) -> list[bytes]:
    return [json.dumps({"n": i}).encode() for i in range(n)]


def messages(exc: BaseException) -> str:
    """The error's text and its causes'."""
    texts = []
    cause: BaseException | None = exc
    while cause is not None:
        texts.append(f"{type(cause).__name__}: {cause}")
        cause = cause.__cause__ or cause.__context__
    return "\n".join(texts)


async def test_with_the_ca_the_pipeline_stores_and_acks_over_tls(
    server: RabbitMqServer, authority: Authority, queue: str, db_url: str, redis_url: str
) -> None:
    sent = bodies(10)
    publish(server.url, queue, sent)
    s = settings(db_url, redis_url, table(server, tls_ca_file=str(authority.ca)))
    async with pipeline(s, acker=False):
        await wait_until(
            lambda: scalar(db_url, "SELECT count(*) FROM inbox WHERE ack_state = 'acked'") == len(sent)
        )
        await wait_until(lambda: queue_counts(server.url, queue)[:2] == (0, 0))
        seen = await asyncio.to_thread(connections, server)
    ours = {name: tls for name, tls in seen.items() if name.startswith(f"switchboard ingest {NAME}")}
    assert list(ours.values()) == [True], seen
    rows = query(db_url, "SELECT body, status, ack_state FROM inbox")
    assert sorted(bytes(b) for b, _, _ in rows) == sorted(sent)
    assert {(status, state) for _, status, state in rows} == {("stored", "acked")}
    assert query(db_url, "SELECT DISTINCT verify_detail FROM events") == [(f"amqp user: {USER} vhost: /",)]


@pytest.mark.parametrize("ca", ["another CA", "the system's CAs"])
async def test_without_the_ca_the_certificate_is_refused_and_nothing_is_stored(
    ca: str, server: RabbitMqServer, other_ca: Path, queue: str, db_url: str, redis_url: str
) -> None:
    keys = {"tls_ca_file": str(other_ca)} if ca == "another CA" else {}
    (cfg,) = settings(db_url, redis_url, table(server, **keys)).adapters
    assert cfg.options.tls_ca_file == keys.get("tls_ca_file")
    adapter = make_adapter(cfg, ledger=None)
    try:
        with pytest.raises(BrokerError) as raised:
            await adapter.start()
    finally:
        await adapter.close()
    text = str(raised.value)
    assert "certificate verify failed" in text.lower(), text
    assert f"connecting to 127.0.0.1:{server.tls_port}" in text, text
    assert SECRET not in messages(raised.value)
    assert any(isinstance(e, ssl.SSLCertVerificationError) for e in _chain(raised.value)), messages(
        raised.value
    )

    # The pipeline, given the time to retry: nothing stored, nothing taken.
    sent = bodies(5)
    publish(server.url, queue, sent)
    async with pipeline(settings(db_url, redis_url, table(server, **keys)), acker=False):
        await asyncio.sleep(1.5)
    assert scalar(db_url, "SELECT count(*) FROM inbox") == 0
    assert queue_counts(server.url, queue) == (len(sent), 0, 0)


def _chain(exc: BaseException) -> list[BaseException]:
    found: list[BaseException] = []
    cause: BaseException | None = exc
    while cause is not None:
        found.append(cause)
        cause = cause.__cause__ or cause.__context__
    return found
