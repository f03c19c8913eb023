"""The receiver under real faults: PostgreSQL stopped, the receiver killed
-9 between its commit and its answer, SIGTERM with a request in flight; and
the same event pushed and pulled makes todos of one shape."""

from __future__ import annotations

import http.client
import json
import signal
import socket
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import redis

from ingest.embedded.processes import wait_for
from ingest.embedded.servers import PostgresServer, free_port
from tests.support.config import stream_adapter, write_config
from tests.support.db import query, scalar
from tests.support.processes import (
    Processes,
    assert_clean_exit,
    switchboard,
    with_secret_db,
    with_secret_redis,
)
from tests.support.proxy import proxy_to
from tests.support.roles import migrate_and_grant, role_database
from tests.support.servers import ServerUrls
from tests.support.webhooks import STANDARD_SECRET, post, receiver_config, standard_headers, wait_listening
from tests.system.test_network_faults import db_port

pytestmark = pytest.mark.system

HOOK = {"name": "billing", "transport": "webhook", "secrets_env": ["BILLING_WHSEC"], "queue": "billing"}
ENV = {"BILLING_WHSEC": STANDARD_SECRET}


def _delivery(n: int) -> tuple[bytes, dict[str, str]]:
    body = json.dumps({"type": "invoice.paid", "invoice": n}).encode()
    return body, standard_headers(STANDARD_SECRET, f"msg_{n}", body)


def test_database_stopped_is_503_and_the_retry_after_it_returns_makes_one_todo(
    procs: Processes, tmp_path: Path, own_postgres: tuple[PostgresServer, str]
) -> None:
    pg, db_url = own_postgres
    config, port = receiver_config(
        tmp_path / "receive.toml",
        with_secret_db(db_url),
        [HOOK],
        respond_within_ms=3000,
        body_timeout_ms=1000,
    )
    receiver = procs.start("receive", config, name="receiver-1", env=ENV)
    wait_listening(receiver)
    body, headers = _delivery(1)
    assert post(port, "/hooks/billing", body, headers).status == 200
    pg.stop(mode="immediate")
    body, headers = _delivery(2)
    down = post(port, "/hooks/billing", body, headers)
    assert down.status == 503, down.body
    assert down.headers["retry-after"].isdigit()
    assert receiver.alive()
    pg.start()
    # The sender retries until it is answered 200 (its schedule, compressed).
    wait_for(
        lambda: post(port, "/hooks/billing", body, headers).status == 200,
        timeout_s=60,
        interval_s=0.5,
        what="a 200 once the database is back",
    )
    assert post(port, "/hooks/billing", body, headers).status == 200  # and once more: a duplicate
    assert query(db_url, "SELECT idempotency_key, count(*) FROM todos GROUP BY 1 ORDER BY 1") == [
        ("webhook:billing:msg_1", 1),
        ("webhook:billing:msg_2", 1),
    ]
    assert scalar(db_url, "SELECT count(*) FROM events") == 2
    assert receiver.events("store_failed") or receiver.events("delivery_unanswered")
    assert_clean_exit(receiver, receiver.stop())
    procs.assert_no_secret_logged()


def test_killed_between_commit_and_answer_the_retry_makes_no_second_todo(
    procs: Processes, tmp_path: Path, db_url: str
) -> None:
    config, port = receiver_config(tmp_path / "receive.toml", with_secret_db(db_url), [HOOK])
    doomed = procs.start(
        "receive", config, name="receiver-1", env=ENV, failpoints="receiver_after_commit=kill"
    )
    wait_listening(doomed)
    body, headers = _delivery(3)
    with pytest.raises((http.client.RemoteDisconnected, ConnectionResetError)):
        post(port, "/hooks/billing", body, headers)
    wait_for(lambda: not doomed.alive(), timeout_s=10, what="the kill")
    # Committed, never answered: the sender does not know, and retries.
    assert scalar(db_url, "SELECT count(*) FROM todos") == 1
    receiver = procs.start("receive", config, name="receiver-2", env=ENV)
    wait_listening(receiver)
    assert post(port, "/hooks/billing", body, headers).status == 200
    assert query(db_url, "SELECT count(*), max(deliveries) FROM inbox") == [(1, 2)]
    assert scalar(db_url, "SELECT count(*) FROM todos") == 1
    assert scalar(db_url, "SELECT count(*) FROM events") == 1
    assert_clean_exit(receiver, receiver.stop())


