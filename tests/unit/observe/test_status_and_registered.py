"""``status``'s text form and verdict, and adapters rebuilt from their
``adapters`` row (what ``ack`` and ``status`` use without a config file)."""

from __future__ import annotations

import dataclasses
from datetime import timedelta

import pytest

from backhalf.reads import audit
from backhalf.writes.normalize import BodyFormat
from backhalf.writes.registry import AdapterRow
from ingest.adapters import registered
from ingest.adapters.redis.settings import DEFAULT_URL as DEFAULT_REDIS_URL
from ingest.config import from_mapping
from ingest.errors import ConfigError
from ingest.exit_codes import EXIT_OK, EXIT_UNHEALTHY
from ingest.observe import status


def entry(name: str, **kw: object) -> dict[str, object]:
    base: dict[str, object] = {
        "adapter": name, "mode": "stream", "source": name, "defined_in": "config", "healthy": True,
        "registered": True, "enabled": True, "stream_length": 3, "lag": None, "broker_pending": 0,
        "pending_acks": 0, "oldest_unacked_age_s": None, "stored": 1, "rejected": 0, "acked": 1,
        "todos": {"pending": 2},
    }  # fmt: skip
    return {**base, **kw}


def test_the_text_form_shows_no_python_values() -> None:
    report = [
        entry("orders", oldest_unacked_age_s=1.5),
        entry(
            "jobs",
            mode="list",
            healthy=None,
            enabled=False,
            todos={},
            consumers={"host-1": {"processing_length": 0, "heartbeat_ttl_ms": None}},
        ),
        entry("events", mode="pubsub", healthy=False, registered=False, enabled=None, broker_error="refused"),
    ]
    text = status.render(report, as_json=False)
    for raw in ("True", "False", "None", "{", "}"):
        assert raw not in text
    assert "orders (stream orders): ok" in text
    assert "jobs (list jobs): disabled" in text
    assert "events (pubsub events): UNHEALTHY" in text
    assert "1.5 s" in text
    assert "host-1 (processing_length 0, heartbeat_ttl_ms -)" in text
    assert text.endswith("unhealthy: events")
    assert status.exit_code(report) == EXIT_UNHEALTHY
    assert status.exit_code(report[:2]) == EXIT_OK
    assert "no adapters" in status.render([], as_json=False)


def row(mode: str, settings: dict[str, object], family: str = "queue") -> AdapterRow:
    return AdapterRow(name="a", family=family, transport="redis", mode=mode, enabled=True, settings=settings)


@pytest.mark.parametrize(
    "table",
    [
        {"name": "a", "source": "s", "batch_size": 7, "format": "text", "group": "g", "queue": "q"},
        {"name": "a", "mode": "list", "source": "s", "heartbeat_ttl_ms": 5000},
        {"name": "a", "mode": "pubsub", "source": "ch", "delivery": "at-most-once"},
    ],
)
def test_a_registered_adapter_is_rebuilt_from_its_public_settings(table: dict[str, object]) -> None:
    cfg = from_mapping({"database": {"url": "postgresql://db/x"}, "adapters": [table]}, {}).adapters[0]
    rebuilt = registered.adapter_config(row(cfg.mode, cfg.public_settings()), "redis://elsewhere:6379/1")
    assert rebuilt.broker.url() == "redis://elsewhere:6379/1"
    for attr in (
        "name",
        "mode",
        "source",
        "queue",
        "group",
        "batch_size",
        "format",
        "delivery",
        "key_prefix",
    ):
        if attr in cfg.public_settings() or attr in ("name", "mode", "source", "queue"):
            assert rebuilt.values()[attr] == cfg.values()[attr], attr
    assert isinstance(rebuilt.format, BodyFormat)


@pytest.mark.parametrize(
    ("bad", "needle"),
    [
        (row("stream", {"group": "g"}), "'source'"),
        (row("stream", {"source": "s", "batch_size": "many"}), "'batch_size'"),
        (row("stream", {"source": "s", "format": "yaml"}), "'format'"),
        (row("stream", {"source": "s"}, family="webhook"), "family"),
    ],
)
def test_a_row_that_cannot_be_rebuilt_is_a_config_error_naming_it(bad: AdapterRow, needle: str) -> None:
    with pytest.raises(ConfigError, match="registered adapter 'a'") as caught:
        registered.adapter_config(bad, DEFAULT_REDIS_URL)
    assert needle in str(caught.value)


def test_settings_this_version_does_not_know_are_ignored() -> None:
    assert registered.adapter_config(row("stream", {"source": "s", "shiny_new_key": 1}), DEFAULT_REDIS_URL)


def test_a_row_registered_when_every_key_was_published_in_every_mode_is_rebuilt() -> None:
    """Before issue 23 a list adapter's row also held the stream keys; the
    config now refuses those for a list, but a stored row is data: ack and
    status must still rebuild it (they would skip the adapter's acks)."""
    old_settings = {
        "source": "jobs", "group": "switchboard", "start_id": "0", "claim_idle_ms": 60_000,
        "claim_interval_ms": 5_000, "body_field": "body", "heartbeat_ttl_ms": 30_000,
    }  # fmt: skip
    rebuilt = registered.adapter_config(row("list", old_settings), DEFAULT_REDIS_URL)
    assert (rebuilt.mode, rebuilt.source, rebuilt.options.heartbeat_ttl_ms) == ("list", "jobs", 30_000)


def test_the_default_broker_is_the_environments_then_the_files() -> None:
    """The broker of adapters known only from the adapters table."""
    db = {"url": "postgresql://sb@localhost/sb"}
    assert from_mapping({"database": db}, {}).default_broker_url == DEFAULT_REDIS_URL
    file = {"database": db, "redis": {"url": "redis://cache:6379/1"}}
    assert from_mapping(file, {}).default_broker_url == "redis://cache:6379/1"
    env = {"SWITCHBOARD_REDIS_URL": "rediss://h:6380/2"}
    assert from_mapping(file, env).default_broker_url == "rediss://h:6380/2"


def test_the_transaction_holding_acks_is_named_once_an_ack_waits_long() -> None:
    holder = audit.HorizonHolder("session", "4242", "app", 1532, timedelta(seconds=20), "idle in transaction")
    shown = "pid 4242 (user app, idle in transaction, open 20 s, 1532 transaction ids behind)"
    assert status._held_by(timedelta(seconds=30), holder) == {"acks_held_by": shown}
    assert status._held_by(timedelta(seconds=1), holder) == {}  # an ack just stored: nothing held
    assert status._held_by(None, holder) == {}
    assert status._held_by(timedelta(seconds=30), None) == {}
    unseen = audit.HorizonHolder("session", "7", None, 9, None, None)  # another role's session
    assert unseen.describe() == "pid 7 (9 transaction ids behind)"
    assert "acks_held_by" in status.render([entry("orders", acks_held_by=shown)], as_json=False)


def test_a_row_of_a_transport_sharing_a_mode_ignores_another_transports_keys() -> None:
    """``queue`` is SQS's mode and AMQP's: a stored AMQP row that carries SQS's
    keys (a row is data, not a config to refuse) rebuilds, those keys ignored."""
    settings = {"source": "jobs", "ack_wait_ms": 30_000, "region": "eu-west-1", "batch_size": 7}
    adapter_row = dataclasses.replace(row("queue", settings), transport="amqp")
    rebuilt = registered.adapter_config(adapter_row, DEFAULT_REDIS_URL)
    assert (rebuilt.transport, rebuilt.mode, rebuilt.batch_size) == ("amqp", "queue", 7)
