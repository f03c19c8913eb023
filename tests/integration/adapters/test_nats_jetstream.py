"""The JetStream adapter's own behaviours, against a real nats-server: the
consumer it creates or corrects, a stream re-created under it, a missing
stream, the acker stopped (max_ack_pending reached), acks to a consumer
that is gone."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from nats.js.api import AckPolicy, ConsumerConfig
from sqlalchemy.ext.asyncio import AsyncEngine
from structlog.testing import capture_logs

from backhalf.records import AckClaim
from ingest.adapters.factory import make_acknowledger, make_adapter
from ingest.config import AdapterConfig, Settings, from_mapping
from ingest.errors import BrokerError, ConfigError
from tests.support.db import query, scalar
from tests.support.in_process import pipeline, settings, wait_until
from tests.support.nats import Streams, owned_nats, streams

STREAM = "ORDERS"
SUBJECT = "ORDERS.new"
GROUP = "switchboard"


@pytest.fixture
async def broker(nats_url: str) -> AsyncIterator[Streams]:
    async with streams(nats_url) as s:
        await s.reset()
        await s.create(STREAM)
        yield s


@pytest.fixture
def registered() -> tuple[tuple[str, str], ...]:
    return ()  # the pipeline registers its adapter itself


def table(url: str, **keys: Any) -> dict[str, Any]:
    return {
        "name": "orders",
        "transport": "nats",
        "source": STREAM,
        "queue": "orders",
        "url": url,
        "block_ms": 100,
        "ack_wait_ms": 2000,
        **keys,
    }


def nats_settings(db_url: str, url: str, **keys: Any) -> Settings:
    return settings(db_url, "redis://127.0.0.1:1/0", table(url, **keys))


def config(db_url: str, url: str, **keys: Any) -> AdapterConfig:
    (cfg,) = nats_settings(db_url, url, **keys).adapters
    return cfg


def bodies(n: int, tag: str = "a") -> list[bytes]:
    return [json.dumps({"tag": tag, "n": i}).encode() for i in range(n)]


async def test_a_stream_recreated_under_a_running_ingester_drops_nothing(
    db_url: str, nats_url: str, broker: Streams
) -> None:
    """Its sequences restart at 1: the new messages on sequences the inbox
    holds are stored under the reused-id form of their keys, not dropped."""
    old, new = bodies(3, "old"), bodies(3, "new")
    async with pipeline(nats_settings(db_url, nats_url)):
        for body in old:
            await broker.publish(SUBJECT, body)
        await wait_until(lambda: broker.settled(STREAM, GROUP))
        await broker.js.delete_stream(STREAM)
        await broker.create(STREAM)
        for body in new:
            await broker.publish(SUBJECT, body)
        await wait_until(lambda: scalar(db_url, "SELECT count(*) FROM inbox") == 6)
        await wait_until(lambda: broker.settled(STREAM, GROUP))
    rows = query(db_url, "SELECT idempotency_key, source_message_id, body, ack_state FROM inbox ORDER BY id")
    assert [bytes(b) for _, _, b, _ in rows] == old + new
    assert [k for k, *_ in rows[:3]] == [f"nats:{STREAM}:{i}" for i in (1, 2, 3)]
    for (key, seq, _, _), i in zip(rows[3:], (1, 2, 3), strict=True):
        assert (seq, key.rsplit(":", 1)[0]) == (str(i), f"nats:{STREAM}:{i}")  # the reused-id form
    assert {state for *_, state in rows} == {"acked"}
    assert scalar(db_url, "SELECT count(*) FROM todos") == 6


async def test_a_missing_stream_is_a_broker_error_saying_to_create_it(
    db_url: str, nats_url: str, broker: Streams
) -> None:
    adapter = make_adapter(config(db_url, nats_url, source="NOPE"), ledger=None)
    try:
        with pytest.raises(BrokerError) as raised:
            await adapter.start()
    finally:
        await adapter.close()
    assert "the JetStream stream 'NOPE' does not exist" in str(raised.value)
    assert "create it" in str(raised.value)


async def test_an_existing_consumer_is_brought_to_switchboards_settings(
    db_url: str, nats_url: str, broker: Streams
) -> None:
    """A consumer someone made with a max_deliver would drop messages past it
    unseen; it is corrected (and said) before anything is read."""
    await broker.js.add_consumer(
        STREAM,
        config=ConsumerConfig(durable_name=GROUP, ack_policy=AckPolicy.EXPLICIT, max_deliver=5, ack_wait=30),
    )
    adapter = make_adapter(config(db_url, nats_url, max_ack_pending=700), ledger=None)
    try:
        with capture_logs() as logs:
            await adapter.start()
    finally:
        await adapter.close()
    info = await broker.consumer(STREAM, GROUP)
    assert info is not None
    assert (info.config.max_deliver, info.config.ack_wait, info.config.max_ack_pending) == (-1, 2.0, 700)
    (updated,) = [e for e in logs if e["event"] == "consumer_updated"]
    assert set(updated["settings"]) == {"max_deliver", "ack_wait", "max_ack_pending"}


async def test_a_consumer_without_explicit_acks_is_refused_naming_it(
    db_url: str, nats_url: str, broker: Streams
) -> None:
    await broker.js.add_consumer(STREAM, config=ConsumerConfig(durable_name=GROUP, ack_policy=AckPolicy.NONE))
    adapter = make_adapter(config(db_url, nats_url), ledger=None)
    try:
        with pytest.raises(BrokerError) as raised:
            await adapter.start()
    finally:
        await adapter.close()
    assert f"consumer {GROUP!r} of stream {STREAM!r} has ack policy" in str(raised.value)
    assert "needs explicit acks" in str(raised.value)


async def test_a_stopped_acker_holds_ingestion_at_max_ack_pending_and_says_why(
    db_url: str, nats_url: str, broker: Streams
) -> None:
    s = nats_settings(db_url, nats_url, max_ack_pending=10, batch_size=5, ack_wait_ms=60_000)
    for body in bodies(30):
        await broker.publish(SUBJECT, body)
    with capture_logs() as logs:
        async with pipeline(s, acker=False):
            await wait_until(lambda: scalar(db_url, "SELECT count(*) FROM inbox") == 10)
            await wait_until(lambda: any(e["event"] == "waiting_for_acks" for e in logs), timeout_s=15)
            assert scalar(db_url, "SELECT count(*) FROM inbox") == 10  # the server's bound, not ours
    (said, *_) = [e for e in logs if e["event"] == "waiting_for_acks"]
    assert (said["ack_pending"], said["max_ack_pending"], said["stream_pending"]) == (10, 10, 20)
    async with pipeline(s):  # the acker back: everything drains
        await wait_until(lambda: broker.settled(STREAM, GROUP), timeout_s=30)
        await wait_until(lambda: scalar(db_url, "SELECT count(*) FROM inbox WHERE ack_state = 'acked'") == 30)
    assert scalar(db_url, "SELECT count(*) FROM todos") == 30


async def test_acks_for_a_consumer_that_is_gone_are_given_up_with_a_warning(
    db_url: str, nats_url: str, broker: Streams, engine: AsyncEngine
) -> None:
    """Its unacked deliveries went with it; a consumer made again delivers
    them anew, and their acks are asked again then."""
    cfg = config(db_url, nats_url)
    adapter = make_adapter(cfg, ledger=None)
    await broker.publish(SUBJECT, b'{"n": 1}')
    try:
        (delivery,) = await adapter.read(1)
    finally:
        await adapter.close()
    await broker.js.delete_consumer(STREAM, GROUP)
    acknowledger = make_acknowledger(cfg)
    claim = AckClaim(1, "orders", "jsack", STREAM, GROUP, delivery.ack_ref, copies=1, body=None)
    try:
        with capture_logs() as logs:
            await acknowledger.ack([claim])
    finally:
        await acknowledger.close()
    (gone,) = [e for e in logs if e["event"] == "ack_consumer_missing"]
    assert (gone["stream"], gone["consumer"], gone["acks"]) == (STREAM, GROUP, 1)


async def test_a_password_with_reserved_characters_logs_in(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``password_env`` puts the password into the URL percent-encoded; nats-py
    sends a URL's password as written, so it reaches the server decoded or
    not at all (it was refused: 'Authorization Violation')."""
    password = "a/b+c@d:e%f g"
    access = 'authorization { users = [ { user: "sb", password: "a/b+c@d:e%f g" } ] }\n'
    monkeypatch.setenv("SB_NATS_USER", "sb")
    monkeypatch.setenv("SB_NATS_PASSWORD", password)
    with owned_nats(access=access) as server:
        url = f"nats://127.0.0.1:{server.port}"
        async with streams(url, user="sb", password=password) as s:
            await s.create(STREAM)
        table_ = table(url, username_env="SB_NATS_USER", password_env="SB_NATS_PASSWORD")
        (cfg,) = from_mapping(
            {"database": {"url": db_url}, "adapters": [table_]},
            {"SB_NATS_USER": "sb", "SB_NATS_PASSWORD": password},
        ).adapters
        adapter = make_adapter(cfg, ledger=None)
        try:
            await adapter.start()
            assert adapter.identity == "nats user: sb"
        finally:
            await adapter.close()