def test_sigterm_answers_the_request_in_flight_then_refuses_new_ones(
    procs: Processes, tmp_path: Path, db_url: str
) -> None:
    config, port = receiver_config(tmp_path / "receive.toml", with_secret_db(db_url), [HOOK])
    receiver = procs.start("receive", config, name="receiver-1", env=ENV)
    wait_listening(receiver)
    body, headers = _delivery(4)
    with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        sock.sendall(
            f"POST /hooks/billing HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n{head}\r\n".encode()
            + body[:5]
        )
        receiver.signal(signal.SIGTERM)
        wait_for(lambda: receiver.events("stop_requested"), timeout_s=10, what="the stop")
        sock.sendall(body[5:])  # the rest arrives after the stop: still answered
        reply = sock.recv(4096)
    assert reply.startswith(b"HTTP/1.1 200"), reply
    assert scalar(db_url, "SELECT count(*) FROM todos") == 1
    assert_clean_exit(receiver, receiver.wait(30))
    with pytest.raises(ConnectionRefusedError):
        post(port, "/hooks/billing", body, headers)


def test_the_same_event_pushed_and_pulled_makes_todos_of_one_shape(
    procs: Processes, tmp_path: Path, db_url: str, redis_url: str
) -> None:
    body, headers = _delivery(5)
    pull = {**stream_adapter("invoices"), "queue": "billing"}
    port_config, port = receiver_config(tmp_path / "receive.toml", with_secret_db(db_url), [HOOK])
    ingest_config = write_config(
        tmp_path / "ingest.toml",
        database_url=with_secret_db(db_url),
        redis_url=with_secret_redis(redis_url),
        adapters=[pull, HOOK],  # a config holding both: the ingester reads only the pull one
    )
    receiver = procs.start("receive", port_config, name="receiver-1", env=ENV)
    ingester = procs.start("ingest", ingest_config, name="ingester-1")
    wait_listening(receiver)
    with redis.Redis.from_url(redis_url, socket_timeout=10) as r:
        r.xadd("invoices", {"body": body})
    assert post(port, "/hooks/billing", body, headers).status == 200
    wait_for(lambda: scalar(db_url, "SELECT count(*) FROM todos") == 2, timeout_s=30, what="both todos")
    todos = query(
        db_url,
        "SELECT t.queue, t.payload, t.status, t.attempts, e.family, e.trust_mode, e.verified,"
        " t.idempotency_key FROM todos t JOIN inbox i ON i.todo_id = t.id"
        " JOIN events e ON e.id = i.event_id ORDER BY e.family",
    )
    (pushed, pulled) = todos
    assert pushed[:4] == pulled[:4] == ("billing", {"type": "invoice.paid", "invoice": 5}, "pending", 0)
    assert pushed[4:7] == ("push", "hmac-sha256", True)
    assert pulled[4:7] == ("queue", "queue", False)
    assert pushed[7] == "webhook:billing:msg_5"
    assert pulled[7].startswith("redis:invoices:")
    for proc in (receiver, ingester):
        assert_clean_exit(proc, proc.stop())


def test_a_rejected_push_delivery_is_replayed_once_its_rule_is_fixed(
    procs: Processes, tmp_path: Path, db_url: str
) -> None:
    schema = tmp_path / "invoice.schema.json"
    schema.write_text(json.dumps({"type": "object", "required": ["invoice", "customer"]}))
    strict = {**HOOK, "schema": str(schema)}
    config, port = receiver_config(tmp_path / "receive.toml", with_secret_db(db_url), [strict])
    receiver = procs.start("receive", config, name="receiver-1", env=ENV)
    wait_listening(receiver)
    body, headers = _delivery(6)  # no "customer": authentic, but poison under the schema
    answer = post(port, "/hooks/billing", body, headers)
    assert (answer.status, answer.json()) == (200, {"status": "rejected"})
    assert_clean_exit(receiver, receiver.stop())
    # The rule is fixed (the schema dropped): the operator replays the row.
    fixed, _ = receiver_config(tmp_path / "fixed.toml", with_secret_db(db_url), [HOOK])
    replayed = switchboard("--config", str(fixed), "inbox", "replay", "--adapter", "billing")
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
    assert query(
        db_url,
        "SELECT i.status, t.queue, e.family, e.trust_mode, e.verified FROM inbox i"
        " JOIN todos t ON t.id = i.todo_id JOIN events e ON e.id = i.event_id",
    ) == [("stored", "billing", "push", "hmac-sha256", False)]


def test_a_database_that_stops_answering_is_503_within_the_request_deadline(
    procs: Processes, tmp_path: Path, db_url: str
) -> None:
    """A blackhole (no reply, no reset): only the request's deadline answers
    the sender; once the database answers again, the retry makes one todo."""
    with proxy_to(db_port(db_url)) as proxy:
        config, port = receiver_config(
            tmp_path / "receive.toml",
            with_secret_db(proxy.url_for(db_url)),
            [HOOK],
            # The transaction caught in the blackhole gives up by itself soon
            # after (else the stop would wait for it).
            database={"statement_timeout_ms": 1000, "transaction_deadline_ms": 2000},
            respond_within_ms=1500,
            body_timeout_ms=1000,
        )
        receiver = procs.start("receive", config, name="receiver-1", env=ENV)
        wait_listening(receiver)
        body, headers = _delivery(7)
        proxy.blackhole = True
        late = post(port, "/hooks/billing", body, headers)
        assert late.status == 503, late.body
        assert late.headers["retry-after"].isdigit()
        assert receiver.events("delivery_unanswered")
        proxy.blackhole = False
        wait_for(
            lambda: post(port, "/hooks/billing", body, headers).status == 200,
            timeout_s=60,
            interval_s=0.5,
            what="a 200 once the database answers",
        )
        assert scalar(db_url, "SELECT count(*) FROM todos") == 1
        assert_clean_exit(receiver, receiver.stop())
    procs.assert_no_secret_logged()


