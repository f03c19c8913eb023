"""A password planted in every URL and password field, and every process made
to fail: the password is in no log line, no output, no metric and no
rendered traceback (dramatiq's own log lines included).

The planted secret (``SECRET``, fresh per run) is the real password of a
PostgreSQL and a Valkey this module starts, so the working URLs carry it for
real: the database URL (in the config and in SWITCHBOARD_DATABASE_URL), an
adapter's own broker URL, SWITCHBOARD_REDIS_URL (the broker of the adapter
without one, and [redis] url), and the retired [dramatiq] url a config
written for the relay still holds (the next test: accepted and ignored, its
notice names the key only). The same secret is the wrong password of a role
and a Redis user that have another, for the logins refused. Then: a
handler whose error names a URL with it, a poison message, each server
stopped mid-run, a port nothing listens on, a URL the config refuses, and
every read-only command, the metrics and /healthz on the way."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
import pytest
import redis
from sqlalchemy.engine import make_url

from backhalf.db import libpq_url as libpq
from backhalf.housekeeping import migrate
from ingest.embedded.processes import SwitchboardProcess, wait_for, wait_ready
from ingest.embedded.servers import PostgresServer, RedisServer, free_port, temp_base
from ingest.exit_codes import EXIT_CONFIG, EXIT_DATABASE, EXIT_FAILURE, EXIT_OK, EXIT_UNHEALTHY
from tests.support import handlers
from tests.support.config import stream_adapter, write_config
from tests.support.db import scalar
from tests.support.processes import SECRET, Processes, switchboard

pytestmark = pytest.mark.system

# The random part alone, too: a password cut short or split still shows it.
TOKEN = SECRET.rsplit("-", 1)[-1]
OTHER_PASSWORD = "not-the-planted-one"
HTTP_TIMEOUT_S = 5.0
STREAM = "orders"
LIST = "jobs"


@dataclass
class Sightings:
    """Every text a process or command produced, by where it came from."""

    texts: list[tuple[str, str]] = field(default_factory=list)

    def add(self, where: str, text: str) -> None:
        self.texts.append((where, text))

    def command(
        self, where: str, result: subprocess.CompletedProcess[str]
    ) -> subprocess.CompletedProcess[str]:
        self.add(f"{where}: stdout", result.stdout)
        self.add(f"{where}: stderr", result.stderr)
        return result

    def text(self, where: str) -> str:
        return "".join(text for w, text in self.texts if w.startswith(where))

    def assert_no_secret(self) -> None:
        found = []
        for where, text in self.texts:
            for needle in (SECRET, TOKEN):
                at = text.find(needle)
                if at >= 0:
                    context = text[max(0, at - 300) : at + 100].replace(SECRET, "<SECRET>")
                    found.append(f"{where}: ...{context.replace(TOKEN, '<TOKEN>')}...")
                    break
        assert not found, "the planted secret was shown:\n" + "\n\n".join(found)


@dataclass(frozen=True)
class Servers:
    postgres: PostgresServer
    valkey: RedisServer
    database_url: str  # the superuser's, password SECRET

    def redis_url(self, db: int = 0, user: str = "default") -> str:
        return f"redis://{user}:{SECRET}@127.0.0.1:{self.valkey.port}/{db}"


@pytest.fixture(scope="module")
def secret_servers() -> Iterator[Servers]:
    """A PostgreSQL and a Valkey whose password is SECRET, each with a second
    login (role ``other``, Redis user ``other``) whose password is not."""
    base = temp_base("switchboard-secrets-")
    postgres = valkey = None
    try:
        postgres = PostgresServer.create(base / "pg", password=SECRET)
        postgres.start()
        url = postgres.create_database("switchboard")
        migrate.upgrade(url)
        with psycopg.connect(libpq(url), autocommit=True, connect_timeout=10) as conn:
            conn.execute(f"CREATE ROLE other LOGIN PASSWORD '{OTHER_PASSWORD}'")
        valkey = RedisServer.create(base / "valkey", password=SECRET)
        valkey.start()
        with redis.Redis.from_url(valkey.url, socket_timeout=10) as r:
            r.acl_setuser(
                "other", enabled=True, passwords=[f"+{OTHER_PASSWORD}"], keys=["*"], commands=["+@all"]
            )
        yield Servers(postgres, valkey, url)
    finally:
        for server in (valkey, postgres):
            if server is not None:
                server.cleanup()
        shutil.rmtree(base, ignore_errors=True)


def fetch(port: int, path: str) -> tuple[int, str]:
    """The status and body of one GET; (0, "") while nothing listens."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=HTTP_TIMEOUT_S) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0, ""


