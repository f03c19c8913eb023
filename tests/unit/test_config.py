"""Config loading: errors name the adapter and the key; env overrides apply."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ingest.config import from_mapping, load
from ingest.errors import ConfigError

DB = {"url": "postgresql://sb@localhost/sb"}


def adapter(**kw: Any) -> dict[str, Any]:
    return {"name": "orders", "mode": "stream", "source": "orders", "queue": "orders", **kw}


def test_minimal_config_from_the_design() -> None:
    s = from_mapping({"database": DB, "adapters": [adapter(group="switchboard", batch_size=500)]}, {})
    a = s.adapters[0]
    assert (a.name, a.mode, a.source, a.group, a.queue, a.ack_after, a.batch_size) == (
        "orders", "stream", "orders", "switchboard", "orders", "store", 500,
    )  # fmt: skip
    assert a.key_prefix == "redis"
    assert a.start_id == "0"
    assert s.database.url.startswith("postgresql+psycopg://")


def test_environment_overrides_database_and_default_redis() -> None:
    env = {"SWITCHBOARD_DATABASE_URL": "postgresql://x@db/y", "SWITCHBOARD_REDIS_URL": "redis://r:1/2"}
    s = from_mapping({"database": DB, "adapters": [adapter()]}, env)
    assert s.database.url == "postgresql+psycopg://x@db/y"
    assert s.adapters[0].redis_url == "redis://r:1/2"


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
    assert s.metrics_port == 9464


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
    assert s.adapters[0].heartbeat_ttl_ms == 5000


def test_the_shipped_example_config_loads() -> None:
    s = load(Path(__file__).parents[2] / "ops" / "switchboard.example.toml", {})
    assert [(a.name, a.mode) for a in s.adapters] == [
        ("orders", "stream"),
        ("jobs", "list"),
        ("notifications", "pubsub"),
    ]
