"""Every failure a user can cause, through the real CLI: one line that says
what is wrong and what to do, a non-zero exit, no traceback, no password."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from sqlalchemy.engine import make_url

from ingest.embedded.servers import PostgresServer, free_port, temp_base
from ingest.exit_codes import EXIT_CONFIG, EXIT_DATABASE, EXIT_FAILURE
from tests.support import db
from tests.support.config import stream_adapter, write_config
from tests.support.processes import SECRET, error_lines, switchboard
from tests.support.servers import ServerUrls

pytestmark = pytest.mark.system

# Each verb that talks to the database and ends by itself, with arguments.
SHORT_VERBS = [
    ("migrate",),
    ("status",),
    ("adapters", "list"),
    ("adapters", "enable", "orders"),
    ("inbox", "list"),
    ("inbox", "replay", "1"),
]
VERB_IDS = [" ".join(v) for v in SHORT_VERBS]


def one_line(result: subprocess.CompletedProcess[str]) -> str:
    """The whole of stderr is one line (besides asyncio's dev-mode timing
    warnings); nothing anywhere shows the secret."""
    lines = error_lines(result)
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert SECRET not in result.stderr + result.stdout
    return lines[0]


def with_password(url: str, password: str = SECRET) -> str:
    return make_url(url).set(password=password).render_as_string(hide_password=False)


@pytest.mark.parametrize("verb", SHORT_VERBS, ids=VERB_IDS)
def test_an_unreachable_database(verb: tuple[str, ...]) -> None:
    port = free_port()  # nothing listens there
    url = f"postgresql://sb:{SECRET}@127.0.0.1:{port}/switchboard"
    result = switchboard(*verb, env={"SWITCHBOARD_DATABASE_URL": url})
    assert result.returncode == EXIT_FAILURE
    line = one_line(result)
    assert line == (
        f"switchboard {verb[0]}: cannot reach the database 'switchboard' at 127.0.0.1:{port} as user 'sb'"
        " (from SWITCHBOARD_DATABASE_URL): connection refused (is PostgreSQL running there, on that port?)"
    )


def test_an_unknown_database_host(tmp_path: Path) -> None:
    config = tmp_path / "switchboard.toml"
    config.write_text(f'[database]\nurl = "postgresql://sb:{SECRET}@no-such-host.invalid/switchboard"\n')
    result = switchboard("--config", str(config), "status")
    assert result.returncode == EXIT_FAILURE
    line = one_line(result)
    assert "at no-such-host.invalid:5432" in line
    assert "(from [database] url)" in line
    assert "host name not found" in line


@pytest.mark.parametrize("verb", SHORT_VERBS, ids=VERB_IDS)
def test_a_database_that_does_not_exist(servers: ServerUrls, verb: tuple[str, ...]) -> None:
    url = with_password(make_url(servers.database).set(database="no_such_db_here").render_as_string(False))
    result = switchboard(*verb, env={"SWITCHBOARD_DATABASE_URL": url})
    assert result.returncode == EXIT_DATABASE
    line = one_line(result)
    assert line.startswith(f"switchboard {verb[0]}: the database named in the database URL does not exist")
    assert "then run `switchboard migrate`" in line
    assert "database 'no_such_db_here' at" in line


@pytest.fixture(scope="module")
def unmigrated_url(servers: ServerUrls) -> Iterator[str]:
    url = db.create_test_database(servers.database, migrated=False)
    yield url
    db.drop_test_database(servers.database, url)


@pytest.mark.parametrize("verb", [v for v in SHORT_VERBS if v != ("migrate",)], ids=VERB_IDS[1:])
def test_a_database_that_is_not_migrated(unmigrated_url: str, verb: tuple[str, ...]) -> None:
    result = switchboard(*verb, env={"SWITCHBOARD_DATABASE_URL": with_password(unmigrated_url)})
    assert result.returncode == EXIT_DATABASE
    line = one_line(result)
    assert line.startswith(f"switchboard {verb[0]}: the database has no Switchboard tables")
    assert "run `switchboard migrate`" in line


@pytest.fixture(scope="module")
def password_server() -> Iterator[PostgresServer]:
    """A PostgreSQL of our own where the role ``pwuser`` must give its password
    (the suite's servers trust every local login)."""
    base = temp_base("switchboard-pg-auth-")
    try:
        server = PostgresServer.create(base / "pg")
        try:
            server.start()
            hba = server.pgdata / "pg_hba.conf"
            hba.write_text("host all pwuser 127.0.0.1/32 scram-sha-256\n" + hba.read_text())
            with psycopg.connect(server.url().replace("+psycopg", ""), autocommit=True) as conn:
                conn.execute("CREATE ROLE pwuser LOGIN PASSWORD 'the-right-one'")
                conn.execute("SELECT pg_reload_conf()")
            yield server
        finally:
            server.cleanup()
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.parametrize("verb", SHORT_VERBS, ids=VERB_IDS)
def test_a_wrong_password(password_server: PostgresServer, verb: tuple[str, ...]) -> None:
    url = f"postgresql://pwuser:{SECRET}@127.0.0.1:{password_server.port}/postgres"
    result = switchboard(*verb, env={"SWITCHBOARD_DATABASE_URL": url})
    assert result.returncode == EXIT_DATABASE
    line = one_line(result)
    assert line.startswith(f"switchboard {verb[0]}: the database refused the password")
    assert "as user 'pwuser'" in line


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("inbox", "list", "--limit", "-5"), "argument --limit: must be a positive integer (got '-5')"),
        (("inbox", "list", "--limit", "many"), "argument --limit: must be a positive integer (got 'many')"),
        (("inbox", "replay", "0"), "argument ID: must be a positive integer (got '0')"),
        (("adapters", "enable"), "the following arguments are required: name"),
        (("frobnicate",), "invalid choice: 'frobnicate'"),
        ((), "the following arguments are required: COMMAND"),
    ],
)
def test_bad_arguments(args: tuple[str, ...], needle: str) -> None:
    result = switchboard(*args)
    assert result.returncode == EXIT_CONFIG
    line = one_line(result)
    assert needle in line
    assert line.endswith("--help`)")