def test_a_flood_of_forged_deliveries_costs_a_metric_each_and_few_log_lines(
    procs: Processes, tmp_path: Path, db_url: str
) -> None:
    metrics_port = free_port()
    config, port = receiver_config(tmp_path / "receive.toml", with_secret_db(db_url), [HOOK])
    receiver = procs.start(
        "receive", config, name="receiver-1", env={**ENV, "SWITCHBOARD_METRICS_PORT": str(metrics_port)}
    )
    wait_listening(receiver)
    body, _ = _delivery(8)
    forged = standard_headers("whsec_" + "QUJD" * 8, "msg_8", body)
    with ThreadPoolExecutor(8) as pool:
        statuses = list(pool.map(lambda _: post(port, "/hooks/billing", body, forged).status, range(100)))
    assert statuses == [401] * 100
    assert scalar(db_url, "SELECT count(*) FROM inbox") == 0
    assert 1 <= len(receiver.events("delivery_refused")) <= 2  # one line per reason every 10 s
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as reply:
        exported = reply.read().decode()
    assert 'switchboard_webhook_refused_total{adapter="billing",reason="bad_signature"} 100.0' in exported
    assert 'switchboard_webhook_responses_total{adapter="billing",status="401"} 100.0' in exported
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10) as reply:
        assert json.loads(reply.read())["status"] == "ok"
    assert_clean_exit(receiver, receiver.stop())


def test_a_commit_that_fails_at_an_injected_point_is_503_and_the_receiver_goes_on(
    procs: Processes, tmp_path: Path, db_url: str
) -> None:
    config, port = receiver_config(tmp_path / "receive.toml", with_secret_db(db_url), [HOOK])
    receiver = procs.start(
        "receive", config, name="receiver-1", env=ENV, failpoints="receiver_before_commit=raise@1"
    )
    wait_listening(receiver)
    body, headers = _delivery(9)
    assert post(port, "/hooks/billing", body, headers).status == 503
    assert scalar(db_url, "SELECT count(*) FROM inbox") == 0  # rolled back
    assert post(port, "/hooks/billing", body, headers).status == 200
    assert scalar(db_url, "SELECT count(*) FROM todos") == 1
    assert receiver.events("push_commit_crashed")
    receiver.stop()  # the injected fault's traceback is in the log: no clean-exit check


def test_the_receiver_runs_as_the_shipped_receiver_role(
    procs: Processes, tmp_path: Path, servers: ServerUrls
) -> None:
    with role_database(servers.database) as rdb:
        migrate_and_grant(rdb)
        config, port = receiver_config(tmp_path / "receive.toml", rdb.url("receiver"), [HOOK])
        receiver = procs.start("receive", config, name="receiver-1", env=ENV)
        wait_listening(receiver)
        body, headers = _delivery(10)
        answer = post(port, "/hooks/billing", body, headers)
        assert answer.status == 200, answer.body
        # The sender's retry of the same delivery: deduplicated, as the receiver's role may.
        again = post(port, "/hooks/billing", body, headers)
        assert again.status == 200, again.body
        assert scalar(rdb.admin_url, "SELECT count(*) FROM todos") == 1
        assert scalar(rdb.admin_url, "SELECT deliveries FROM inbox") == 2
        wait_for(
            lambda: scalar(rdb.admin_url, "SELECT count(*) FROM processes WHERE role = 'receive'") == 1,
            timeout_s=30,
            what="its heartbeat",
        )
        assert_clean_exit(receiver, receiver.stop())


def test_no_connection_is_taken_before_the_receiver_can_serve_it(procs: Processes, tmp_path: Path) -> None:
    """While start-up waits for a database that is away, a sender's connect
    is refused at once (it tries another receiver, or later), never left
    unanswered in the listen backlog."""
    nowhere = f"postgresql+psycopg://switchboard@127.0.0.1:{free_port()}/switchboard"
    config, port = receiver_config(tmp_path / "receive.toml", nowhere, [HOOK])
    receiver = procs.start("receive", config, name="receiver-1", env=ENV)
    wait_for(lambda: receiver.events("register_failed"), timeout_s=30, what="the retried registration")
    body, headers = _delivery(11)
    with pytest.raises(ConnectionRefusedError):
        post(port, "/hooks/billing", body, headers, timeout_s=5)
    assert_clean_exit(receiver, receiver.stop())
