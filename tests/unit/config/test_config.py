"""Config loading: errors name the adapter and the key; env overrides apply."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import quote

import pytest
from redis.asyncio.connection import parse_url

from ingest import config
from ingest.adapters.factory import make_acknowledger
from ingest.config import from_mapping, load
from ingest.config.keys import Key, Section
from ingest.errors import ConfigError

DB = {"url": "postgresql://sb@localhost/sb"}


def adapter(**kw: Any) -> dict[str, Any]:
    return {"name": "orders", "mode": "stream", "source": "orders", "queue": "orders", **kw}


def test_minimal_config_from_the_design() -> None:
    s = from_mapping({"database": DB, "adapters": [adapter(group="switchboard", batch_size=500)]}, {})
    a = s.adapters[0]
    assert (a.name, a.mode, a.source, a.options.group, a.queue, a.ack_after, a.batch_size) == (
        "orders", "stream", "orders", "switchboard", "orders", "store", 500,
    )  # fmt: skip
    assert a.key_prefix == "redis"
    assert a.options.start_id == "0"
    assert s.database.url.startswith("postgresql+psycopg://")


def test_environment_overrides_database_and_default_redis() -> None:
    env = {"SWITCHBOARD_DATABASE_URL": "postgresql://x@db/y", "SWITCHBOARD_REDIS_URL": "redis://r:1/2"}
    s = from_mapping({"database": DB, "adapters": [adapter()]}, env)
    assert s.database.url == "postgresql+psycopg://x@db/y"
    assert s.adapters[0].broker.url() == "redis://r:1/2"


@pytest.mark.parametrize(
    ("raw", "needles"),
    [
        (adapter(mode="kafka"), ["'orders'", "'mode'", "kafka"]),
        (adapter(bogus=1), ["'orders'", "'bogus'"]),
        (adapter(batch_size=0), ["'orders'", "'batch_size'"]),
        (adapter(batch_size="10"), ["'orders'", "'batch_size'"]),
        (adapter(mode="pubsub"), ["'orders'", "'delivery'", "at-most-once"]),
        (adapter(format="xml"), ["'orders'", "'format'"]),
        (adapter(ack_after="later"), ["'orders'", "'ack_after'"]),
        ({"mode": "stream", "source": "s"}, ["adapters[0]", "'name'"]),
        (adapter(source=""), ["'orders'", "'source'"]),
    ],
)
def test_config_errors_name_adapter_and_key(raw: dict[str, Any], needles: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        from_mapping({"database": DB, "adapters": [raw]}, {})
    for needle in needles:
        assert needle in str(info.value)


def test_duplicate_adapter_names_are_refused() -> None:
    with pytest.raises(ConfigError, match="more than one"):
        from_mapping({"database": DB, "adapters": [adapter(), adapter()]}, {})


def test_missing_database_url() -> None:
    with pytest.raises(ConfigError, match=r"\[database\].*'url'"):
        from_mapping({"adapters": [adapter()]}, {})


def test_transaction_deadline_must_exceed_the_statement_timeout() -> None:
    db = {**DB, "statement_timeout_ms": 5000}
    s = from_mapping({"database": {**db, "transaction_deadline_ms": 6000}, "adapters": [adapter()]}, {})
    assert s.database.transaction_deadline_ms == 6000
    with pytest.raises(ConfigError, match=r"'transaction_deadline_ms'.*5000 <= 5000"):
        from_mapping({"database": {**db, "transaction_deadline_ms": 5000}, "adapters": [adapter()]}, {})


def test_max_inflight_bytes_must_hold_one_message_of_every_adapter() -> None:
    ok = from_mapping(
        {
            "database": DB,
            "ingest": {"max_inflight_bytes": 1024},
            "adapters": [adapter(max_message_bytes=1024)],
        },
        {},
    )
    assert ok.ingest.max_inflight_bytes == 1024
    assert config.IngestSettings().max_inflight_bytes == 128 * 1024 * 1024
    with pytest.raises(ConfigError, match=r"'max_inflight_bytes' \(1024\) must be at least adapter 'orders'"):
        from_mapping({"database": DB, "ingest": {"max_inflight_bytes": 1024}, "adapters": [adapter()]}, {})


def test_unknown_top_level_key_and_bad_toml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="'colour'"):
        from_mapping({"database": DB, "colour": 1}, {})
    bad = tmp_path / "bad.toml"
    bad.write_text("[database\nurl=")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load(bad, {})
    with pytest.raises(ConfigError, match="not found"):
        load(tmp_path / "missing.toml", {})


def test_queues_and_metrics_sections_are_accepted() -> None:
    s = from_mapping(
        {
            "database": DB,
            "adapters": [adapter()],
            "queues": {"orders": {"handler": "m:f", "max_attempts": 5}},
            "metrics": {"port": 9464},
        },
        {},
    )
    assert s.metrics.port == 9464
    assert s.metrics.address == "127.0.0.1"  # loopback unless said otherwise


def test_metrics_port_comes_from_the_environment_over_the_file() -> None:
    raw = {"database": DB, "metrics": {"port": 9464, "address": "0.0.0.0", "refresh_interval_ms": 1000}}
    s = from_mapping(raw, {"SWITCHBOARD_METRICS_PORT": "9500"})
    assert (s.metrics.port, s.metrics.address, s.metrics.refresh_interval_ms) == (9500, "0.0.0.0", 1000)


@pytest.mark.parametrize(
    ("raw", "env", "needle"),
    [
        ({"port": 70000}, {}, "[metrics]: key 'port' must be 0..65535"),
        ({"port": True}, {}, "[metrics]: key 'port' must be 0..65535"),
        ({}, {"SWITCHBOARD_METRICS_PORT": "http"}, "SWITCHBOARD_METRICS_PORT must be 0..65535"),
        ({"refresh_interval_ms": 10}, {}, "[metrics]: key 'refresh_interval_ms': must be an integer >= 100"),
        ({"address": ""}, {}, "[metrics]: key 'address': must be a non-empty string"),
        ({"host": "x"}, {}, "[metrics]: unknown key 'host'"),
    ],
)
def test_bad_metrics_settings_are_refused(raw: dict[str, Any], env: dict[str, str], needle: str) -> None:
    with pytest.raises(ConfigError) as caught:
        from_mapping({"database": DB, "metrics": raw}, env)
    assert needle in str(caught.value)


@pytest.mark.parametrize(
    ("raw", "needles"),
    [
        (adapter(url="htp://cache:6379"), ["'orders'", "'url'"]),
        (adapter(start_id="--"), ["'orders'", "'start_id'"]),
        (adapter(start_id="0-0-0"), ["'orders'", "'start_id'"]),
        (adapter(delivery="sometimes"), ["'orders'", "'delivery'"]),
    ],
)
def test_more_adapter_errors(raw: dict[str, Any], needles: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        from_mapping({"database": DB, "adapters": [raw]}, {})
    for needle in needles:
        assert needle in str(info.value)


def test_counts_must_be_integers_but_seconds_may_be_fractional() -> None:
    with pytest.raises(ConfigError, match=r"\[acker\]: key 'batch_size'.*integer"):
        from_mapping({"database": DB, "acker": {"batch_size": 2.5}}, {})
    s = from_mapping({"database": DB, "ingest": {"shutdown_timeout_s": 2.5}}, {})
    assert s.ingest.shutdown_timeout_s == 2.5


def test_list_and_pubsub_modes_are_accepted() -> None:
    s = from_mapping(
        {
            "database": DB,
            "adapters": [
                adapter(name="jobs", mode="list", source="jobs", heartbeat_ttl_ms=5000),
                adapter(name="events", mode="pubsub", source="ch", delivery="at-most-once"),
            ],
        },
        {},
    )
    assert [a.mode for a in s.adapters] == ["list", "pubsub"]
    assert s.adapters[0].options.heartbeat_ttl_ms == 5000


def test_the_shipped_example_config_loads() -> None:
    s = load(Path(__file__).parents[3] / "ops" / "switchboard.example.toml", {})
    assert [(a.name, a.mode) for a in s.adapters] == [
        ("orders", "stream"),
        ("jobs", "list"),
        ("notifications", "pubsub"),
    ]


COMMON_PUBLIC = {
    "source", "queue", "consumer", "ack_after", "batch_size", "block_ms", "key_prefix", "format",
    "max_message_bytes", "max_deliveries", "schema_timeout_ms",
}  # fmt: skip
EVERY_KEY = {
    "name", "transport", "mode", "source", "group", "consumer", "queue", "ack_after", "batch_size",
    "block_ms", "claim_idle_ms", "claim_interval_ms", "start_id", "key_prefix", "body_field", "format",
    "max_message_bytes", "url", "delivery", "heartbeat_ttl_ms", "reap_interval_ms", "max_deliveries",
    "schema", "schema_timeout_ms", "retain_acked_days", "retain_rejected_days", "username_env",
    "password_env", "subject", "max_ack_pending", "ack_wait_ms", "credentials_file_env", "token_env",
    "tls_ca_file", "region", "cluster",
}  # fmt: skip


def test_a_stream_adapter_publishes_its_claim_interval() -> None:
    s = from_mapping({"database": DB, "adapters": [adapter(claim_interval_ms=750)]}, {})
    public = s.adapters[0].public_settings()
    assert public["claim_interval_ms"] == 750
    stream_only = {"group", "claim_idle_ms", "claim_interval_ms", "start_id", "body_field"}
    assert set(public) == COMMON_PUBLIC | stream_only | {"cluster"}


def test_a_list_adapter_publishes_its_reap_interval_and_nothing_of_streams() -> None:
    raw = adapter(mode="list", reap_interval_ms=250)
    public = from_mapping({"database": DB, "adapters": [raw]}, {}).adapters[0].public_settings()
    assert (public["reap_interval_ms"], public["heartbeat_ttl_ms"]) == (250, 30_000)
    assert set(public) == COMMON_PUBLIC | {"heartbeat_ttl_ms", "reap_interval_ms", "cluster"}


def test_a_pubsub_adapter_publishes_its_delivery_and_never_the_url() -> None:
    raw = adapter(mode="pubsub", delivery="at-most-once", url="redis://:secret@cache:6379/0")
    public = from_mapping({"database": DB, "adapters": [raw]}, {}).adapters[0].public_settings()
    assert public["delivery"] == "at-most-once"
    assert set(public) == COMMON_PUBLIC | {"delivery", "cluster"}
    assert "secret" not in json.dumps(public)  # and it is plain JSON for adapters.settings
    assert public["format"] == "json"


_MODE_KEYS: dict[str, dict[str, Any]] = {
    "stream": {
        "group": "g", "start_id": "$", "body_field": "b", "claim_idle_ms": 1, "claim_interval_ms": 1,
        "cluster": False,
    },
    "list": {"heartbeat_ttl_ms": 1000, "reap_interval_ms": 1, "cluster": False},
    "pubsub": {"delivery": "at-most-once", "cluster": False},
    "jetstream": {
        "group": "g", "subject": "s.>", "max_ack_pending": 1, "ack_wait_ms": 1000,
        "credentials_file_env": "C", "token_env": "T", "tls_ca_file": "ca.pem",
    },
    "queue": {"ack_wait_ms": 30_000, "region": "eu-west-1", "tls_ca_file": "ca.pem"},
}  # fmt: skip
# Each mode's transport in that test.
_TRANSPORT = {"jetstream": "nats", "queue": "sqs"}
# Each transport's URL in that test, and the URL its credentials make of it.
_URLS = {
    "redis": ("unix:///tmp/r.sock", "unix://u:p@/tmp/r.sock"),
    "nats": ("nats://h:4222", "nats://t@h:4222"),  # a token is a user name without a password
    "sqs": ("https://sqs.example:8443", "https://sqs.example:8443"),  # AWS's chain: no credentials
}


@pytest.mark.parametrize("mode", ["stream", "list", "pubsub", "jetstream", "queue"])
def test_each_mode_takes_the_common_keys_and_its_own(mode: str, tmp_path: Path) -> None:
    (tmp_path / "s.json").write_text('{"type": "object"}')
    transport = _TRANSPORT.get(mode, "redis")
    url, completed = _URLS[transport]
    credentials = {} if transport != "redis" else {"username_env": "U", "password_env": "P"}
    raw = adapter(
        mode=mode, transport=transport, consumer="c", ack_after="store", batch_size=10_000,
        block_ms=1, key_prefix="p", format="text", max_message_bytes=1, url=url,
        max_deliveries=3, schema="s.json", schema_timeout_ms=1,
        retain_acked_days=1, retain_rejected_days=2, **credentials,
        **_MODE_KEYS[mode],
    )  # fmt: skip
    every = set().union(*(set(adapter(**keys)) for keys in _MODE_KEYS.values()))
    assert every | set(raw) | {"username_env", "password_env"} == EVERY_KEY
    env = {"U": "u", "P": "p", "T": "t"}
    a = from_mapping({"database": DB, "adapters": [raw]}, env, tmp_path).adapters[0]
    assert (a.mode, a.key_prefix, a.broker.url()) == (mode, "p", completed)
    assert a.body_schema is not None


def test_an_sqs_adapter_defaults_to_queue_its_prefix_and_aws_itself() -> None:
    raw = {"name": "orders", "transport": "sqs", "source": "orders.fifo"}
    (a,) = from_mapping({"database": DB, "adapters": [raw]}, {}).adapters
    assert (a.mode, a.key_prefix, a.broker.url(), a.options.ack_wait_ms) == ("queue", "sqs", "aws://", 60_000)
    env = {"SWITCHBOARD_SQS_ENDPOINT_URL": "http://127.0.0.1:5000"}
    (a,) = from_mapping({"database": DB, "adapters": [raw]}, env).adapters
    assert a.broker.url() == "http://127.0.0.1:5000"
    assert {"region", "url"}.isdisjoint(a.public_settings())


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        (
            {"group": "g"},
            "key 'group' does not apply to mode = 'queue' (it applies to mode 'stream' or 'jetstream')",
        ),
        (
            {"claim_idle_ms": 1},
            "key 'claim_idle_ms' does not apply to mode = 'queue' (it applies to mode 'stream')",
        ),
        ({"source": "no spaces"}, "key 'source' = 'no spaces' is no SQS queue name (or URL ending in one)"),
        ({"source": "x" * 81}, "is no SQS queue name"),
        ({"source": "ftp://h/1/q"}, "key 'source' must be a queue name or an http(s):// queue URL"),
        ({"url": "http://h:1/123/orders"}, "an SQS endpoint has no path or query"),
        ({"url": "https://AKIA:secret@h"}, "an SQS endpoint carries no credentials"),
        ({"url": "redis://h"}, "must be an https:// (or http://) SQS endpoint, or aws://"),
        (
            {"source": "https://a.example/1/orders", "url": "https://b.example"},
            "key 'source' is a queue URL on another endpoint than key 'url': name the queue once",
        ),
        ({"username_env": "U"}, "key 'username_env' does not apply to transport = 'sqs': AWS credentials"),
        ({"ack_after": "complete"}, 'key \'ack_after\' = "complete" does not apply to transport = "sqs"'),
        ({"ack_wait_ms": 43_200_001}, "key 'ack_wait_ms' must be at most 43200000"),
        (
            {"retain_acked_days": 0.001},
            "key 'retain_acked_days' (0.001 days) is shorter than the adapter can",
        ),
    ],
)
def test_sqs_config_errors_name_the_key(keys: dict[str, Any], message: str) -> None:
    raw = {"name": "orders", "transport": "sqs", "source": "orders", **keys}
    with pytest.raises(ConfigError) as info:
        from_mapping({"database": DB, "adapters": [raw]}, {})
    assert message in str(info.value)
    assert "secret" not in str(info.value)


def test_a_key_of_another_transport_sharing_the_mode_is_refused() -> None:
    with pytest.raises(ConfigError, match="key 'region' does not apply to mode = 'jetstream'"):
        from_mapping(
            {"database": DB, "adapters": [{"name": "o", "transport": "nats", "source": "O", "region": "x"}]},
            {},
        )


def test_two_adapters_on_one_sqs_queue_are_refused() -> None:
    raw = [
        {"name": "a", "transport": "sqs", "source": "orders", "url": "http://h:1"},
        {"name": "b", "transport": "sqs", "source": "orders", "url": "http://h:1", "queue": "other"},
    ]
    with pytest.raises(
        ConfigError, match="adapter 'b': key 'source': adapter 'a' already reads SQS queue 'orders'"
    ):
        from_mapping({"database": DB, "adapters": raw}, {})


def test_a_nats_adapter_defaults_to_jetstream_its_prefix_and_its_url() -> None:
    raw = {"name": "orders", "transport": "nats", "source": "ORDERS"}
    (a,) = from_mapping({"database": DB, "adapters": [raw]}, {}).adapters
    assert (a.mode, a.key_prefix, a.broker.url(), a.options.group) == (
        "jetstream",
        "nats",
        "nats://127.0.0.1:4222",
        "switchboard",
    )
    env = {"SWITCHBOARD_NATS_URL": "tls://nats.example:4443"}
    (a,) = from_mapping({"database": DB, "adapters": [raw]}, env).adapters
    assert a.broker.url() == "tls://nats.example:4443"
    assert "url" not in a.public_settings()
    assert "token_env" not in a.public_settings()


@pytest.mark.parametrize(
    ("mode", "key", "applies_to"),
    [
        ("list", "group", "'stream' or 'jetstream'"),
        ("pubsub", "claim_idle_ms", "'stream'"),
        ("stream", "reap_interval_ms", "'list'"),
        ("stream", "delivery", "'pubsub'"),
    ],
)
def test_a_key_of_another_mode_is_an_error_naming_adapter_and_key(
    mode: str, key: str, applies_to: str
) -> None:
    """DESIGN.md 6b: a key that does not apply to the adapter's transport and
    mode is a config error naming it (it used to be accepted and ignored)."""
    extra = {"delivery": "at-most-once"} if mode == "pubsub" else {}
    raw = adapter(
        mode=mode,
        **extra,
        **{key: _MODE_KEYS["stream" if key != "reap_interval_ms" else "list"].get(key, "at-most-once")},
    )
    with pytest.raises(ConfigError) as info:
        from_mapping({"database": DB, "adapters": [raw]}, {})
    assert str(info.value) == (
        f"adapter 'orders': key {key!r} does not apply to mode = {mode!r} (it applies to mode {applies_to})"
    )


def test_the_unknown_key_message_lists_every_allowed_key() -> None:
    with pytest.raises(ConfigError) as info:
        from_mapping({"database": DB, "adapters": [adapter(bogus=1)]}, {})
    allowed = ", ".join(sorted(EVERY_KEY))
    assert str(info.value) == f"adapter 'orders': unknown key 'bogus' (allowed: {allowed})"


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"adapters": [adapter(batch_size=0)]},
         "adapter 'orders': key 'batch_size': must be an integer >= 1 (got 0)"),
        ({"adapters": [adapter(batch_size=10_001)]},
         "adapter 'orders': key 'batch_size' must be at most 10000"),
        ({"adapters": [adapter(block_ms=2.5)]},
         "adapter 'orders': key 'block_ms': must be an integer >= 1 (got 2.5)"),
        ({"adapters": [adapter(mode="list", heartbeat_ttl_ms=999)]},
         "adapter 'orders': key 'heartbeat_ttl_ms': must be an integer >= 1000 (got 999)"),
        ({"adapters": [adapter(max_deliveries=2)]},
         "adapter 'orders': key 'max_deliveries': must be an integer >= 3 (got 2)"),
        ({"adapters": [adapter(group="")]},
         "adapter 'orders': key 'group': must be a non-empty string (got '')"),
        ({"adapters": [adapter(transport="kafka")]},
         "adapter 'orders': key 'transport' must be one of redis, nats, sqs, amqp, webhook (got 'kafka')"),
        ({"adapters": [adapter(transport="nats")]},
         "adapter 'orders': key 'mode' = 'stream' is not a mode of transport = 'nats'"
         " (its modes: jetstream)"),
        ({"adapters": [adapter(transport="nats", mode="jetstream", url="redis://h:6379/0")]},
         "adapter 'orders': key 'url' must be a nats:// or tls:// URL"),
        ({"adapters": [adapter(mode="stream", url="nats://h:4222")]},
         "adapter 'orders': key 'url' must be a redis://, rediss:// or unix:// URL"),
        ({"adapters": [adapter(transport="nats", mode="jetstream", claim_idle_ms=5)]},
         "adapter 'orders': key 'claim_idle_ms' does not apply to mode = 'jetstream' (it applies to mode"
         " 'stream')"),
        ({"adapters": [adapter(transport="nats", mode="jetstream", ack_after="complete")]},
         "adapter 'orders': key 'ack_after' = \"complete\" does not apply to mode = \"jetstream\": JetStream"
         " delivers a message again once it is unacked for ack_wait_ms, so an ack held for its todo's"
         " whole run would bring it back every ack_wait_ms; use ack_after = \"store\""),
        ({"adapters": [adapter(transport="nats", mode="jetstream", source="orders.new")]},
         "adapter 'orders': key 'source' = 'orders.new' is no JetStream stream or consumer name: no '.',"
         " '*', '>', '/', '\\' or whitespace (a subject goes in 'subject')"),
        ({"adapters": [adapter(transport="nats", mode="jetstream", group="a b")]},
         "adapter 'orders': key 'group' = 'a b' is no JetStream stream or consumer name: no '.',"
         " '*', '>', '/', '\\' or whitespace (a subject goes in 'subject')"),
        ({"adapters": [adapter(transport="nats", mode="jetstream", token_env="T", password_env="P")]},
         "adapter 'orders': key 'token_env' excludes 'username_env' and 'password_env': use one way"),
        ({"ingest": {"shutdown_timeout_s": 0}},
         "[ingest]: key 'shutdown_timeout_s': must be a positive number (got 0)"),
        ({"ingest": {"enabled_refresh_ms": 2.5}},
         "[ingest]: key 'enabled_refresh_ms': must be a positive integer (got 2.5)"),
        ({"acker": {"shutdown_timeout_s": True}},
         "[acker]: key 'shutdown_timeout_s': must be a positive number (got True)"),
        ({"database": {**DB, "pool_size": 2.5}},
         "[database]: key 'pool_size': must be an integer >= 1 (got 2.5)"),
    ],
)  # fmt: skip
def test_messages_are_word_for_word(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        from_mapping({"database": DB, **raw}, {})
    assert str(info.value) == message


@dataclass(frozen=True)
class Numbers:
    grace_s: Annotated[int, Key(minimum=None, doc="named like seconds, declared whole")] = 1
    ratio: Annotated[float, Key(minimum=None, doc="named like a count, declared fractional")] = 0.5


def test_whether_a_number_may_be_fractional_comes_from_its_type() -> None:
    numbers = Section("[ingest]", Numbers)
    assert Numbers(**numbers.read("[ingest]", {"ratio": 2.5})) == Numbers(ratio=2.5)
    with pytest.raises(ConfigError) as info:
        numbers.read("[ingest]", {"grace_s": 2.5})
    assert str(info.value) == "[ingest]: key 'grace_s': must be a positive integer (got 2.5)"
    acker = from_mapping({"database": DB, "acker": {"shutdown_timeout_s": 2.5}}, {}).acker
    assert acker.shutdown_timeout_s == 2.5


ENCODE = (
    "a reserved character in the password must be percent-encoded"
    " (@ as %40, / as %2F, ? as %3F, # as %23, % as %25, a space as %20)"
)


@pytest.mark.parametrize(
    ("raw", "env", "message"),
    [
        ({"database": {"url": "postgresql://u:S3cr@tPart2@host/db"}}, {},
         f"[database]: key 'url' is not a valid URL: {ENCODE}"),
        ({"database": DB}, {"SWITCHBOARD_DATABASE_URL": "postgresql://u:S3cr@tPart2@host/db"},
         f"SWITCHBOARD_DATABASE_URL is not a valid URL: {ENCODE}"),
        ({"database": {"url": "postgresql://u:se cret@host/db"}}, {},
         f"[database]: key 'url' is not a valid URL: contains whitespace; {ENCODE}"),
        ({"database": {"url": "mysql://u:pw@host/db"}}, {},
         "[database]: key 'url' must be a PostgreSQL URL (postgresql://USER:PASSWORD@HOST:PORT/DATABASE),"
         " not mysql://"),
        ({"database": {"url": "postgresql+asyncpg://u:pw@host/db"}}, {},
         "[database]: key 'url' must use the psycopg 3 driver (postgresql:// or postgresql+psycopg://),"
         " not postgresql+asyncpg://"),
        ({"database": {"url": "postgresql://u:pw@host:port/db"}}, {},
         "[database]: key 'url' is not a database URL (ValueError): the form is"
         f" postgresql://USER:PASSWORD@HOST:PORT/DATABASE, and {ENCODE}"),
        ({"database": DB}, {"SWITCHBOARD_REDIS_URL": "redis://default:pa/ss@cache:6379/0"},
         f"SWITCHBOARD_REDIS_URL is not a valid URL: has a port that is not a number, or {ENCODE}"),
        ({"database": DB}, {"SWITCHBOARD_REDIS_URL": "redis://default:12/ss@cache:6379/0"},
         f"SWITCHBOARD_REDIS_URL is not a valid URL: {ENCODE}"),
        ({"database": DB}, {"SWITCHBOARD_REDIS_URL": "redis://default:p?ss@cache:6379/0"},
         f"SWITCHBOARD_REDIS_URL is not a valid URL: has a port that is not a number, or {ENCODE}"),
        ({"database": DB}, {"SWITCHBOARD_REDIS_URL": "redis://default:12?ss@cache:6379/0"},
         f"SWITCHBOARD_REDIS_URL is not a valid URL: {ENCODE}"),
        # A numeric first half of the password followed by '?' reads as a port
        # (review of issue 13): the '@' in the query gives it away.
        ({"database": DB}, {"SWITCHBOARD_REDIS_URL": "redis://ru:4711?db=MyS3cret@127.0.0.1:6379/0"},
         f"SWITCHBOARD_REDIS_URL is not a valid URL: {ENCODE}"),
        ({"database": DB}, {"SWITCHBOARD_REDIS_URL": "redis://cache:6379/0?foo=bar"},
         "SWITCHBOARD_REDIS_URL is not a valid URL: has a query parameter redis-py does not take"
         " (allowed: client_name, db, health_check_interval, max_connections, protocol,"
         " retry_on_timeout, socket_connect_timeout, socket_keepalive, socket_read_size,"
         " socket_timeout, timeout)"),
        ({"database": DB}, {"SWITCHBOARD_REDIS_URL": "redis://cache:6379/0?socket_timeout=abc"},
         "SWITCHBOARD_REDIS_URL is not a valid URL: has a query parameter whose value redis-py"
         " cannot read (a number or a boolean)"),
        ({"database": DB}, {"SWITCHBOARD_REDIS_URL": "http://cache:6379"},
         "SWITCHBOARD_REDIS_URL must be a redis://, rediss:// or unix:// URL"),
        ({"database": DB, "redis": {"url": "redis://a:b@c@cache/0"}}, {},
         f"[redis]: key 'url' is not a valid URL: {ENCODE}"),
        ({"database": DB, "adapters": [adapter(url="redis://a:b#c@cache/0")]}, {},
         f"adapter 'orders': key 'url' is not a valid URL: has a port that is not a number, or {ENCODE}"),
    ],
)  # fmt: skip
def test_urls_are_checked_at_load_and_never_echoed(
    raw: dict[str, Any], env: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError) as info:
        from_mapping(raw, env)
    assert str(info.value) == message


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://u:pa%40ss%2F@host/db",  # encoded: fine
        "postgresql://u:pa/ss@host/db",  # SQLAlchemy reads a "/" in the password as meant
        "postgresql:///db?host=/run/postgresql&user=me@corp",  # "@" in a query value
        "postgres://u@host:5433/db",
    ],
)
def test_database_urls_that_parse_as_meant_are_accepted(url: str) -> None:
    assert from_mapping({"database": {"url": url}}, {}).database.url.startswith("postgresql+psycopg://")


def test_redis_urls_that_parse_as_meant_are_accepted() -> None:
    for url in (
        "redis://default:pa%2Fss@cache:6379/0",
        "rediss://cache/1",
        "rediss://cache:6380/0?ssl_ca_certs=/etc/switchboard/ca.pem&ssl_cert_reqs=required",
        "unix:///run/redis.sock?db=0",
        "redis://cache:6379/0?socket_timeout=2.5&health_check_interval=10",
    ):
        assert from_mapping({"database": DB, "redis": {"url": url}}, {}).adapters == ()
        assert (
            from_mapping({"database": DB, "adapters": [adapter(url=url)]}, {}).adapters[0].broker.url() == url
        )


def test_where_the_database_url_came_from_is_kept_for_messages() -> None:
    assert from_mapping({"database": DB}, {}).database_url_origin == "[database] url"
    env = {"SWITCHBOARD_DATABASE_URL": "postgresql://x@db/y"}
    assert from_mapping({"database": DB}, env).database_url_origin == "SWITCHBOARD_DATABASE_URL"


def test_queues_are_read_with_their_defaults_and_checked() -> None:
    s = from_mapping(
        {
            "database": DB,
            "redis": {"url": "redis://r:1/0"},
            "queues": {"orders": {"handler": "myapp.handlers:handle_order", "max_attempts": 7}},
        },
        {},
    )
    q = s.queues["orders"]
    assert (q.handler, q.max_attempts, q.time_limit_ms, q.min_backoff_ms, q.max_backoff_ms, q.actor_name) == (
        "myapp.handlers:handle_order", 7, 600_000, 1_000, 60_000, "switchboard:orders",
    )  # fmt: skip


@pytest.mark.parametrize(
    ("queue", "needle"),
    [
        ({}, "[queues.orders]: key 'handler' is required"),
        ({"handler": "no_colon"}, "[queues.orders]: key 'handler' must be 'module:function'"),
        ({"handler": "m:f", "max_attempts": 0}, "[queues.orders]: key 'max_attempts'"),
        ({"handler": "m:f", "retries": 3}, "[queues.orders]: unknown key 'retries'"),
        ({"handler": "m:f", "min_backoff_ms": 5000, "max_backoff_ms": 10}, "must not exceed max_backoff_ms"),
    ],
)
def test_bad_queues_are_config_errors_naming_queue_and_key(queue: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        from_mapping({"database": DB, "queues": {"orders": queue}}, {})
    assert needle in str(info.value)


def test_a_config_path_that_is_no_readable_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load(tmp_path, {})
    assert (
        str(info.value) == f"config file {str(tmp_path)!r} is a directory: give --config the TOML file itself"
    )
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"\xff\xfe[database]\n")
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        load(binary, {})


def test_two_adapters_on_one_stream_and_group_are_refused() -> None:
    """They would split the stream at random and, after a crash, both take
    some entries: one message, work in two queues (issue 11.3)."""
    twice = [adapter(), adapter(name="audit", queue="audit", url="redis://other-user:pw@localhost:6379/0")]
    with pytest.raises(ConfigError) as info:
        from_mapping({"database": DB, "adapters": twice}, {})
    assert str(info.value) == (
        "adapter 'audit': key 'group': adapter 'orders' already reads stream 'orders' with group"
        " 'switchboard' on the same broker; fan-out needs a distinct group"
    )


def test_two_adapters_on_one_list_are_refused() -> None:
    twice = [adapter(mode="list", source="jobs"), adapter(name="jobs2", mode="list", source="jobs")]
    with pytest.raises(ConfigError) as info:
        from_mapping({"database": DB, "adapters": twice}, {})
    assert str(info.value) == (
        "adapter 'jobs2': key 'source': adapter 'orders' already reads list 'jobs' on the same broker;"
        " one adapter per list; run more ingesters for more consumers"
    )


def test_fan_out_is_distinct_groups_brokers_or_databases() -> None:
    allowed = [
        [adapter(), adapter(name="audit", queue="audit", group="audit")],  # fan-out
        # Another database, another server: keys of their own (issue 43).
        [adapter(), adapter(name="b", url="redis://localhost:6379/1", key_prefix="redis-db1")],
        [adapter(), adapter(name="b", url="redis://cache-2:6379/0", key_prefix="cache-2")],
        [adapter(mode="pubsub", delivery="at-most-once"),
         adapter(name="b", mode="pubsub", delivery="at-most-once")],  # pub/sub broadcasts
    ]  # fmt: skip
    for adapters in allowed:
        assert len(from_mapping({"database": DB, "adapters": adapters}, {}).adapters) == 2


# --- key namespaces apart (issue 43) --------------------------------------------

SQS_URL = "https://sqs.eu-west-1.amazonaws.com/123456789012/orders"
HOOK = {"transport": "webhook", "secrets_env": ["WHSEC"]}


@pytest.mark.parametrize(
    ("first", "second", "space"),
    [
        # One stream name on two Redis servers, or in two databases.
        (adapter(), adapter(name="b", url="redis://cache-2:6379/0"), "redis:orders:"),
        (adapter(), adapter(name="b", url="redis://localhost:6379/1", queue="other"), "redis:orders:"),
        # A list and a channel of one name: other messages, the same body digests.
        (
            adapter(mode="list"),
            adapter(name="b", mode="pubsub", delivery="at-most-once"),
            "redis:orders:",
        ),
        # One JetStream stream name on two NATS servers.
        (
            {"name": "a", "transport": "nats", "source": "ORDERS"},
            {"name": "b", "transport": "nats", "source": "ORDERS", "url": "nats://nats-2:4222"},
            "nats:ORDERS:",
        ),
        # One SQS queue by its URL and by its name: one namespace, sqs:{queue name}.
        (
            {"name": "a", "transport": "sqs", "source": SQS_URL},
            {"name": "b", "transport": "sqs", "source": "orders", "region": "eu-west-1"},
            "sqs:orders:",
        ),
        # Queues of one name in two regions.
        (
            {"name": "a", "transport": "sqs", "source": "orders", "region": "eu-west-1"},
            {"name": "b", "transport": "sqs", "source": "orders", "region": "us-east-1"},
            "sqs:orders:",
        ),
        # One AMQP queue name on two brokers, or in two vhosts.
        (
            {"name": "a", "transport": "amqp", "source": "orders"},
            {"name": "b", "transport": "amqp", "source": "orders", "url": "amqp://h/other"},
            "amqp:orders:",
        ),
        # Two transports told to share a prefix.
        (
            adapter(key_prefix="shop"),
            {"name": "b", "transport": "nats", "source": "orders", "key_prefix": "shop"},
            "shop:orders:",
        ),
        # Two webhook senders on one source; a webhook on a stream's keys.
        (
            {"name": "a", "source": "billing", **HOOK},
            {"name": "b", "source": "billing", **HOOK},
            "webhook:billing:",
        ),
        (adapter(), {"name": "b", "source": "orders", "key_prefix": "redis", **HOOK}, "redis:orders:"),
        # The same keys from another split of prefix and source.
        (adapter(key_prefix="a:b", source="c"), adapter(name="b", key_prefix="a", source="b:c"), "a:b:c:"),
    ],
)
def test_adapters_whose_keys_overlap_are_refused(
    first: dict[str, Any], second: dict[str, Any], space: str
) -> None:
    with pytest.raises(ConfigError) as info:
        from_mapping({"database": DB, "adapters": [first, second]}, {})
    message = str(info.value)
    assert message.startswith(
        f"adapter 'b': keys 'key_prefix' and 'source' make the keys of adapter {first['name']!r} ({space}...)"
    ), message
    assert "give one of them a distinct key_prefix" in message


def test_adapters_reading_the_same_messages_may_share_keys() -> None:
    allowed = [
        # A stream's groups, a JetStream stream's consumers, a channel's
        # subscribers: the same key is the same message.
        [adapter(), adapter(name="b", group="audit", queue="audit")],
        [adapter(), adapter(name="b", group="audit")],  # to one queue: one todo per message
        [{"name": "a", "transport": "nats", "source": "ORDERS"},
         {"name": "b", "transport": "nats", "source": "ORDERS", "group": "audit", "subject": "orders.eu"}],
        # A push and a pull adapter of one source under their own prefixes
        # (ops/compose.switchboard.toml): the same todo shape, keys apart.
        [adapter(), {"name": "orders-webhook", "source": "orders", "queue": "orders", **HOOK}],
        # Distinct prefixes, or distinct sources.
        [adapter(), adapter(name="b", url="redis://cache-2:6379/0", key_prefix="cache-2")],
        [{"name": "a", "source": "billing", **HOOK}, {"name": "b", "source": "billing-eu", **HOOK}],
    ]  # fmt: skip
    for adapters in allowed:
        settings = from_mapping({"database": DB, "adapters": adapters}, {})
        assert len(settings.adapters) + len(settings.webhooks) == 2


@pytest.mark.parametrize(
    ("outer", "inner"),
    [
        # An AMQP queue's ids are its producers': "orders" holds "orders:eu".
        (
            {"name": "a", "transport": "amqp", "source": "orders"},
            {"name": "b", "transport": "amqp", "source": "orders:eu"},
        ),
        # A webhook's delivery ids are its sender's.
        ({"name": "a", "source": "billing", **HOOK}, {"name": "b", "source": "billing:eu", **HOOK}),
    ],
)
def test_a_key_space_inside_one_whose_ids_producers_choose_is_refused(
    outer: dict[str, Any], inner: dict[str, Any]
) -> None:
    """A review's finding: the outer's message "eu" sent again with another
    body is keyed {outer}eu:<digest>, which the inner's message <digest> spells."""
    for adapters in ([outer, inner], [inner, outer]):
        with pytest.raises(ConfigError, match="lie inside those of adapter 'a'"):
            from_mapping({"database": DB, "adapters": adapters}, {})