def test_help_cites_no_missing_file() -> None:
    result = switchboard("--help")
    assert result.returncode == 0
    assert "DESIGN.md" not in result.stdout
    assert "exit codes" in result.stdout


def test_config_is_a_directory(tmp_path: Path) -> None:
    for verb in (("status",), ("ingest",)):
        result = switchboard("--config", str(tmp_path), *verb)
        assert result.returncode == EXIT_CONFIG
        (line,) = [line for line in error_lines(result) if line.startswith("switchboard")]
        expected = f"config file {str(tmp_path)!r} is a directory: give --config the TOML file itself"
        assert line == f"switchboard: config error: {expected}"


BAD_DB = f"postgresql://u:S3cr@tPart2{SECRET}@db.example/switchboard"
BAD_REDIS = f"redis://default:pa/ss{SECRET}@cache.example:6379/0"
ENCODE = "a reserved character in the password must be percent-encoded (@ as %40, / as %2F"


@pytest.mark.parametrize(
    ("database", "redis", "env", "message"),
    [
        (f"mysql://u:{SECRET}@db/x", None, {}, "[database]: key 'url' must be a PostgreSQL URL"),
        (BAD_DB, None, {}, f"[database]: key 'url' is not a valid URL: {ENCODE}"),
        (
            None,
            None,
            {"SWITCHBOARD_DATABASE_URL": BAD_DB},
            f"SWITCHBOARD_DATABASE_URL is not a valid URL: {ENCODE}",
        ),
        (
            "postgresql://u@db/x",
            BAD_REDIS,
            {},
            "[redis]: key 'url' is not a valid URL: has a port that is not",
        ),
        (
            "postgresql://u@db/x",
            None,
            {"SWITCHBOARD_REDIS_URL": BAD_REDIS},
            "SWITCHBOARD_REDIS_URL is not a valid URL: has a port that is not a number, or " + ENCODE,
        ),
        (
            "postgresql://u@db/x",
            None,
            {"SWITCHBOARD_REDIS_URL": "http://cache:6379"},
            "SWITCHBOARD_REDIS_URL must be a redis://, rediss:// or unix:// URL",
        ),
    ],
    ids=["mysql", "db-at-sign", "db-env", "redis-key", "redis-env", "redis-env-scheme"],
)
@pytest.mark.parametrize("verb", ["status", "ingest", "ack", "migrate"])
def test_bad_urls_are_config_errors_that_never_echo_them(
    tmp_path: Path, database: str | None, redis: str | None, env: dict[str, str], message: str, verb: str
) -> None:
    text = f'[database]\nurl = "{database}"\n' if database else ""
    text += f'[redis]\nurl = "{redis}"\n' if redis else ""
    text += '[[adapters]]\nname = "orders"\nsource = "orders"\n'
    config = tmp_path / "switchboard.toml"
    config.write_text(text)
    result = switchboard("--config", str(config), verb, env=env)
    assert result.returncode == EXIT_CONFIG
    out = result.stderr + result.stdout
    for piece in ("S3cr", "tPart2", "pa/ss", "pa", SECRET):
        assert f":{piece}" not in out
        assert f"'{piece}" not in out
    assert SECRET not in out
    assert "Traceback" not in out
    (line,) = [line for line in error_lines(result) if line.startswith("switchboard")]
    assert line.startswith(f"switchboard: config error: {message}")


def test_replay_errors_name_the_row_once(db_url: str, tmp_path: Path, redis_url: str) -> None:
    config = write_config(
        tmp_path / "switchboard.toml", database_url=db_url, redis_url=redis_url, adapters=[stream_adapter()]
    )
    result = switchboard("--config", str(config), "inbox", "replay", "7")
    assert result.returncode == EXIT_FAILURE
    assert one_line(result) == "switchboard inbox: inbox row 7 does not exist"


@pytest.mark.parametrize(
    ("queue", "args", "message"),
    [
        (
            {"handler": "nope_such_module:handle"},
            (),
            "[queues.orders]: key 'handler': cannot import 'nope_such_module': ModuleNotFoundError",
        ),
        ({"handler": "json:no_such_function"}, (), "[queues.orders]: key 'handler': 'json' has no"),
        ({"handler": "json:loads"}, ("--queues", "other"), "--queues: no [queues.other] in the config"),
    ],
)
def test_worker_config_errors_stop_it_at_once(
    tmp_path: Path, queue: dict[str, str], args: tuple[str, ...], message: str
) -> None:
    """Before any worker process starts: one line, exit 2 (a supervisor does
    not restart it, see ops/systemd)."""
    config = write_config(
        tmp_path / "switchboard.toml",
        database_url="postgresql://sb@127.0.0.1:1/sb",
        redis_url="redis://127.0.0.1:1/0",
        adapters=[],
        queues={"orders": queue},
    )
    result = switchboard("--config", str(config), "worker", *args)
    assert result.returncode == EXIT_CONFIG, result.stderr
    # Its stderr is a log (JSON lines) around the one line for people.
    assert "Traceback" not in result.stderr
    (line,) = [line for line in error_lines(result) if line.startswith("switchboard")]
    assert line.startswith(f"switchboard worker: config error: {message}")
    if "cannot import" in message:  # and how to make it importable (issue 24)
        assert "PYTHONPATH" in line
        assert "pip install" in line
