"""The CLI contract: migrate, adapters, status, config errors, inbox list and replay."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
from alembic.script import ScriptDirectory

from backhalf.housekeeping import migrate
from ingest.embedded.processes import wait_for
from tests.support import db
from tests.support.config import stream_adapter
from tests.support.processes import Processes, assert_clean_exit, switchboard
from tests.support.servers import ServerUrls
from tests.support.streams import produce

pytestmark = pytest.mark.system


def test_migrate_from_the_environment_alone(servers: ServerUrls, tmp_path: Path) -> None:
    url = db.create_test_database(servers.database, migrated=False)
    try:
        env = {"SWITCHBOARD_DATABASE_URL": url}
        first = switchboard("migrate", env=env)
        assert first.returncode == 0, first.stderr
        assert switchboard("migrate", env=env).returncode == 0  # idempotent
        # The newest revision, whichever it is: a later migration needs no edit here.
        head = ScriptDirectory.from_config(migrate.alembic_config(url)).get_current_head()
        assert db.scalar(url, "SELECT version_num FROM alembic_version") == head
    finally:
        db.drop_test_database(servers.database, url)


@pytest.mark.parametrize(
    ("adapter", "needles"),
    [
        ({"name": "orders", "mode": "carrier-pigeon", "source": "o"}, ["'orders'", "'mode'"]),
        ({"name": "events", "mode": "pubsub", "source": "ch"}, ["'events'", "'delivery'", "at-most-once"]),
        ({"name": "orders", "source": "o", "batchsize": 5}, ["'orders'", "'batchsize'"]),
    ],
)
def test_config_errors_stop_the_process_naming_adapter_and_key(
    make_config: Callable[..., Path], adapter: dict[str, object], needles: list[str]
) -> None:
    config = make_config(adapter)
    for verb in ("ingest", "ack"):
        result = switchboard("--config", str(config), verb)
        assert result.returncode == 2
        for needle in needles:
            assert needle in result.stderr


def test_missing_config_file_is_a_clear_error(tmp_path: Path) -> None:
    result = switchboard("--config", str(tmp_path / "nope.toml"), "ingest")
    assert result.returncode == 2
    assert "nope.toml" in result.stderr
    assert "not found" in result.stderr


def test_status_reports_backlog_pending_acks_and_todos(
    procs: Processes, make_config: Callable[..., Path], db_url: str, redis_url: str
) -> None:
    config = make_config(stream_adapter("orders"))
    produce(redis_url, "orders", 30)
    ingester = procs.start("ingest", config, name="ingester-1")
    wait_for(lambda: db.scalar(db_url, "SELECT count(*) FROM todos") == 30, timeout_s=30, what="todos")
    assert_clean_exit(ingester, ingester.terminate())
    produce(redis_url, "orders", 5, start=30)  # a backlog nobody has read
    result = switchboard("--config", str(config), "status", "--json")
    assert result.returncode == 0, result.stderr
    (report,) = json.loads(result.stdout)
    assert report["adapter"] == "orders"
    assert report["enabled"] is True
    assert report["lag"] == 5
    assert report["broker_pending"] == 30  # stored, but no acker ran
    assert report["pending_acks"] == 30
    assert report["oldest_unacked_age_s"] > 0
    assert report["todos"] == {"pending": 30}
    text = switchboard("--config", str(config), "status")
    assert "pending_acks" in text.stdout


def test_unknown_adapter_enable_fails(make_config: Callable[..., Path]) -> None:
    result = switchboard(
        "--config", str(make_config(stream_adapter("orders"))), "adapters", "enable", "ghost"
    )
    assert result.returncode == 1
    assert "ghost" in result.stderr


def test_rejected_messages_are_listed_and_replayed_once_fixed(
    procs: Processes, make_config: Callable[..., Path], db_url: str, redis_url: str
) -> None:
    # format = "json": a text body is poison; the operator then switches the
    # adapter to format = "text" (the fix) and replays.
    strict = make_config(stream_adapter("orders"))
    ids = produce(redis_url, "orders", 3)
    with redis.Redis.from_url(redis_url, socket_timeout=10) as r:
        bad = r.xadd("orders", {"body": b"plain words, not JSON"}).decode()
    ingester = procs.start("ingest", strict, name="ingester-1")
    acker = procs.start("ack", strict, name="acker-1")
    wait_for(
        lambda: db.scalar(db_url, "SELECT count(*) FROM inbox WHERE ack_state = 'acked'") == 4,
        timeout_s=30,
        what="all four stored and acked, the poison one included",
    )
    assert_clean_exit(ingester, ingester.terminate())
    assert_clean_exit(acker, acker.terminate())
    assert db.scalar(db_url, "SELECT count(*) FROM todos") == 3
    listed = switchboard("--config", str(strict), "inbox", "list", "--rejected", "--json")
    assert listed.returncode == 0, listed.stderr
    (row,) = json.loads(listed.stdout)
    assert row["source_message_id"] == bad
    assert row["error"].startswith("invalid_json")
    assert row["ack_state"] == "acked"  # acked so it stopped looping
    still_bad = switchboard("--config", str(strict), "inbox", "replay", str(row["id"]))
    assert still_bad.returncode == 1
    assert "still rejected" in still_bad.stderr
    fixed = make_config(stream_adapter("orders", format="text"), name="fixed.toml")
    replayed = switchboard("--config", str(fixed), "inbox", "replay", str(row["id"]))
    assert replayed.returncode == 0, replayed.stderr
    assert db.query(
        db_url,
        "SELECT i.status, i.error, t.payload FROM inbox i JOIN todos t ON t.id = i.todo_id"
        " WHERE i.id = %(id)s",
        {"id": row["id"]},
    ) == [("stored", None, "plain words, not JSON")]
    assert db.scalar(db_url, "SELECT count(*) FROM events") == 4
    again = switchboard("--config", str(fixed), "inbox", "replay", str(row["id"]))
    assert again.returncode == 1
    assert "not rejected" in again.stderr
    assert len(ids) == 3
