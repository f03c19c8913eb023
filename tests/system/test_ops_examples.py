"""The shipped ops examples as written (issue 13.8): a Valkey that loads
ops/redis-users.acl as its aclfile (only the passwords replaced) runs the
example config's three adapters, each under its own user, in real ``switchboard
ingest`` and ``ack`` processes; ``status`` works under them; what they do not
grant is refused."""

from __future__ import annotations

import json
import subprocess
import tomllib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import redis

from ingest.adapters.redis.lists import processing_key
from ingest.config import load
from ingest.embedded.config import write_config
from ingest.embedded.processes import wait_for, wait_ready
from ingest.embedded.servers import RedisServer, free_port
from tests.support import db, debian_redis
from tests.support.acl import acl_file_as_shipped, password_for, shipped_acl_redis
from tests.support.processes import Processes, assert_clean_exit, switchboard
from tests.support.streams import produce, xpending

pytestmark = pytest.mark.system

EXAMPLE_CONFIG = Path(__file__).parents[2] / "ops" / "switchboard.example.toml"
N = 50


@pytest.fixture
def acl_redis() -> Iterator[RedisServer]:
    with shipped_acl_redis() as server:
        yield server


def _as(server: RedisServer, user: str, password: str | None = None) -> redis.Redis:
    return redis.Redis(
        host="127.0.0.1",
        port=server.port,
        username=user,
        password=password or password_for(user),
        socket_timeout=10,
    )


def _example_config(path: Path, db_url: str, server: RedisServer) -> Path:
    """The example config, pointed at the test's servers, each adapter with its
    mode's user in its own ``url``; every other value as shipped."""
    example: dict[str, Any] = tomllib.loads(EXAMPLE_CONFIG.read_text())
    adapters: list[Mapping[str, Any]] = []
    for adapter in example["adapters"]:
        user = f"switchboard-{adapter['mode']}"
        url = f"redis://{user}:{password_for(user)}@127.0.0.1:{server.port}/0"
        adapters.append({**adapter, "url": url})
    database = {k: v for k, v in example["database"].items() if k != "url"}
    return write_config(
        path,
        database_url=db_url,
        adapters=adapters,
        database=database,
        ingest=example["ingest"],
        acker=example["acker"],
    )


def test_the_example_config_runs_under_the_shipped_acl_users(
    tmp_path: Path, db_url: str, acl_redis: RedisServer, procs: Processes
) -> None:
    config = _example_config(tmp_path / "switchboard.toml", db_url, acl_redis)
    ingester = procs.start("ingest", config, name="ingester-1")
    acker = procs.start("ack", config, name="acker")
    wait_ready(ingester)
    wait_ready(acker)
    with redis.Redis.from_url(acl_redis.url, socket_timeout=10) as producer:  # the default user
        produce(acl_redis.url, "orders", N)
        producer.lpush("jobs", *(json.dumps({"job": i}) for i in range(N)))
        wait_for(
            lambda: producer.pubsub_numsub("notifications")[0][1] == 1,
            timeout_s=30,
            what="the ingester subscribed to notifications",
        )
        for i in range(N):
            producer.publish("notifications", json.dumps({"note": i}))
        wait_for(
            lambda: db.scalar(db_url, "SELECT count(*) FROM todos") == 3 * N,
            timeout_s=60,
            what=f"{3 * N} todos",
        )
        wait_for(
            lambda: db.scalar(db_url, "SELECT count(*) FROM inbox WHERE ack_state = 'pending'") == 0,
            timeout_s=60,
            what="every ack intent discharged",
        )
        assert xpending(acl_redis.url, "orders") == 0
        assert producer.llen("jobs") == 0
        assert producer.llen(processing_key("jobs", "ingester-1")) == 0

    users = db.query(
        db_url, "SELECT queue, verify_detail, count(*) FROM events JOIN todos USING (idempotency_key)"
        " GROUP BY 1, 2 ORDER BY 1",
    )  # fmt: skip
    assert users == [
        ("jobs", "redis acl: switchboard-list", N),
        ("notifications", "redis acl: switchboard-pubsub", N),
        ("orders", "redis acl: switchboard-stream", N),
    ]
    status = switchboard("--config", str(config), "status")
    assert status.returncode == 0, status.stdout + status.stderr
    for name in ("orders", "jobs", "notifications"):
        assert name in status.stdout
    assert "NOPERM" not in status.stdout + status.stderr
    # The example holds no key the workers on PostgreSQL retired (issue 42),
    # in the tables copied here or in the others.
    assert "config_key_ignored" not in status.stdout + status.stderr
    assert load(EXAMPLE_CONFIG, {}).notices == ()

    for proc in (ingester, acker):
        assert_clean_exit(proc, proc.stop())
    logs = procs.logs_text()
    assert "pool_smaller_than_needed" not in logs  # the example's pool fits its adapters
    assert "NOPERM" not in logs
    # Not one command refused, the clients' own hello included (no CLIENT
    # SETINFO: the file grants it to no one, for it must load on Redis 7.0).
    with redis.Redis.from_url(acl_redis.url, socket_timeout=10) as admin:
        denied = admin.acl_log()
    assert denied == [], denied


