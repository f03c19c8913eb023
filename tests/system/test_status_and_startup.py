"""Issue 13, items 5-7, through the real CLI: ``status`` exits non-zero when a
broker is down and works from the database alone; ``ack`` works with no
config file; a permanent database error at start-up stops ``ingest`` and
``ack`` with one line, a transient one is retried."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import pytest
import redis
from sqlalchemy.engine import make_url

from ingest.adapters.redis.lists import processing_key
from ingest.embedded.processes import STRICT_FLAGS, SwitchboardProcess, wait_for, wait_ready
from ingest.embedded.servers import free_port
from ingest.exit_codes import EXIT_DATABASE, EXIT_OK, EXIT_UNHEALTHY
from tests.support import db
from tests.support.config import stream_adapter, write_config
from tests.support.processes import (
    SECRET,
    Processes,
    assert_clean_exit,
    error_lines,
    switchboard,
    with_secret_db,
    with_secret_redis,
)
from tests.support.servers import ServerUrls
from tests.support.streams import produce, xpending

pytestmark = pytest.mark.system
# A start-up that stops at once is well under this, interpreter start included.
PROMPT_EXIT_S = 20


def list_adapter(name: str = "jobs") -> dict[str, object]:
    return {"name": name, "mode": "list", "source": name, "batch_size": 50, "block_ms": 200}


class NoConfigProcess(SwitchboardProcess):
    """``switchboard <verb>`` with no ``--config`` (hence its own __init__), in a directory with no
    ``switchboard.toml``: configured by the environment alone."""

    def __init__(self, verb: str, log_path: Path, env: Mapping[str, str]) -> None:
        self.verb = verb
        self.log_path = log_path
        base = {k: v for k, v in os.environ.items() if not k.startswith("SWITCHBOARD_")}
        self._log_file = log_path.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, *STRICT_FLAGS, "-m", "ingest", verb],
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            env={**base, **env},
            cwd=log_path.parent,
        )


@pytest.fixture
def no_config(tmp_path: Path) -> Iterator[Callable[[str, Mapping[str, str]], NoConfigProcess]]:
    started: list[NoConfigProcess] = []
    folder = tmp_path / "no-config"
    folder.mkdir()

    def start(verb: str, env: Mapping[str, str]) -> NoConfigProcess:
        proc = NoConfigProcess(verb, folder / f"{verb}.{len(started)}.log", env)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.ensure_dead()


def env_only(db_url: str, redis_url: str) -> dict[str, str]:
    return {
        "SWITCHBOARD_DATABASE_URL": with_secret_db(db_url),
        "SWITCHBOARD_REDIS_URL": with_secret_redis(redis_url),
    }


def status_without_config(
    tmp_path: Path, env: Mapping[str, str], *args: str
) -> subprocess.CompletedProcess[str]:
    """In a folder of its own: ``tmp_path`` holds the tests' switchboard.toml."""
    folder = tmp_path / "no-config-status"
    folder.mkdir(exist_ok=True)
    base = {k: v for k, v in os.environ.items() if not k.startswith("SWITCHBOARD_")}
    return subprocess.run(
        [sys.executable, *STRICT_FLAGS, "-m", "ingest", "status", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**base, **env},
        cwd=folder,
        check=False,
    )


def register(procs: Processes, config: Path) -> None:
    """Run an ingester until every adapter's loop started (so the adapters
    table has them) and the stream adapter made its consumer group (on its
    first read, after its loop started: a stop before it would leave a
    stream without its group), then stop it."""
    ingester = procs.start("ingest", config, name="ingester-1")
    wait_for(lambda: len(ingester.events("poll_loop_started")) == 2, timeout_s=30, what="both poll loops")
    wait_for(lambda: ingester.events("group_created"), timeout_s=30, what="the stream's consumer group")
    assert_clean_exit(ingester, ingester.terminate())


def assert_readable(text: str) -> None:
    for raw in ("True", "False", "None", "{", "}"):
        assert raw not in text, f"{raw!r} in the text form:\n{text}"


def test_status_exits_non_zero_when_a_broker_is_unreachable(make_config: Callable[..., Path]) -> None:
    config = make_config(stream_adapter("orders"), redis=f"redis://127.0.0.1:{free_port()}/0")
    text = switchboard("--config", str(config), "status")
    assert text.returncode == EXIT_UNHEALTHY, text.stderr
    assert "orders (stream orders): UNHEALTHY" in text.stdout
    assert "unhealthy: orders" in text.stdout
    assert_readable(text.stdout)
    as_json = switchboard("--config", str(config), "status", "--json")
    assert as_json.returncode == EXIT_UNHEALTHY
    (report,) = json.loads(as_json.stdout)
    assert report["healthy"] is False
    assert report["registered"] is False
    assert "broker_error" in report