async def test_an_old_streams_acks_never_ack_the_new_streams_messages(
    db_url: str, nats_url: str, broker: Streams
) -> None:
    """The server reads an ack subject by stream, consumer and sequence: after
    the stream is deleted and created again, an ack owed to the old stream's
    message on sequence 1 would ack the new stream's message 1, perhaps not
    stored yet. The acker gives such acks up (their messages went with the
    old stream) and the new messages stay unacked until they are stored."""
    cfg = config(db_url, nats_url)
    for body in bodies(3, "old"):
        await broker.publish(SUBJECT, body)
    old = make_adapter(cfg, ledger=None)
    try:
        held = await old.read(3)
    finally:
        await old.close()
    assert len(held) == 3
    await broker.js.delete_stream(STREAM)
    await broker.create(STREAM)
    for body in bodies(3, "new"):
        await broker.publish(SUBJECT, body)
    new = make_adapter(cfg, ledger=None)
    try:
        fresh = await new.read(3)
    finally:
        await new.close()
    assert [d.message_id for d in fresh] == [d.message_id for d in held] == ["1", "2", "3"]
    acknowledger = make_acknowledger(cfg)
    claims = [
        AckClaim(i, "orders", "jsack", STREAM, GROUP, d.ack_ref, copies=1, body=None)
        for i, d in enumerate(held)
    ]
    try:
        with capture_logs() as logs:
            await acknowledger.ack(claims)
    finally:
        await acknowledger.close()
    assert await broker.unacked(STREAM, GROUP) == 3  # the new messages: still the server's to redeliver
    (given_up,) = [e for e in logs if e["event"] == "acks_given_up"]
    assert (given_up["stream"], given_up["acks"]) == (STREAM, 3)