def test_nested_key_spaces_of_a_brokers_own_ids_are_fine() -> None:
    """Stream entry ids cannot be "eu": streams "orders" and "orders:eu" are apart."""
    settings = from_mapping(
        {"database": DB, "adapters": [adapter(), adapter(name="b", source="orders:eu")]}, {}
    )
    assert len(settings.adapters) == 2


# --- retention (issue 14) -------------------------------------------------------


def test_retention_keys_are_read_fractions_allowed_and_unset_means_kept() -> None:
    s = from_mapping(
        {
            "database": DB,
            "adapters": [
                adapter(retain_acked_days=0.5, retain_rejected_days=30),
                adapter(name="b", source="b"),
            ],
            "queues": {"orders": {"handler": "m:f", "retain_done_days": 7, "retain_failed_days": 1.5}},
            "acker": {"prune_interval_ms": 0, "prune_batch_size": 5000, "prune_pause_ms": 0},
        },
        {},
    )
    assert (s.adapters[0].retain_acked_days, s.adapters[0].retain_rejected_days) == (0.5, 30.0)
    assert (s.adapters[1].retain_acked_days, s.adapters[1].retain_rejected_days) == (None, None)
    assert (s.queues["orders"].retain_done_days, s.queues["orders"].retain_failed_days) == (7.0, 1.5)
    assert (s.acker.prune_interval_ms, s.acker.prune_batch_size, s.acker.prune_pause_ms) == (0, 5000, 0)
    assert s.adapters[0].public_settings()["retain_acked_days"] == 0.5
    assert "retain_acked_days" not in s.adapters[1].public_settings()