@pytest.mark.parametrize(("handler", "healthy"), [("nope_such_module:handle", False), ("json:loads", True)])
def test_status_names_a_handler_no_worker_could_load(
    make_config: Callable[..., Path], handler: str, healthy: bool
) -> None:
    """Issue 24: a worker stops at start on a handler it cannot import, while
    ingest and ack run on and the todos pile up: with no worker serving the
    queue, status says why none could, with the fix, and exits unhealthy."""
    config = make_config(stream_adapter("orders"), queues={"orders": {"handler": handler}})
    result = switchboard("--config", str(config), "status", "--json")
    (report,) = json.loads(result.stdout)
    assert report["healthy"] is healthy
    assert result.returncode == (EXIT_OK if healthy else EXIT_UNHEALTHY), result.stderr
    if healthy:
        assert "handler" not in report
    else:
        assert "cannot import 'nope_such_module'" in report["handler"]
        assert "PYTHONPATH" in report["handler"]


def test_a_stream_not_made_yet_is_no_broker_failure(make_config: Callable[..., Path]) -> None:
    result = switchboard("--config", str(make_config(stream_adapter("orders"))), "status", "--json")
    assert result.returncode == EXIT_OK, result.stdout
    (report,) = json.loads(result.stdout)
    assert (report["healthy"], report["registered"], report["stream_length"]) == (True, False, 0)


def test_status_without_a_config_file_reports_the_registered_adapters(
    procs: Processes, make_config: Callable[..., Path], tmp_path: Path, db_url: str, redis_url: str
) -> None:
    register(procs, make_config(stream_adapter("orders"), list_adapter("jobs")))
    produce(redis_url, "orders", 5)  # a backlog nobody has read
    result = status_without_config(tmp_path, env_only(db_url, redis_url), "--json")
    assert result.returncode == EXIT_OK, result.stderr
    jobs, orders = json.loads(result.stdout)
    assert (jobs["adapter"], jobs["mode"], jobs["source"]) == ("jobs", "list", "jobs")
    assert (orders["adapter"], orders["mode"], orders["source"]) == ("orders", "stream", "orders")
    for r in (jobs, orders):
        assert r["defined_in"] == "database"
        assert r["healthy"] is True
        assert r["enabled"] is True
    assert orders["lag"] == 5
    assert jobs["list_length"] == 0
    text = status_without_config(tmp_path, env_only(db_url, redis_url))
    assert text.returncode == EXIT_OK, text.stderr
    assert "orders (stream orders): ok" in text.stdout
    assert "jobs (list jobs): ok" in text.stdout
    assert "no adapters" not in text.stdout
    assert_readable(text.stdout)
    assert SECRET not in text.stdout + text.stderr
    # The same, the broker gone: non-zero, both named.
    dead = status_without_config(tmp_path, env_only(db_url, f"redis://127.0.0.1:{free_port()}/0"))
    assert dead.returncode == EXIT_UNHEALTHY
    assert "unhealthy: jobs, orders" in dead.stdout
    # A disabled adapter is shown but not counted.
    assert (
        switchboard("adapters", "disable", "jobs", env={"SWITCHBOARD_DATABASE_URL": db_url}).returncode == 0
    )
    produce(redis_url, "orders", 1, start=5)
    still = status_without_config(tmp_path, env_only(db_url, f"redis://127.0.0.1:{free_port()}/0"))
    assert still.returncode == EXIT_UNHEALTHY
    assert "jobs (list jobs): disabled" in still.stdout
    assert "unhealthy: orders" in still.stdout


def test_registered_adapters_use_the_config_files_redis_url(
    procs: Processes, make_config: Callable[..., Path], tmp_path: Path, db_url: str, redis_url: str
) -> None:
    """A config file with [database] and [redis] but no adapters: the
    registered adapters' broker is its [redis] url (it was localhost:6379
    whatever the file said, so status called a healthy deployment broken)."""
    register(procs, make_config(stream_adapter("orders"), list_adapter("jobs")))
    config = tmp_path / "no-adapters.toml"
    config.write_text(f'[database]\nurl = "{db_url}"\n\n[redis]\nurl = "{redis_url}"\n')
    result = switchboard("--config", str(config), "status", "--json")
    assert result.returncode == EXIT_OK, result.stdout + result.stderr
    assert [(r["adapter"], r["healthy"]) for r in json.loads(result.stdout)] == [
        ("jobs", True),
        ("orders", True),
    ]


def test_status_with_a_config_lists_adapters_only_registered_unchecked(
    procs: Processes, make_config: Callable[..., Path], redis_url: str
) -> None:
    register(procs, make_config(stream_adapter("orders"), list_adapter("jobs")))
    narrower = make_config(stream_adapter("orders"), name="orders-only.toml")
    result = switchboard("--config", str(narrower), "status", "--json")
    assert result.returncode == EXIT_OK, result.stdout
    orders, jobs = json.loads(result.stdout)
    assert (orders["adapter"], orders["defined_in"], orders["healthy"]) == ("orders", "config", True)
    assert (jobs["adapter"], jobs["defined_in"], jobs["healthy"]) == ("jobs", "database", None)
    assert jobs["broker"].startswith("not checked")