def test_the_shipped_acl_file_loads_on_debians_redis_70(tmp_path: Path) -> None:
    """Issue 24: Debian 12's redis-server is 7.0, which refuses a rule for a
    command it lacks (``+client|setinfo``, 7.2's) and will not start. The
    file as shipped (passwords set) loads there, and every user logs in."""
    binary, env = debian_redis.redis_70()
    acl = acl_file_as_shipped(tmp_path / "users.acl")
    port = free_port()
    argv = [str(binary), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--dir", str(tmp_path), "--aclfile", str(acl)]  # fmt: skip
    log_path = tmp_path / "redis.log"
    with log_path.open("wb") as log:
        server = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        users = [line.split()[1] for line in acl.read_text().splitlines() if line.startswith("user ")]

        def logs_in(user: str) -> bool:
            try:
                with _on_port(port, user) as client:
                    return bool(client.ping())
            except redis.exceptions.ConnectionError:
                return server.poll() is not None  # it died: stop waiting, the assert below says so

        wait_for(lambda: logs_in("default"), timeout_s=30, what="Redis 7.0 answering")
        assert server.poll() is None, log_path.read_text(errors="replace")
        with _on_port(port, "default") as admin:
            assert "7.0" in str(admin.info("server")["redis_version"])[:3]
        for user in users:
            with _on_port(port, user) as client:
                assert client.acl_whoami() == user
    finally:
        server.kill()
        server.wait(timeout=10)


def _on_port(port: int, user: str) -> redis.Redis:
    return redis.Redis(host="127.0.0.1", port=port, username=user, password=password_for(user),
                       socket_timeout=10, driver_info=None)  # fmt: skip


def test_the_shipped_acl_users_are_refused_what_they_are_not_granted(acl_redis: RedisServer) -> None:
    stream, lst, pubsub = (_as(acl_redis, f"switchboard-{m}") for m in ("stream", "list", "pubsub"))
    try:
        assert stream.acl_whoami() == "switchboard-stream"
        with pytest.raises(redis.exceptions.NoPermissionError):
            stream.xadd("orders", {"body": "{}"})  # a command not granted: consumers never produce
        with pytest.raises(redis.exceptions.NoPermissionError):
            stream.xlen("jobs")  # a granted command on a key outside the user's patterns
        with pytest.raises(redis.exceptions.NoPermissionError):
            lst.flushall()
        with pytest.raises(redis.exceptions.NoPermissionError):
            lst.get("orders")
        with pytest.raises(redis.exceptions.NoPermissionError):
            pubsub.publish("notifications", "x")
        with pytest.raises(redis.exceptions.NoPermissionError):
            pubsub.get("notifications")
        with pytest.raises(redis.exceptions.AuthenticationError):
            _as(acl_redis, "switchboard-stream", "CHANGE-ME").ping()  # the placeholder is no password
    finally:
        for client in (stream, lst, pubsub):
            client.close()


def test_producers_write_their_sources_and_nothing_else(acl_redis: RedisServer) -> None:
    """The producers' user (issue 32): it adds to the sources, and touches
    neither what the consumers and the acker do nor any other key, script or
    database. The workers have no Redis user (issue 42: their broker is
    PostgreSQL): the file holds none, so none logs in."""
    producer = _as(acl_redis, "switchboard-producer")
    try:
        producer.xadd("orders", {"body": "{}"})
        producer.lpush("jobs", "{}")
        producer.publish("notifications", "{}")
        refused: list[tuple[str, ...]] = [
            ("HSET", "elsewhere.msgs", "m1", "{}"),  # a key not its own
            ("RPUSH", "elsewhere", "m1"),
            ("EVALSHA", "0" * 40, "0"),  # a script
            ("SELECT", "1"),  # another database
            ("XACK", "orders", "switchboard", "0-1"),  # the acker's
            ("XREADGROUP", "GROUP", "switchboard", "c1", "STREAMS", "orders", ">"),  # the ingester's
            ("XADD", "elsewhere", "*", "body", "{}"),  # a stream not its own
            ("DEL", "orders"),
        ]
        for command in refused:
            with pytest.raises(redis.exceptions.NoPermissionError):
                producer.execute_command(*command)  # type: ignore[no-untyped-call]
    finally:
        producer.close()
    with pytest.raises(redis.exceptions.AuthenticationError):
        _as(acl_redis, "switchboard-dramatiq").ping()  # the relay's user is gone with it