def scrape(seen: Sightings, where: str, port: int) -> tuple[int, str]:
    """/metrics and /healthz of one process, both kept; the health status and body."""
    metrics_code, metrics = fetch(port, "/metrics")
    assert metrics_code == 200, (where, metrics_code)
    seen.add(f"{where} /metrics", metrics)
    code, body = fetch(port, "/healthz")
    seen.add(f"{where} /healthz", body)
    return code, body


def problems(proc: SwitchboardProcess) -> list[dict[str, object]]:
    """The failures a process logged: lines at warning or above that carry an
    error (ours have ``error`` fields; dramatiq's name a connection error),
    not asyncio's slow-callback warnings of a busy machine."""
    found = []
    for line in proc.logs():
        if line.get("level") not in {"warning", "error", "critical"}:
            continue
        event = str(line.get("event", ""))
        if "error" in line or "error_type" in line or "exception" in line or "connection error" in event:
            found.append(line)
    return found


def health_is(port: int, code: int) -> Callable[[], bool]:
    return lambda: fetch(port, "/healthz")[0] == code


def logged_problems(proc: SwitchboardProcess, more_than: int = 0) -> Callable[[], bool]:
    return lambda: len(problems(proc)) > more_than


def wait_for_more_problems(procs: list[SwitchboardProcess], before: dict[str, int], what: str) -> None:
    """Until each process has logged a new warning or error since ``before``."""
    for proc in procs:
        wait_for(
            logged_problems(proc, before[proc.log_path.name]),
            timeout_s=45,
            what=f"{proc.log_path.name} to log {what}",
        )


def counts(procs: list[SwitchboardProcess]) -> dict[str, int]:
    return {p.log_path.name: len(problems(p)) for p in procs}


def run_all(seen: Sightings, commands: dict[str, tuple[list[str], dict[str, str]]]) -> dict[str, int]:
    """Commands run side by side (each is mostly interpreter start-up); their exit codes."""
    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = {
            name: pool.submit(switchboard, *argv, env=env, timeout_s=120)
            for name, (argv, env) in commands.items()
        }
        return {name: seen.command(name, future.result()).returncode for name, future in futures.items()}