def test_ack_without_a_config_file_acks_adapters_registered_after_it_started(
    procs: Processes,
    make_config: Callable[..., Path],
    no_config: Callable[[str, Mapping[str, str]], NoConfigProcess],
    db_url: str,
    redis_url: str,
) -> None:
    acker = no_config("ack", env_only(db_url, redis_url))
    wait_ready(acker)  # LISTENing, with no adapter registered yet
    assert acker.events("no_adapters_registered")
    ids = produce(redis_url, "orders", 40)
    with redis.Redis.from_url(redis_url, socket_timeout=10) as r:
        r.lpush("jobs", *[json.dumps({"job": i}).encode() for i in range(30)])
    ingester = procs.start(
        "ingest", make_config(stream_adapter("orders"), list_adapter("jobs")), name="ingester-1"
    )
    # The acker finds both adapters in the table (refreshed every 5 s) and acks
    # their intents: XACK empties the PEL, LREM the processing list.
    wait_for(
        lambda: db.acked(db_url) == 70 and xpending(redis_url, "orders") == 0,
        timeout_s=60,
        what="every intent acked by the config-less acker",
    )
    with redis.Redis.from_url(redis_url, socket_timeout=10) as r:
        assert r.llen(processing_key("jobs", "ingester-1")) == 0
    assert {e["adapter"] for e in acker.events("registered_adapter_acked")} == {"orders", "jobs"}
    assert {e["adapter"] for e in acker.events("acks_sent")} == {"orders", "jobs"}
    assert_clean_exit(ingester, ingester.terminate())
    assert_clean_exit(acker, acker.terminate())
    assert len(ids) == 40
    assert SECRET not in acker.raw_log()


@pytest.mark.parametrize("verb", ["ingest", "ack"])
def test_an_unmigrated_database_stops_the_process_with_one_line(
    servers: ServerUrls, tmp_path: Path, redis_url: str, verb: str
) -> None:
    url = db.create_test_database(servers.database, migrated=False)
    try:
        config = write_config(
            tmp_path / "switchboard.toml", database_url=url, redis_url=redis_url, adapters=[stream_adapter()]
        )
        started = time.monotonic()
        result = switchboard("--config", str(config), verb, timeout_s=PROMPT_EXIT_S)
        assert time.monotonic() - started < PROMPT_EXIT_S
    finally:
        db.drop_test_database(servers.database, url)
    assert result.returncode == EXIT_DATABASE, result.stderr
    (line,) = [line for line in error_lines(result) if line.startswith("switchboard")]
    assert line.startswith(
        f"switchboard {verb}: the database has no Switchboard tables (undefined table):"
        " run `switchboard migrate` first [database "
    )
    assert "Traceback" not in result.stderr
    assert "_failed" not in result.stderr  # no retry was logged
    assert '"database_unusable"' in result.stderr


@pytest.mark.parametrize("verb", ["ingest", "ack"])
@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"database": "no_such_database_here"}, "does not exist: create it"),
        # A server with password auth (the suite's own) says "password
        # authentication failed" for a missing role too, so as not to tell
        # which roles exist: "refused the password"; a trusting one "refused the login".
        ({"username": "no_such_role_here"}, "the database refused the"),
    ],
)
def test_a_missing_database_or_role_stops_the_process(
    servers: ServerUrls, tmp_path: Path, redis_url: str, verb: str, change: dict[str, str], needle: str
) -> None:
    url = make_url(servers.database).set(**change).render_as_string(hide_password=False)  # type: ignore[arg-type]
    config = write_config(
        tmp_path / "switchboard.toml", database_url=url, redis_url=redis_url, adapters=[stream_adapter()]
    )
    result = switchboard("--config", str(config), verb, timeout_s=PROMPT_EXIT_S)
    assert result.returncode == EXIT_DATABASE, result.stderr
    (line,) = [line for line in error_lines(result) if line.startswith("switchboard")]
    assert needle in line
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(("verb", "event"), [("ingest", "register_failed"), ("ack", "start_failed")])
def test_a_database_down_at_start_is_retried(
    procs: Processes, tmp_path: Path, redis_url: str, verb: str, event: str
) -> None:
    config = write_config(
        tmp_path / "switchboard.toml",
        database_url=f"postgresql+psycopg://postgres:{SECRET}@127.0.0.1:{free_port()}/switchboard",
        redis_url=redis_url,
        adapters=[stream_adapter()],
    )
    proc = procs.start(verb, config, name=f"{verb}-1")
    wait_for(lambda: len(proc.events(event)) >= 3, timeout_s=30, what=f"{event} retried")
    assert proc.alive()
    assert all(e["retry_in_s"] > 0 for e in proc.events(event))
    assert_clean_exit(proc, proc.terminate())
    procs.assert_no_secret_logged()
