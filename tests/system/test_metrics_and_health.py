"""Issue 14: the real `switchboard ingest`, `ack` and `worker` export
Prometheus metrics and /healthz on their ports, and `switchboard status`
says which of them are alive. Every figure scraped is checked against what
reached PostgreSQL and Redis."""

from __future__ import annotations

import json
import signal
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from backhalf.housekeeping.heartbeats import HEARTBEAT_TTL_S
from ingest.embedded.processes import SwitchboardProcess, wait_for
from ingest.embedded.servers import PostgresServer
from ingest.exit_codes import EXIT_OK, EXIT_UNHEALTHY
from ingest.observe.metrics_http import HEAD_TIMEOUT_S, MAX_CONNECTIONS
from tests.support import handlers
from tests.support.config import stream_adapter, write_config
from tests.support.db import libpq, query, scalar
from tests.support.downstream import QUEUE, SHORT_LEASE, assert_one_path, statuses, stop_all, trail
from tests.support.processes import (
    Processes,
    assert_clean_exit,
    switchboard,
    with_secret_db,
    with_secret_redis,
)
from tests.support.trickle import Tricklers

pytestmark = pytest.mark.system
STREAM = "orders"
HTTP_TIMEOUT_S = 5.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample, by name and labels."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=HTTP_TIMEOUT_S) as reply:
        text = reply.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def sample(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def healthz(port: int) -> tuple[int, dict[str, object]]:
    """The status and body; (0, {}) while nothing listens."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=HTTP_TIMEOUT_S) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())
    except (urllib.error.URLError, ConnectionError):
        # Nothing listens yet, or `worker` checking the port is free (it
        # binds and closes it before dramatiq starts).
        return 0, {}


def test_each_process_exports_what_reached_postgresql_and_redis(
    procs: Processes, make_config: Callable[..., Path], db_url: str, redis_url: str, runs_db: str
) -> None:
    config = make_config(stream_adapter(STREAM, batch_size=20), queues={STREAM: QUEUE})
    ports = {verb: free_port() for verb in ("ingest", "ack", "worker")}
    running: list[SwitchboardProcess] = [
        procs.start(verb, config, name=f"{verb}-1", env={"SWITCHBOARD_METRICS_PORT": str(port)})
        for verb, port in ports.items()
    ]
    for verb, port in ports.items():
        # The worker's endpoint is a process dramatiq starts once its
        # workers are up: it may be a moment behind them.
        def healthy(port: int = port) -> bool:
            return healthz(port)[0] == 200

        wait_for(healthy, timeout_s=60, what=f"{verb}'s /healthz")
        code, body = healthz(port)
        assert (code, body["status"]) == (200, "ok"), (verb, body)

    # Scraped while they work: a counter never runs ahead of what
    # PostgreSQL holds (each is counted after its commit), nor goes back.
    bodies = [json.dumps({"n": i}) for i in range(48)] + ["{not json", "[1, 2"]
    last: dict[str, float] = {}
    with redis.Redis.from_url(redis_url, socket_timeout=10) as r:
        for chunk in range(5):
            for text in bodies[chunk * 10 : chunk * 10 + 10]:
                r.xadd(STREAM, {"body": text})

            # The counter moves while the ingester works (not only at the end).
            def counted(n: int = chunk * 10 + 10) -> bool:
                return (
                    sample(scrape(ports["ingest"]), "switchboard_messages_stored_total", adapter=STREAM) >= n
                )

            wait_for(
                counted,
                timeout_s=30,
                what=f"{chunk * 10 + 10} stored by the metrics",
            )
            stored_now = scrape(ports["ingest"])
            figures = {
                "stored": sample(stored_now, "switchboard_messages_stored_total", adapter=STREAM),
                "acked": sample(scrape(ports["ack"]), "switchboard_acks_total", adapter=STREAM),
                "done": sample(
                    scrape(ports["worker"]), "switchboard_todos_finished_total", queue=STREAM, status="done"
                ),
            }
            in_db = {
                "stored": scalar(db_url, "SELECT count(*) FROM inbox"),
                "acked": scalar(db_url, "SELECT count(*) FROM inbox WHERE ack_state = 'acked'"),
                "done": scalar(db_url, "SELECT count(*) FROM todos WHERE status = 'done'"),
            }
            for name, value in figures.items():
                assert last.get(name, 0.0) <= value <= in_db[name], (chunk, name, value, in_db)
            last = figures
    wait_for(lambda: statuses(db_url) == {"done": 48}, timeout_s=90, what="48 todos done")
    wait_for(
        lambda: scalar(db_url, "SELECT count(*) FROM inbox WHERE ack_state = 'acked'") == 50,
        timeout_s=30,
        what="every entry acked",
    )

    ingest = scrape(ports["ingest"])
    stored = scalar(db_url, "SELECT count(*) FROM inbox")
    assert stored == 50
    assert sample(ingest, "switchboard_messages_consumed_total", adapter=STREAM) == 50
    assert sample(ingest, "switchboard_messages_stored_total", adapter=STREAM) == stored
    rejected = scalar(db_url, "SELECT count(*) FROM inbox WHERE status = 'rejected'")
    assert rejected == 2
    assert sample(ingest, "switchboard_messages_rejected_total", adapter=STREAM, reason="invalid_json") == 2
    assert sample(ingest, "switchboard_todos_created_total", adapter=STREAM) == scalar(
        db_url, "SELECT count(*) FROM todos"
    )
    assert sample(ingest, "switchboard_store_batch_size_sum", adapter=STREAM) == 50
    # 50 entries in batches of at most 20: three stores at least.
    assert sample(ingest, "switchboard_store_duration_seconds_count", adapter=STREAM) >= 3

    # The broker gauges are read every refresh_interval_ms: once the acker
    # has acked everything, the PEL they report is Redis's own, 0.
    with redis.Redis.from_url(redis_url, socket_timeout=10) as r:
        xlen = r.xlen(STREAM)
        pel = r.xpending(STREAM, "switchboard")["pending"]
    assert pel == 0
    wait_for(
        lambda: (
            (
                sample(scrape(ports["ingest"]), "switchboard_broker_stream_length", adapter=STREAM),
                sample(scrape(ports["ingest"]), "switchboard_broker_pending_entries", adapter=STREAM),
            )
            == (xlen, 0)
        ),
        timeout_s=30,
        what="the broker gauges at XLEN and an empty PEL",
    )
    assert sample(scrape(ports["ingest"]), "switchboard_adapter_enabled", adapter=STREAM) == 1

    acker = scrape(ports["ack"])
    assert sample(acker, "switchboard_acks_total", adapter=STREAM) == 50
    # No relay: the acker dispatches nothing (the workers claim from PostgreSQL).
    assert not [name for name, _ in acker if name.startswith("switchboard_todos_dispatched")]
    wait_for(
        lambda: (
            sample(scrape(ports["ack"]), "switchboard_pending_acks", adapter=STREAM) == 0
            and sample(scrape(ports["ack"]), "switchboard_todos", queue=STREAM, status="pending") == 0
        ),
        timeout_s=30,
        what="the backlog gauges at 0",
    )

    worker = scrape(ports["worker"])
    done = scalar(db_url, "SELECT count(*) FROM todos WHERE status = 'done'")
    assert sample(worker, "switchboard_todos_finished_total", queue=STREAM, status="done") == done == 48
    claimed = scalar(db_url, "SELECT count(*) FROM todo_events WHERE to_status = 'running'")
    assert sample(worker, "switchboard_todos_claimed_total", queue=STREAM) == claimed == 48
    assert sample(worker, "switchboard_todo_run_duration_seconds_count", queue=STREAM) == scalar(
        runs_db, "SELECT count(*) FROM handler_runs WHERE outcome <> 'started'"
    )
    stop_all(running)


def test_status_names_a_dead_ingester_until_a_new_one_replaces_it(
    procs: Processes, make_config: Callable[..., Path], db_url: str, redis_url: str
) -> None:
    config = make_config(stream_adapter(STREAM))
    ingester = procs.start("ingest", config, name="ingest-1")
    acker = procs.start("ack", config, name="ack-1")
    wait_for(
        lambda: scalar(db_url, "SELECT count(*) FROM processes WHERE stopped_at IS NULL") == 2,
        timeout_s=30,
        what="two heartbeat rows",
    )
    alive = switchboard("--config", str(config), "status", "--json")
    assert alive.returncode == EXIT_OK, alive.stderr
    served = json.loads(alive.stdout)[0]["processes"]
    assert len(served["ingest"]) == 1
    assert len(served["ack"]) == 1
    assert served["dead"] == []

    def status_now() -> tuple[int, str]:
        result = switchboard("--config", str(config), "status")
        return result.returncode, result.stdout

    ingester.kill()  # SIGKILL: no stop is recorded, the row goes silent
    ingester.wait(30)
    assert status_now()[0] == EXIT_OK  # silent for less than the TTL: not dead yet
    # The TTL's 15 s, passed at once: the dead row's clock moved back (the
    # live acker's is refreshed by its next beat anyway).
    query(
        db_url,
        "UPDATE processes SET seen_at = seen_at - make_interval(secs => %(s)s),"
        " started_at = started_at - make_interval(secs => %(s)s) WHERE role = 'ingest'",
        {"s": HEARTBEAT_TTL_S + 1},
    )

    code, text = wait_for(
        lambda: result if (result := status_now())[0] == EXIT_UNHEALTHY else None,
        timeout_s=40,
        what="status to see the dead ingester",
    )
    assert code == EXIT_UNHEALTHY
    assert "DEAD" in text
    assert f"{STREAM} (stream {STREAM}): UNHEALTHY" in text
    # Restarted on its host (as systemd would): the new one replaces it.
    replacement = procs.start("ingest", config, name="ingest-1")
    wait_for(lambda: status_now()[0] == EXIT_OK, timeout_s=40, what="status healthy again")
    assert scalar(db_url, "SELECT count(*) FROM processes WHERE role = 'ingest'") == 2
    stop_all([replacement, acker])
    # A graceful stop is recorded: stopped, not dead, and shown as such.
    assert scalar(db_url, "SELECT count(*) FROM processes WHERE stopped_at IS NULL") == 1  # the killed one
    code, text = status_now()
    assert code == EXIT_OK
    assert "not running            no ack, no ingest process alive" in text
    assert "DEAD" not in text  # the killed one was replaced, the others stopped


def test_a_metrics_port_in_use_is_a_config_error(procs: Processes, make_config: Callable[..., Path]) -> None:
    config = make_config(stream_adapter(STREAM))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = switchboard("--config", str(config), "ingest", "--metrics-port", str(port))
    assert result.returncode == 2
    assert "in use" in result.stderr


# Issue 32: what a probe may take with slow clients connected, and what the
# ingester's stop may take with them (it exits in about a second without).
PROBE_BOUND_S = 6.0
STOP_BOUND_S = 10.0


def test_slow_clients_neither_starve_healthz_nor_hold_the_process_at_sigterm(
    procs: Processes, make_config: Callable[..., Path]
) -> None:
    """Trickling clients (a byte of a request head every half second, never
    its end, reconnecting when cut) on every slot, from the probe's own
    address and another: /healthz is answered within the bound, again and
    again, and SIGTERM ends the ingester within its bound. Before, eight of
    them made every probe fail and kept the ingester alive as long as they
    trickled."""
    port = free_port()
    config = make_config(stream_adapter(STREAM))
    ingester = procs.start("ingest", config, name="ingest-1", env={"SWITCHBOARD_METRICS_PORT": str(port)})
    wait_for(lambda: healthz(port)[0] == 200, timeout_s=60, what="the ingester's /healthz")
    with Tricklers(port, 2 * MAX_CONNECTIONS, sources=("127.0.0.1", "127.0.0.2")) as crowd:
        wait_for(lambda: crowd.open_now() >= MAX_CONNECTIONS, timeout_s=10, what="the slow clients in")
        # Probes over more than two head deadlines: the crowd is cut and back meanwhile.
        until = time.monotonic() + 2 * HEAD_TIMEOUT_S + 1
        probes = 0
        while time.monotonic() < until:
            start = time.monotonic()
            code, body = healthz(port)
            took = time.monotonic() - start
            assert (code, body.get("status")) == (200, "ok"), (code, body, took)
            assert took < PROBE_BOUND_S
            probes += 1
            time.sleep(0.2)
        assert probes >= 10
        assert crowd.cuts > 0  # they were there, and kept coming back
        start = time.monotonic()
        ingester.signal(signal.SIGTERM)
        code = ingester.wait(timeout_s=STOP_BOUND_S)  # raises if it outlives the bound
        stopped_in = time.monotonic() - start
    assert_clean_exit(ingester, code)  # no request thread left behind either
    assert stopped_in < STOP_BOUND_S


def test_a_config_written_for_the_relay_runs_and_says_what_it_ignores(
    procs: Processes, make_config: Callable[..., Path], db_url: str, redis_url: str, runs_db: str
) -> None:
    """Issue 42: the keys of the dramatiq relay (`[dramatiq] url`, here with a
    password Redis refuses, `[acker]` dispatch keys, `[queues.*]
    lease_margin_ms`) are accepted and ignored, one notice each, by every
    process: nothing connects to that broker, the todos are done, /healthz
    says ok and `status` is healthy; no password anywhere."""
    parts = urlsplit(redis_url)
    wrong = f"redis://default:not-the-password@{parts.hostname}:{parts.port}/1"
    config = make_config(
        stream_adapter(STREAM),
        queues={STREAM: QUEUE},
        acker={"dispatch_batch_size": 100, "dispatch_timeout_ms": 300000},
    )
    text = config.read_text().replace(f"[queues.{STREAM}]\n", f"[queues.{STREAM}]\nlease_margin_ms = 2000\n")
    config.write_text(f'{text}\n[dramatiq]\nurl = "{wrong}"\n')
    retired = [
        ("[dramatiq]", "url"),
        ("[acker]", "dispatch_batch_size"),
        ("[acker]", "dispatch_timeout_ms"),
        (f"[queues.{STREAM}]", "lease_margin_ms"),
    ]
    with redis.Redis.from_url(redis_url, socket_timeout=10) as r:
        r.acl_log_reset()  # a login refused from now on is this test's processes'
        for i in range(10):
            r.xadd(STREAM, {"body": json.dumps({"n": i})})
    ports = {verb: free_port() for verb in ("ack", "worker")}
    running = [
        procs.start("ingest", config, name="ingest-1"),
        *(
            procs.start(v, config, name=f"{v}-1", env={"SWITCHBOARD_METRICS_PORT": str(p)})
            for v, p in ports.items()
        ),
    ]
    wait_for(lambda: statuses(db_url) == {"done": 10}, timeout_s=60, what="10 todos done")
    for verb, port in ports.items():

        def healthy(port: int = port) -> bool:
            return healthz(port)[0] == 200

        wait_for(healthy, timeout_s=60, what=f"{verb}'s /healthz")
        assert "failing" not in healthz(port)[1], verb
    shown = switchboard("--config", str(config), "status")
    assert shown.returncode == EXIT_OK, shown.stdout + shown.stderr
    assert "FAILING" not in shown.stdout
    for proc in running:
        notices = [e["notice"] for e in proc.events("config_key_ignored")]
        assert [(n.split(": key ")[0], n.split("'")[1]) for n in notices] == retired, (proc.verb, notices)
        assert all("is no longer used and is ignored" in n for n in notices)
    stop_all(running)
    for text in (procs.logs_text(), shown.stdout + shown.stderr):
        assert "not-the-password" not in text
    # Nothing tried to log in with the relay's URL.
    with redis.Redis.from_url(redis_url, socket_timeout=10) as r:
        assert [e for e in r.acl_log(count=128) if e["reason"] == "auth"] == []


def test_postgresql_restarted_under_a_running_worker(
    procs: Processes, tmp_path: Path, own_postgres: tuple[PostgresServer, str], redis_url: str
) -> None:
    """PostgreSQL stopped and started again under a worker that is idle and
    listening: its claims fail and back off, its /healthz answers 503 while
    the database is down; once it is back the worker resumes claiming (its
    LISTEN connection made anew) and drains the todos stored since, its
    /healthz is ok again and `status` shows it alive, nothing dead. The
    same process throughout; killed -9 at the end, its metrics process goes
    with it."""
    pg, url = own_postgres
    runs_url = libpq(url)
    handlers.create_runs_table(runs_url)
    config = write_config(
        tmp_path / "switchboard.toml",
        database_url=with_secret_db(url),
        redis_url=with_secret_redis(redis_url),
        adapters=[stream_adapter(STREAM, batch_size=50)],
        queues={STREAM: QUEUE},
        worker=SHORT_LEASE,
    )
    port = free_port()
    ingester = procs.start("ingest", config, name="ingest-1")
    worker = procs.start(
        "worker",
        config,
        name="worker-1",
        env={"SWITCHBOARD_METRICS_PORT": str(port), handlers.DB_VARIABLE: runs_url},
        args=["--processes", "1"],
    )
    with redis.Redis.from_url(redis_url, socket_timeout=10) as r:
        for i in range(10):
            r.xadd(STREAM, {"body": json.dumps({"n": i})})
    wait_for(lambda: statuses(url) == {"done": 10}, timeout_s=60, what="the first 10 todos done")
    wait_for(lambda: healthz(port)[0] == 200, timeout_s=60, what="the workers' /healthz")

    pg.stop(mode="fast")
    wait_for(lambda: worker.events("todo_claim_failed"), timeout_s=30, what="the worker's claims failing")
    wait_for(lambda: healthz(port)[0] == 503, timeout_s=30, what="the workers' /healthz unhealthy")
    assert healthz(port)[1]["database"] == {"ok": False, "error": "OperationalError"}
    with redis.Redis.from_url(redis_url, socket_timeout=10) as r:
        for i in range(10, 30):
            r.xadd(STREAM, {"body": json.dumps({"n": i})})
    assert worker.alive()
    pg.start()

    wait_for(lambda: statuses(url) == {"done": 30}, timeout_s=90, what="the 20 stored since done")
    assert worker.alive()
    # The same claimer resumed: dramatiq's consumer never failed (and was
    # not restarted, with a claimer anew, after a critical line).
    assert worker.events("todo_claims_resumed")
    assert [e for e in worker.logs() if e.get("level") == "critical"] == []
    wait_for(lambda: healthz(port)[0] == 200, timeout_s=60, what="the workers' /healthz ok again")

    def worker_alive_in_status() -> bool:
        shown = switchboard("--config", str(config), "status", "--json")
        served = json.loads(shown.stdout)[0]["processes"] if shown.returncode == EXIT_OK else {}
        return len(served.get("worker", [])) == 1 and served.get("dead") == []

    wait_for(worker_alive_in_status, timeout_s=60, what="status: the worker alive, nothing dead")
    done = dict(query(url, "SELECT todo_id, count(*) FROM handler_runs WHERE outcome = 'done' GROUP BY 1"))
    assert set(done) == {int(i) for (i,) in query(url, "SELECT id FROM todos")}
    assert set(done.values()) == {1}  # nothing ran while the database was down
    for (todo_id,) in query(url, "SELECT id FROM todos"):
        assert_one_path(trail(url, todo_id))
    assert_clean_exit(ingester, ingester.terminate())
    # dramatiq's main process killed outright: its metrics process goes with
    # it (it was left serving the port alone).
    worker.kill()
    wait_for(lambda: healthz(port) == (0, {}), timeout_s=30, what="the workers' endpoint gone with them")
    procs.assert_no_secret_logged()