async def test_a_creds_file_the_server_refuses_is_a_broker_error(
    db_url: str, nats_url: str, broker: Streams, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``credentials_file_env`` names the variable holding a creds file's path
    (nats-py signs the server's challenge with its NKey: the ``nats`` extra
    brings nkeys). One the server does not accept is a broker error, backed
    off like any other, never a crash; and an unset variable says so."""
    creds = tmp_path / "app.creds"
    creds.write_text("not a creds file\n")
    monkeypatch.setenv("SB_NATS_CREDS", str(creds))
    bare = f"nats://127.0.0.1:{urlsplit(nats_url).port}"
    adapter = make_adapter(config(db_url, bare, credentials_file_env="SB_NATS_CREDS"), ledger=None)
    try:
        with pytest.raises(BrokerError, match="Authorization Violation"):
            await adapter.start()
        monkeypatch.delenv("SB_NATS_CREDS")
        with pytest.raises(ConfigError, match="'SB_NATS_CREDS' is not set or empty"):
            await adapter.start()
    finally:
        await adapter.close()


async def test_acks_go_only_to_the_adapters_own_stream_and_consumer(
    db_url: str, nats_url: str, broker: Streams
) -> None:
    """Issue 43: an intent's reply subject, stream and consumer are a row's
    data, which any login that may write the row can point elsewhere. A
    reply subject of another consumer of the stream (with the row's group
    pointed there too, or not), or of another stream's consumer, gets no
    +ACK: those messages are redelivered to their own consumers, none of
    those intents is returned as refused (it would stay owed forever), one
    error line names them, and the adapter's own intent is acked."""
    cfg = config(db_url, nats_url)
    await broker.publish(SUBJECT, b'{"n": 1}')
    await broker.create("PAYMENTS")
    await broker.publish("PAYMENTS.new", b'{"n": 2}')
    # Another application's consumer of the same stream, and another
    # stream's consumer named as the adapter's.
    others = []
    for stream, durable in ((STREAM, "billing"), ("PAYMENTS", GROUP)):
        await broker.js.add_consumer(
            stream, config=ConsumerConfig(durable_name=durable, ack_policy=AckPolicy.EXPLICIT, ack_wait=1)
        )
        sub = await broker.js.pull_subscribe_bind(durable=durable, stream=stream)
        (msg,) = await sub.fetch(1, timeout=5)
        others.append((sub, msg))
    (_, billing), (_, payments) = others
    adapter = make_adapter(cfg, ledger=None)
    try:
        (mine,) = await adapter.read(1)
    finally:
        await adapter.close()
    claims = [
        AckClaim(1, "orders", "jsack", STREAM, GROUP, mine.ack_ref, copies=1, body=None),
        AckClaim(2, "orders", "jsack", STREAM, "billing", billing.reply, copies=1, body=None),
        AckClaim(3, "orders", "jsack", STREAM, GROUP, billing.reply, copies=1, body=None),
        AckClaim(4, "orders", "jsack", "PAYMENTS", GROUP, payments.reply, copies=1, body=None),
    ]
    acknowledger = make_acknowledger(cfg)
    try:
        with capture_logs() as logs:
            refused = await acknowledger.ack(claims)
    finally:
        await acknowledger.close()
    assert refused == []
    assert await broker.unacked(STREAM, GROUP) == 0  # the adapter's own: acked
    assert (await broker.unacked(STREAM, "billing"), await broker.unacked("PAYMENTS", GROUP)) == (1, 1)
    for sub, msg in others:  # their ack_wait lapses: delivered to them again
        (again,) = await sub.fetch(1, timeout=5)
        assert (again.data, again.metadata.num_delivered) == (msg.data, 2)
        await sub.unsubscribe()
    (line,) = [e for e in logs if e["event"] == "ack_target_refused"]
    assert (line["log_level"], line["adapter"], line["inbox_ids"]) == ("error", "orders", [2, 3, 4])
    assert line["targets"] == sorted(
        [
            f"jsack {STREAM} billing {billing.reply}",
            f"jsack {STREAM} {GROUP} {billing.reply}",
            f"jsack PAYMENTS {GROUP} {payments.reply}",
        ]
    )


async def test_after_a_consumer_is_renamed_the_old_consumers_acks_are_not_sent(
    db_url: str, nats_url: str, broker: Streams
) -> None:
    """The config names one durable consumer: an intent stored under the
    name it had before is refused like any other consumer's."""
    await broker.publish(SUBJECT, b'{"n": 1}')
    adapter = make_adapter(config(db_url, nats_url), ledger=None)
    try:
        (old,) = await adapter.read(1)
    finally:
        await adapter.close()
    acknowledger = make_acknowledger(config(db_url, nats_url, group="switchboard-v2"))
    try:
        claim = AckClaim(1, "orders", "jsack", STREAM, GROUP, old.ack_ref, copies=1, body=None)
        assert await acknowledger.ack([claim]) == []
    finally:
        await acknowledger.close()
    assert await broker.unacked(STREAM, GROUP) == 1
