"""A typo in the config file is refused in one line that names the adapter
(or table) and the key, and offers the closest known name when one is close
(``ingest.config.keys.close_match``, difflib's ratio): an unknown key, an
unknown table, and a value that must be one of a few words."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ingest.config import from_mapping, load
from ingest.errors import ConfigError

DB = {"url": "postgresql+psycopg://u@h/db"}


def adapter(**kw: Any) -> dict[str, Any]:
    return {"name": "orders", "source": "orders", **kw}


def _error(raw: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as info:
        from_mapping({"database": DB, **raw}, {})
    message = str(info.value)
    assert "\n" not in message  # one line, whatever it offers
    return message


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (
            {"adapters": [adapter(bach_size=10)]},
            "adapter 'orders': unknown key 'bach_size' (did you mean 'batch_size'?)",
        ),
        (
            {"adapters": [adapter(mode="list", heartbeat_ttl=5000)]},
            "adapter 'orders': unknown key 'heartbeat_ttl' (did you mean 'heartbeat_ttl_ms'?)",
        ),
        (
            {"adapters": [adapter(transport="webhook", mode="github", secrets_env=["S"], sorce="x")]},
            "adapter 'orders': unknown key 'sorce' (did you mean 'source'?)",
        ),
        (
            {"ingest": {"shutdown_timeout": 5}},
            "[ingest]: unknown key 'shutdown_timeout' (did you mean 'shutdown_timeout_s'?)",
        ),
        (
            {"database": {**DB, "statment_timeout_ms": 5}},
            "[database]: unknown key 'statment_timeout_ms' (did you mean 'statement_timeout_ms'?)",
        ),
        (
            {"queues": {"q": {"handler": "m:f", "max_attempt": 3}}},
            "[queues.q]: unknown key 'max_attempt' (did you mean 'max_attempts'?)",
        ),
        ({"metrics": {"prot": 9464}}, "[metrics]: unknown key 'prot' (did you mean 'port'?)"),
        # An unknown table: [[adapter]] for [[adapters]], [acker ] spelt [ackr].
        ({"adapter": [adapter()]}, "config: unknown key 'adapter' (did you mean 'adapters'?)"),
        ({"ackr": {}}, "config: unknown key 'ackr' (did you mean 'acker'?)"),
    ],
)
def test_an_unknown_key_or_table_offers_the_closest_known_one(raw: dict[str, Any], message: str) -> None:
    assert _error(raw) == message


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (
            {"adapters": [adapter(mode="lsit")]},
            "adapter 'orders': key 'mode' must be one of stream, list, pubsub, jetstream, queue"
            " (got 'lsit'; did you mean 'list'?)",
        ),
        (
            {"adapters": [adapter(transport="reddis")]},
            "adapter 'orders': key 'transport' must be one of redis, nats, sqs, amqp, webhook"
            " (got 'reddis'; did you mean 'redis'?)",
        ),
        (
            {"adapters": [adapter(transport="webhok")]},
            "adapter 'orders': key 'transport' must be one of redis, nats, sqs, amqp, webhook"
            " (got 'webhok'; did you mean 'webhook'?)",
        ),
        (
            {"adapters": [adapter(transport="webhook", mode="githb", secrets_env=["S"])]},
            "adapter 'orders': key 'mode' must be one of standard-webhooks, github, stripe"
            " (got 'githb'; did you mean 'github'?)",
        ),
        (
            {"adapters": [adapter(ack_after="stroe")]},
            "adapter 'orders': key 'ack_after' must be \"store\" or \"complete\""
            " (got 'stroe'; did you mean 'store'?)",
        ),
        (
            {"adapters": [adapter(format="jsno")]},
            "adapter 'orders': key 'format' must be json, text or bytes (got 'jsno'; did you mean 'json'?)",
        ),
        (
            {"adapters": [adapter(mode="pubsub", delivery="at-most-one")]},
            "adapter 'orders': key 'delivery' must be \"at-least-once\" or \"at-most-once\""
            " (got 'at-most-one'; did you mean 'at-most-once'?)",
        ),
    ],
)
def test_a_mistyped_choice_offers_the_closest_one(raw: dict[str, Any], message: str) -> None:
    assert _error(raw) == message


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"adapters": [adapter(zzz=1)]}, "adapter 'orders': unknown key 'zzz' (allowed: "),
        ({"worker": {"bogus": 1}}, "[worker]: unknown key 'bogus' (allowed: lease_ms, poll_interval_ms)"),
        ({"kafka": {}}, "config: unknown key 'kafka' (allowed: "),
        (
            {"adapters": [adapter(transport="kafka")]},
            "adapter 'orders': key 'transport' must be one of redis, nats, sqs, amqp, webhook (got 'kafka')",
        ),
        (
            {"adapters": [adapter(mode=3)]},
            "adapter 'orders': key 'mode' must be one of stream, list, pubsub, jetstream, queue (got 3)",
        ),
    ],
)
def test_nothing_is_offered_when_nothing_is_close(raw: dict[str, Any], message: str) -> None:
    error = _error(raw)
    assert error.startswith(message)
    assert "did you mean" not in error


def test_the_file_loader_says_it_the_same_way(tmp_path: Path) -> None:
    path = tmp_path / "switchboard.toml"
    path.write_text(
        '[database]\nurl = "postgresql://u@h/db"\n\n'
        '[[adapters]]\nname = "orders"\nsource = "orders"\nbach_size = 10\n',
        encoding="utf-8",
    )
    with pytest.raises(
        ConfigError, match=r"^adapter 'orders': unknown key 'bach_size' \(did you mean 'batch_size'\?\)$"
    ):
        load(path, {})