def test_a_planted_password_reaches_no_output_while_everything_fails(
    secret_servers: Servers, tmp_path: Path
) -> None:
    seen = Sightings()
    db_url = secret_servers.database_url
    config = write_config(
        tmp_path / "switchboard.toml",
        database_url=db_url,
        redis_url=secret_servers.redis_url(),
        adapters=[
            stream_adapter(STREAM, url=secret_servers.redis_url()),
            # No url: the broker is SWITCHBOARD_REDIS_URL.
            {
                "name": LIST,
                "transport": "redis",
                "mode": "list",
                "source": LIST,
                "queue": LIST,
                "block_ms": 200,
            },
        ],
        # Two attempts: after the first, the worker logs the error (a retry).
        queues={
            STREAM: {
                "handler": "tests.support.handlers:leaky",
                "max_attempts": 2,
                "min_backoff_ms": 50,
                "max_backoff_ms": 100,
            }
        },
    )
    env = {
        "SWITCHBOARD_DATABASE_URL": db_url,
        "SWITCHBOARD_REDIS_URL": secret_servers.redis_url(),
        handlers.LEAKY_URL_VARIABLE: secret_servers.redis_url(db=5),
    }
    procs = Processes(tmp_path)
    ports = {verb: free_port() for verb in ("ingest", "ack", "worker")}
    try:
        running = [
            procs.start(verb, config, name=verb, env={**env, "SWITCHBOARD_METRICS_PORT": str(port)})
            for verb, port in ports.items()
        ]
        for proc in running:
            wait_ready(proc, timeout_s=60)
        for verb, port in ports.items():
            wait_for(health_is(port, 200), timeout_s=60, what=f"{verb} healthy")

        with redis.Redis.from_url(secret_servers.redis_url(), socket_timeout=10) as r:
            entry = r.xadd(STREAM, {"body": json.dumps({"order": 1})}).decode()
            r.xadd(STREAM, {"body": "{not json"})
            r.lpush(LIST, json.dumps({"job": 1}))
        # The handler fails its one attempt with the URL in its error; the
        # poison entry is stored as rejected with its error.
        wait_for(
            lambda: scalar(db_url, "SELECT count(*) FROM todos WHERE status = 'failed'") == 1,
            timeout_s=60,
            what="the leaky handler's todo failed",
        )
        wait_for(
            lambda: scalar(db_url, "SELECT count(*) FROM inbox WHERE ack_state = 'acked'") == 3,
            timeout_s=30,
            what="the three messages acked",
        )
        todo_id = scalar(db_url, "SELECT id FROM todos WHERE status = 'failed'")
        assert "cannot connect to redis://" in scalar(
            db_url, "SELECT last_error FROM todos WHERE status = 'failed'"
        )
        for verb, port in ports.items():
            assert scrape(seen, f"{verb} (working)", port)[0] == 200

        cli = {key: value for key, value in env.items() if key != handlers.LEAKY_URL_VARIABLE}
        with_config = ["--config", str(config)]
        codes = run_all(
            seen,
            {
                "status": ([*with_config, "status"], cli),
                "status --json": ([*with_config, "status", "--json"], cli),
                "migrate": ([*with_config, "migrate"], cli),
                "inbox list": ([*with_config, "inbox", "list"], cli),
                "todos list": ([*with_config, "todos", "list"], cli),
                "todos show": ([*with_config, "todos", "show", str(todo_id)], cli),
                "trace": ([*with_config, "trace", entry], cli),
                "prune --dry-run": ([*with_config, "prune", "--dry-run"], cli),
                "adapters list": ([*with_config, "adapters", "list"], cli),
            },
        )
        assert codes == dict.fromkeys(codes, EXIT_OK)
        # The handler's error reached the output, its URL's password masked.
        for where in ("todos show", "todos list", "trace"):
            assert f"redis://default:***@127.0.0.1:{secret_servers.valkey.port}/5" in seen.text(where), where

        # Valkey gone mid-run, with an ack owed: the acker is stopped
        # (SIGSTOP) while an entry is stored, so once Valkey is gone its XACK
        # fails too, as the ingester's reads do. (The workers reach no Redis:
        # their broker is PostgreSQL.)
        acker = running[1]
        acker.signal(signal.SIGSTOP)
        try:
            with redis.Redis.from_url(secret_servers.redis_url(), socket_timeout=10) as r:
                r.xadd(STREAM, {"body": json.dumps({"order": 2})})
            wait_for(
                lambda: scalar(db_url, "SELECT count(*) FROM inbox WHERE ack_state = 'pending'") == 1,
                timeout_s=30,
                what="the second entry stored, its ack owed",
            )
            before = counts(running)
            secret_servers.valkey.kill()
        finally:
            acker.signal(signal.SIGCONT)
        wait_for_more_problems(running[:2], before, "the broker out of reach")
        for verb, port in ports.items():
            scrape(seen, f"{verb} (broker down)", port)
        codes = run_all(
            seen,
            {
                "status (broker down)": ([*with_config, "status"], cli),
                "status --json (broker down)": ([*with_config, "status", "--json"], cli),
            },
        )
        assert codes == {
            "status (broker down)": EXIT_UNHEALTHY,
            "status --json (broker down)": EXIT_UNHEALTHY,
        }
        secret_servers.valkey.start()

        # PostgreSQL gone mid-run: every process's transactions fail. (A
        # refused connection at start, and /healthz's 503, are the next test's.)
        before = counts(running)
        secret_servers.postgres.kill()
        wait_for_more_problems(running, before, "the database out of reach")
        for verb, port in ports.items():
            scrape(seen, f"{verb} (database down)", port)
        assert run_all(seen, {"status (database down)": ([*with_config, "status"], cli)}) == {
            "status (database down)": EXIT_FAILURE
        }
        secret_servers.postgres.start()
        # Each process is still there and recovers, and stops as it should.
        for verb, port in ports.items():
            wait_for(
                health_is(port, 200),
                timeout_s=60,
                what=f"{verb} healthy again",
            )
        for proc in running:
            assert proc.terminate() == EXIT_OK, proc.raw_log()[-3000:]
        # The worker's line for the failed first attempt carries the
        # handler's error through the redaction: the URL is there, its
        # password masked.
        retried = running[2].events("todo_attempt_failed")
        assert retried, running[2].raw_log()[-3000:]
        assert "cannot connect to redis://default:***@" in str(retried[0].get("error"))
    finally:
        procs.kill_all()
        for proc in procs.all:
            seen.add(f"log of {proc.log_path.name}", proc.raw_log())
    seen.assert_no_secret()