@pytest.mark.parametrize(
    ("raw", "needles"),
    [
        # Streams: 2 x (claim_idle_ms + claim_interval_ms), here 2 x 2 h.
        (
            adapter(claim_idle_ms=7_000_000, claim_interval_ms=200_000, retain_acked_days=0.1),
            ["adapter 'orders'", "'retain_acked_days'", "claim_idle_ms + claim_interval_ms", "7200000 ms"],
        ),
        (
            adapter(claim_idle_ms=7_000_000, claim_interval_ms=200_000, retain_rejected_days=0.1),
            ["adapter 'orders'", "'retain_rejected_days'", "7200000 ms"],
        ),
        # Lists: heartbeat_ttl_ms + reap_interval_ms.
        (
            adapter(mode="list", heartbeat_ttl_ms=86_400_000, reap_interval_ms=5_000, retain_acked_days=1),
            ["adapter 'orders'", "'retain_acked_days'", "heartbeat_ttl_ms + reap_interval_ms"],
        ),
        # Under the floor of an hour, whatever the horizon.
        (adapter(retain_acked_days=0.02), ["adapter 'orders'", "'retain_acked_days'", "60 minutes"]),
        (adapter(retain_acked_days=0), ["adapter 'orders'", "'retain_acked_days'", "number of days"]),
        (adapter(retain_acked_days="7"), ["adapter 'orders'", "'retain_acked_days'"]),
        (adapter(retain_acked_days=True), ["adapter 'orders'", "'retain_acked_days'"]),
    ],
)
def test_a_retention_shorter_than_redelivery_is_refused(raw: dict[str, Any], needles: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        from_mapping({"database": DB, "adapters": [raw]}, {})
    for needle in needles:
        assert needle in str(info.value)


def test_a_retention_that_covers_redelivery_is_accepted() -> None:
    # 2 x 2 h is 1/6 day: 0.17 days passes, the list's horizon is 35 s.
    cfg = adapter(claim_idle_ms=7_000_000, claim_interval_ms=200_000, retain_acked_days=0.17)
    listed = adapter(name="l", source="l", mode="list", retain_acked_days=0.05, retain_rejected_days=0.05)
    s = from_mapping({"database": DB, "adapters": [cfg, listed]}, {})
    assert [a.retain_acked_days for a in s.adapters] == [0.17, 0.05]


@pytest.mark.parametrize(
    ("raw", "needles"),
    [
        ({"acker": {"prune_batch_size": 0}}, ["[acker]", "'prune_batch_size'"]),
        ({"acker": {"prune_batch_size": 100_000}}, ["[acker]", "'prune_batch_size'", "at most"]),
        ({"acker": {"prune_interval_ms": -1}}, ["[acker]", "'prune_interval_ms'"]),
        ({"queues": {"q": {"handler": "m:f", "retain_done_days": -1}}}, ["[queues.q]", "'retain_done_days'"]),
    ],
)
def test_bad_prune_settings_are_refused(raw: dict[str, Any], needles: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        from_mapping({"database": DB, **raw}, {})
    for needle in needles:
        assert needle in str(info.value)


# Broker credentials from the environment (issue 15): the variables named
# replace the URL's user and password; the TOML never holds the secret.
SECRET_PW = "s3cr@t/pw?#% x"  # every character a URL reserves


def test_an_adapters_broker_credentials_come_from_the_environment() -> None:
    raw = adapter(url="redis://cache:6379/0", username_env="ORDERS_USER", password_env="ORDERS_PW")
    env = {"ORDERS_USER": "switchboard-ingester", "ORDERS_PW": SECRET_PW}
    a = from_mapping({"database": DB, "adapters": [raw]}, env).adapters[0]
    assert a.broker.url() == "redis://switchboard-ingester:s3cr%40t%2Fpw%3F%23%25%20x@cache:6379/0"
    parsed = parse_url(a.broker.url())  # what redis-py connects with
    assert (parsed["username"], parsed["password"], parsed["host"], parsed["db"]) == (
        "switchboard-ingester", SECRET_PW, "cache", 0,
    )  # fmt: skip
    public = a.public_settings()
    assert not {"username_env", "password_env"} & set(public)
    assert SECRET_PW not in json.dumps(public)
    assert "switchboard-ingester" not in json.dumps(public)


def test_a_password_from_the_environment_keeps_the_urls_user_or_the_default_url() -> None:
    env = {"PW": "p", "SWITCHBOARD_REDIS_URL": "redis://cache/0"}
    with_user = adapter(url="redis://deploy@cache:6379/0", password_env="PW")
    inherited = {**adapter(password_env="PW"), "name": "jobs", "mode": "list", "source": "jobs"}
    a, b = from_mapping({"database": DB, "adapters": [with_user, inherited]}, env).adapters
    assert a.broker.url() == "redis://deploy:p@cache:6379/0"
    assert b.broker.url() == "redis://:p@cache/0"  # the default user's password
    assert parse_url(b.broker.url())["password"] == "p"


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"adapters": [adapter(password_env="not a name")]},
         "adapter 'orders': key 'password_env' must name an environment variable: letters, digits and _"
         " (got 'not a name')"),
        ({"adapters": [adapter(username_env=5)]},
         "adapter 'orders': key 'username_env' must name an environment variable: letters, digits and _"
         " (got 5)"),
    ],
)  # fmt: skip
def test_a_bad_credential_key_is_refused_at_load(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        from_mapping({"database": DB, **raw}, {"OTHER": SECRET_PW})
    assert str(info.value) == message


@pytest.mark.parametrize(
    ("raw", "env", "message"),
    [
        ([adapter(password_env="ORDERS_PW")], {},
         "adapter 'orders': key 'password_env': the environment variable 'ORDERS_PW' is not set or empty"),
        ([adapter(username_env="ORDERS_USER")], {"ORDERS_USER": ""},
         "adapter 'orders': key 'username_env': the environment variable 'ORDERS_USER' is not set or empty"),
    ],
)  # fmt: skip
def test_an_unset_credential_variable_is_an_error_where_the_broker_is_needed(
    raw: list[dict[str, Any]], env: dict[str, str], message: str
) -> None:
    """Loaded by every verb, needed by those that connect to the broker
    (ingest, ack, status): `migrate`, `worker` and the rest run without the
    ingester's and acker's variables, which live in their own env files."""
    settings = from_mapping({"database": DB, "adapters": raw}, {**env, "OTHER": SECRET_PW})
    with pytest.raises(ConfigError) as info:
        make_acknowledger(settings.adapters[0])
    assert str(info.value) == message
    assert SECRET_PW not in str(info.value)


def test_a_broker_url_lacking_its_credentials_is_no_string_in_the_settings() -> None:
    """Errors are errors, not strings in a valid object: a broker's URL is
    reached only through ``BrokerUrl.url()``, which raises the error built at
    load when a variable is unset; the settings hold no URL of an adapter or
    as a string, and their repr shows neither URL nor secret."""
    raw = {
        "database": DB,
        "adapters": [
            adapter(url="redis://deploy:file-pw@cache:6379/0", password_env="ORDERS_PW"),
            adapter(name="b", source="b", queue="b", url="redis://cache:6379/2", password_env="B_PW"),
        ],
    }
    s = from_mapping(raw, {"B_PW": SECRET_PW})
    missing, complete = s.adapters
    for value in (missing, complete, s):
        held = [getattr(value, f.name) for f in dataclasses.fields(value)]
        assert not [v for v in held if isinstance(v, str) and "cache" in v]
    printed = repr(s)
    assert [word for word in ("cache", "file-pw", SECRET_PW) if word in printed] == []
    message = "adapter 'orders': key 'password_env': the environment variable 'ORDERS_PW' is not set or empty"
    assert repr(missing.broker) == f"BrokerUrl(missing: {message})"
    for _ in range(2):  # the error built at load, each time the URL is asked for
        with pytest.raises(ConfigError) as info:
            missing.broker.url()
        assert str(info.value) == message
    assert missing.broker.identity() == ("cache", "6379", "0")  # which broker needs no credentials
    assert complete.broker.url() == f"redis://:{quote(SECRET_PW, safe='')}@cache:6379/2"
    assert repr(complete.broker) == "BrokerUrl(complete)"
    assert from_mapping(raw, {"B_PW": SECRET_PW}) == s  # equal when loaded alike
    assert from_mapping(raw, {"B_PW": SECRET_PW, "ORDERS_PW": "x"}) != s


# --- every table read the same way, from its definitions (issue 23) -----------


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"database": {**DB, "bogus": 1}},
         "[database]: unknown key 'bogus' (allowed: lock_timeout_ms, pool_size, statement_timeout_ms,"
         " tcp_user_timeout_ms, transaction_deadline_ms, url)"),
        ({"redis": {"bogus": 1}}, "[redis]: unknown key 'bogus' (allowed: cluster, url)"),
        ({"ingest": {"bogus": 1}},
         "[ingest]: unknown key 'bogus' (allowed: backoff_initial_ms, backoff_max_ms, commits_in_flight,"
         " enabled_refresh_ms, max_batch_bytes, max_inflight_bytes, shutdown_timeout_s)"),
        ({"acker": {"bogus": 1}},
         "[acker]: unknown key 'bogus' (allowed: backoff_initial_ms, backoff_max_ms, batch_size,"
         " partition_hours, poll_interval_ms, prune_batch_size, prune_interval_ms, prune_pause_ms,"
         " rescue_interval_ms, retain_history_days, shutdown_timeout_s)"),
        ({"queues": {"q": {"handler": "m:f", "bogus": 1}}},
         "[queues.q]: unknown key 'bogus' (allowed: handler, max_attempts, max_backoff_ms, min_backoff_ms,"
         " retain_done_days, retain_failed_days, time_limit_ms)"),
        ({"worker": {"bogus": 1}}, "[worker]: unknown key 'bogus' (allowed: lease_ms, poll_interval_ms)"),
        ({"metrics": {"bogus": 1}},
         "[metrics]: unknown key 'bogus' (allowed: address, port, refresh_interval_ms)"),
        ({"database": {}}, "[database]: key 'url' is required (or set SWITCHBOARD_DATABASE_URL)"),
        ({"database": {"url": ""}}, "[database]: key 'url' is required (or set SWITCHBOARD_DATABASE_URL)"),
        ({"database": {**DB, "pool_size": 0}},
         "[database]: key 'pool_size': must be an integer >= 1 (got 0)"),
        ({"acker": {"prune_batch_size": 50_001}},
         "[acker]: key 'prune_batch_size' must be at most 50000 (got 50001)"),
        ({"acker": {"prune_interval_ms": -1}},
         "[acker]: key 'prune_interval_ms': must be a positive integer (got -1)"),
        ({"acker": {"prune_pause_ms": False}},
         "[acker]: key 'prune_pause_ms': must be a positive integer (got False)"),
        ({"queues": {"q": {}}},
         "[queues.q]: key 'handler' is required ('module:function' that does the todos)"),
        ({"queues": {"q": {"handler": "m:f", "retain_done_days": 0}}},
         "[queues.q]: key 'retain_done_days' must be a number of days, > 0 and <= 36500 (got 0)"),
        ({"worker": {"lease_ms": 2999}}, "[worker]: key 'lease_ms': must be an integer >= 3000 (got 2999)"),
        ({"worker": {"poll_interval_ms": 1001}}, "[worker]: key 'poll_interval_ms' must be at most 1000"),
        ({"worker": {"poll_interval_ms": 0}},
         "[worker]: key 'poll_interval_ms': must be an integer >= 1 (got 0)"),
        ({"worker": 5}, "[worker]: must be a table"),
        ({"dramatiq": 5}, "[dramatiq]: must be a table"),
        ({"queues": []}, "[queues]: must be a table"),
        ({"queues": {"q": 1}}, "[queues.q]: must be a table"),
        ({"adapters": {}}, "[[adapters]]: must be an array of tables"),
    ],
)  # fmt: skip
def test_each_table_is_checked_from_its_definitions_word_for_word(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        from_mapping({"database": DB, **raw}, {})
    assert str(info.value) == message


def test_a_zero_that_means_off_is_kept_and_the_metrics_port_variable_is_checked_after_the_file() -> None:
    s = from_mapping({"database": DB, "acker": {"prune_interval_ms": 0, "prune_pause_ms": 0}}, {})
    assert (s.acker.prune_interval_ms, s.acker.prune_pause_ms) == (0, 0)
    with pytest.raises(ConfigError) as info:  # the file's port is checked, though the variable overrides it
        from_mapping({"database": DB, "metrics": {"port": -1}}, {"SWITCHBOARD_METRICS_PORT": "9000"})
    assert str(info.value) == "[metrics]: key 'port' must be 0..65535 (got -1)"
    # The database and broker variables take their key's place: the file's is not read.
    env = {"SWITCHBOARD_DATABASE_URL": "postgresql://x@db/y", "SWITCHBOARD_REDIS_URL": "redis://r/0"}
    s = from_mapping({"database": {"url": "mysql://x"}, "redis": {"url": "http://x"}}, env)
    assert (s.database.url, s.default_broker_url) == ("postgresql+psycopg://x@db/y", "redis://r/0")


@dataclass(frozen=True)
class Unkeyed:
    keyed: Annotated[int, Key(doc="a key")] = 1
    forgotten: int = 2


def test_a_setting_without_a_definition_is_refused_when_its_table_is_first_read() -> None:
    with pytest.raises(TypeError, match=r"Unkeyed\.forgotten: a setting needs a Key"):
        _ = Section("[unkeyed]", Unkeyed).settings
    with pytest.raises(TypeError, match="must name each field once"):
        _ = Section("[unkeyed]", Unkeyed, keys={"keyed": Key(doc="a key")}).settings
    assert [s.name for s in Section("[u]", Unkeyed, keys={"keyed": Key(), "forgotten": None}).settings] == [
        "keyed"
    ]


def test_a_key_of_another_mode_is_said_before_the_shared_keys_errors() -> None:
    """A misplaced key is reported first, as when every key was one table's:
    the transport's own keys are read after the shared ones, but where a key
    applies is known as soon as the mode and the transport are."""
    raw = adapter(mode="list", start_id="0", batch_size="many")
    with pytest.raises(ConfigError, match="key 'start_id' does not apply to mode = 'list'"):
        from_mapping({"database": DB, "adapters": [raw]}, {})
    # A mode the transport lacks is said before any key's place.
    raw = adapter(transport="nats", mode="stream", subject="x")
    with pytest.raises(ConfigError, match="key 'mode' = 'stream' is not a mode of transport = 'nats'"):
        from_mapping({"database": DB, "adapters": [raw]}, {})
