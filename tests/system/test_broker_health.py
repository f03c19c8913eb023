"""A broker that refuses a process is said where the operator looks (issue
44): the ingester and the acker given a wrong Redis ACL password are
FAILING at once (a refused login does not heal by waiting): their
``/healthz`` answers 503 naming the broker and the error, their heartbeat
carries it, ``status`` says FAILING and exits non-zero. The right password
makes them healthy again. No password reaches a log, a page or status."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from ingest.embedded.processes import SwitchboardProcess, wait_for, wait_ready
from ingest.embedded.servers import RedisServer, free_port
from ingest.exit_codes import EXIT_OK
from tests.support.acl import password_for, shipped_acl_redis
from tests.support.config import stream_adapter, write_config
from tests.support.db import acked, scalar
from tests.support.processes import Processes, assert_clean_exit, switchboard

pytestmark = pytest.mark.system
USER, PASSWORD = "SB_TEST_BROKER_USER", "SB_TEST_BROKER_PASSWORD"
WRONG = "not-the-password"


@pytest.fixture
def acl_redis() -> Iterator[RedisServer]:
    with shipped_acl_redis() as server:
        yield server


def healthz(port: int) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())
    except (urllib.error.URLError, ConnectionError):
        return 0, {}


def _env(user: str, password: str, port: int) -> dict[str, str]:
    return {USER: user, PASSWORD: password, "SWITCHBOARD_METRICS_PORT": str(port)}


def _failing_broker(port: int) -> bool:
    status, body = healthz(port)
    failing = body.get("failing") or {}
    return status == 503 and any(
        "WRONGPASS" in str(e) or "invalid" in str(e).lower() for e in failing.values()
    )


def _status(config: Path) -> tuple[int, str]:
    shown = switchboard("--config", str(config), "status")
    return shown.returncode, shown.stdout + shown.stderr


def test_a_refused_broker_login_makes_the_ingester_and_the_acker_failing(
    procs: Processes, tmp_path: Path, db_url: str, acl_redis: RedisServer
) -> None:
    url = f"redis://127.0.0.1:{acl_redis.port}/0"
    config = write_config(
        tmp_path / "switchboard.toml",
        database_url=db_url,
        redis_url=f"redis://default:{password_for('default')}@127.0.0.1:{acl_redis.port}/0",
        adapters=[stream_adapter("orders", url=url, username_env=USER, password_env=PASSWORD)],
    )
    admin = redis.Redis.from_url(
        f"redis://default:{password_for('default')}@127.0.0.1:{acl_redis.port}/0", socket_timeout=10
    )
    admin.xadd("orders", {"body": json.dumps({"n": 1})})

    # The ingester, refused: FAILING within seconds, not a warning per retry.
    port = free_port()
    ingester = procs.start(
        "ingest", config, name="ingest-wrong", env=_env("switchboard-ingester", WRONG, port)
    )
    started: list[SwitchboardProcess] = [ingester]
    wait_for(lambda: _failing_broker(port), timeout_s=30, what="the ingester's /healthz naming the refusal")
    code, text = wait_for(
        lambda: result if "FAILING" in (result := _status(config))[1] else None,
        timeout_s=30,
        what="status saying FAILING",
    )
    assert code != EXIT_OK, text
    assert "redis broker at" in text, text
    assert_clean_exit(ingester, ingester.terminate())

    # The right password: stored, and healthy again.
    port = free_port()
    ingester = procs.start(
        "ingest",
        config,
        name="ingest-right",
        env=_env("switchboard-ingester", password_for("switchboard-ingester"), port),
    )
    started.append(ingester)
    wait_ready(ingester)
    wait_for(lambda: scalar(db_url, "SELECT count(*) FROM inbox") == 1, timeout_s=30, what="the entry stored")
    wait_for(lambda: healthz(port)[0] == 200, timeout_s=30, what="the ingester healthy")

    # The acker, refused, with an ack owed: FAILING too.
    ack_port = free_port()
    acker = procs.start("ack", config, name="ack-wrong", env=_env("switchboard-acker", WRONG, ack_port))
    started.append(acker)
    wait_for(lambda: _failing_broker(ack_port), timeout_s=30, what="the acker's /healthz naming the refusal")
    wait_for(lambda: "FAILING" in _status(config)[1], timeout_s=30, what="status saying FAILING")
    assert acked(db_url) == 0
    assert_clean_exit(acker, acker.terminate())
    acker = procs.start(
        "ack",
        config,
        name="ack-right",
        env=_env("switchboard-acker", password_for("switchboard-acker"), ack_port),
    )
    started.append(acker)
    wait_for(lambda: acked(db_url) == 1, timeout_s=30, what="the ack sent")
    wait_for(lambda: healthz(ack_port)[0] == 200, timeout_s=30, what="the acker healthy")
    for proc in (ingester, acker):
        assert_clean_exit(proc, proc.terminate())
    procs.assert_no_secret_logged()
    for proc in started:
        assert WRONG not in proc.raw_log()