def test_refused_and_unreachable_logins_and_bad_urls_show_no_password(
    secret_servers: Servers, tmp_path: Path
) -> None:
    seen = Sightings()
    good_db = secret_servers.database_url
    wrong_db = make_url(good_db).set(username="other").render_as_string(hide_password=False)
    nowhere_db = make_url(good_db).set(port=free_port()).render_as_string(hide_password=False)
    wrong_redis = secret_servers.redis_url(user="other")
    nowhere_redis = f"redis://default:{SECRET}@127.0.0.1:{free_port()}/0"  # nothing listens there

    def config(name: str, database: str, broker: str) -> Path:
        path = write_config(
            tmp_path / f"{name}.toml",
            database_url=database,
            redis_url=broker,
            adapters=[stream_adapter(STREAM, url=broker)],
            queues={STREAM: {"handler": "tests.support.handlers:scripted"}},
        )
        # As a config written for the dramatiq relay has it: accepted and
        # ignored, its notice naming the key, never the URL.
        with path.open("a") as f:
            f.write(f'\n[dramatiq]\nurl = "{broker}"\n')
        return path

    wrong_db_config = config("wrong-db", wrong_db, secret_servers.redis_url())
    nowhere_db_config = config("nowhere-db", nowhere_db, secret_servers.redis_url())
    wrong_redis_config = config("wrong-redis", good_db, wrong_redis)
    nowhere_redis_config = config("nowhere-redis", good_db, nowhere_redis)
    bad_port = f"redis://default:{SECRET}@127.0.0.1:notaport/0"
    codes = run_all(
        seen,
        {
            "status (wrong db password)": (["--config", str(wrong_db_config), "status"], {}),
            "migrate (wrong db password)": (["--config", str(wrong_db_config), "migrate"], {}),
            "trace (database unreachable)": (["trace", "1-0"], {"SWITCHBOARD_DATABASE_URL": nowhere_db}),
            "status --json (wrong redis password)": (
                ["--config", str(wrong_redis_config), "status", "--json"], {}),
            "status (redis unreachable)": (["--config", str(nowhere_redis_config), "status"], {}),
            "ingest (a redis url the config refuses)": (
                ["--config", str(wrong_db_config), "ingest"], {"SWITCHBOARD_REDIS_URL": bad_port}),
            "status (a database url the config refuses)": (
                ["status"], {"SWITCHBOARD_DATABASE_URL": f"postgresql://u:{SECRET}@127.0.0.1:port/x"}),
        },
    )  # fmt: skip
    assert codes == {
        "status (wrong db password)": EXIT_DATABASE,
        "migrate (wrong db password)": EXIT_DATABASE,
        "trace (database unreachable)": EXIT_FAILURE,
        "status --json (wrong redis password)": EXIT_UNHEALTHY,
        "status (redis unreachable)": EXIT_UNHEALTHY,
        "ingest (a redis url the config refuses)": EXIT_CONFIG,
        "status (a database url the config refuses)": EXIT_CONFIG,
    }
    assert "the database refused the password" in seen.text("status (wrong db password)")
    assert "invalid username-password pair" in seen.text("status --json (wrong redis password)")
    procs = Processes(tmp_path)
    try:
        # The processes that end by themselves: a refused login is exit 3.
        for verb in ("ingest", "ack"):
            proc = procs.start(verb, wrong_db_config, name=f"{verb}-wrong-db")
            assert proc.wait(120) == EXIT_DATABASE, proc.raw_log()[-3000:]
        # The ones that retry until stopped, logging each failure. (A broker
        # that does not answer was the test above's: Valkey killed.)
        metrics_port = free_port()
        retrying = [
            procs.start("ingest", nowhere_db_config, name="ingest-nowhere-db",
                        env={"SWITCHBOARD_METRICS_PORT": str(metrics_port)}),
            procs.start("ingest", wrong_redis_config, name="ingest-wrong-redis"),
            # Its broker is the database: the refused login is its claims'.
            procs.start("worker", wrong_db_config, name="worker-wrong-db"),
        ]  # fmt: skip
        for proc in retrying:
            wait_for(logged_problems(proc), timeout_s=90, what=f"{proc.log_path.name}: its failure")
        # The refusal is what they logged, not just any trouble.
        for proc, refusal in zip(
            retrying[1:], ("username-password", "password authentication failed"), strict=True
        ):
            assert any(refusal in json.dumps(line) for line in problems(proc)), proc.raw_log()[-3000:]
        # Never answered: 503 at once, its body saying why.
        wait_for(health_is(metrics_port, 503), timeout_s=30, what="/healthz to say 503")
        scrape(seen, "ingest (database unreachable)", metrics_port)
        for proc in retrying:
            assert proc.alive(), f"{proc.log_path.name} ended: {proc.raw_log()[-3000:]}"
            assert proc.terminate() == EXIT_OK, proc.raw_log()[-3000:]
        # Each said it ignores the relay's key (and showed no URL: below).
        assert all(proc.events("config_key_ignored") for proc in procs.all)
    finally:
        procs.kill_all()
        for proc in procs.all:
            seen.add(f"log of {proc.log_path.name}", proc.raw_log())
    seen.assert_no_secret()
