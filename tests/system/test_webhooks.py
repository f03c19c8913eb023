"""``switchboard receive`` over real HTTP on loopback against a real
PostgreSQL: deliveries signed by the Standard Webhooks reference library,
GitHub's and Stripe's recipes; store-then-respond; every refusal stores
nothing (DESIGN.md section 12)."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from ingest.embedded.processes import SwitchboardProcess, wait_for
from tests.support.db import query, scalar
from tests.support.processes import Processes, assert_clean_exit, switchboard, with_secret_db
from tests.support.webhooks import (
    GITHUB_SECRET,
    STANDARD_SECRET,
    STANDARD_SECRET_NEW,
    STRIPE_SECRET,
    github_headers,
    post,
    receiver_config,
    standard_headers,
    stripe_headers,
    wait_listening,
)

pytestmark = pytest.mark.system

BILLING = {
    "name": "billing",
    "transport": "webhook",
    "mode": "standard-webhooks",
    "source": "billing",
    "queue": "billing",
    "secrets_env": ["BILLING_WHSEC", "BILLING_WHSEC_OLD"],
    "max_message_bytes": 4096,
}
GITHUB = {"name": "gh", "transport": "webhook", "mode": "github", "secrets_env": ["GH_SECRET"]}
STRIPE = {"name": "stripe", "transport": "webhook", "mode": "stripe", "secrets_env": ["STRIPE_SECRET"]}
ENV = {
    "BILLING_WHSEC": STANDARD_SECRET_NEW,
    "BILLING_WHSEC_OLD": STANDARD_SECRET,
    "GH_SECRET": GITHUB_SECRET,
    "STRIPE_SECRET": STRIPE_SECRET,
}


def _body(n: int) -> bytes:
    return json.dumps({"type": "invoice.paid", "invoice": n}).encode()


def _inbox(db_url: str) -> int:
    return int(scalar(db_url, "SELECT count(*) FROM inbox"))


def _todos(db_url: str, key: str) -> list[Any]:
    return query(db_url, "SELECT queue, payload, status FROM todos WHERE idempotency_key = %(k)s", {"k": key})


@pytest.fixture
def receiver(procs: Processes, tmp_path: Path, db_url: str) -> Iterator[tuple[SwitchboardProcess, int]]:
    config, port = receiver_config(
        tmp_path / "receive.toml", with_secret_db(db_url), [BILLING, GITHUB, STRIPE]
    )
    proc = procs.start("receive", config, name="receiver-1", env=ENV)
    wait_listening(proc)
    yield proc, port
    if proc.alive():
        assert_clean_exit(proc, proc.stop())
    procs.assert_no_secret_logged()


def test_a_signed_delivery_is_stored_once_and_its_resend_is_a_duplicate(
    receiver: tuple[SwitchboardProcess, int], db_url: str
) -> None:
    _, port = receiver
    body = _body(1)
    headers = standard_headers(STANDARD_SECRET_NEW, "msg_1", body)
    first = post(port, "/hooks/billing", body, headers)
    assert first.status == 200, first.body
    assert first.json() == {"status": "stored"}
    # The sender's retry, signed again (a new timestamp), and the same again.
    assert (
        post(port, "/hooks/billing", body, standard_headers(STANDARD_SECRET_NEW, "msg_1", body)).status == 200
    )
    assert post(port, "/hooks/billing", body, headers).status == 200
    key = "webhook:billing:msg_1"
    assert _todos(db_url, key) == [("billing", {"type": "invoice.paid", "invoice": 1}, "pending")]
    [(status, ack_kind, ack_state, deliveries)] = query(
        db_url,
        "SELECT status, ack_kind, ack_state, deliveries FROM inbox WHERE idempotency_key = %(k)s",
        {"k": key},
    )
    assert (status, ack_kind, ack_state) == ("stored", "none", "none")
    assert deliveries == 3
    [(family, trust_mode, verified, detail)] = query(
        db_url,
        "SELECT family, trust_mode, verified, verify_detail FROM events WHERE idempotency_key = %(k)s",
        {"k": key},
    )
    assert (family, trust_mode, verified) == ("push", "hmac-sha256", True)
    assert detail == "standard-webhooks secret: BILLING_WHSEC"
    assert STANDARD_SECRET_NEW not in str(detail)
    [(reg_family, transport)] = query(db_url, "SELECT family, transport FROM adapters WHERE name = 'billing'")
    assert (reg_family, transport) == ("push", "webhook")


def test_both_secrets_verify_during_a_rotation_and_svix_names_are_taken(
    receiver: tuple[SwitchboardProcess, int], db_url: str
) -> None:
    _, port = receiver
    old = standard_headers(STANDARD_SECRET, "msg_old", _body(2), svix=True)
    assert post(port, "/hooks/billing", _body(2), old).status == 200
    new = standard_headers(STANDARD_SECRET_NEW, "msg_new", _body(3))
    assert post(port, "/hooks/billing", _body(3), new).status == 200
    details = dict(query(db_url, "SELECT idempotency_key, verify_detail FROM events ORDER BY id"))
    assert details == {
        "webhook:billing:msg_old": "standard-webhooks secret: BILLING_WHSEC_OLD",
        "webhook:billing:msg_new": "standard-webhooks secret: BILLING_WHSEC",
    }


@pytest.mark.parametrize(
    "case",
    ["tampered body", "wrong secret", "stale", "future", "no signature", "v1a only", "unsigned id changed"],
)
def test_an_unauthentic_delivery_is_401_and_stores_nothing(
    case: str, receiver: tuple[SwitchboardProcess, int], db_url: str
) -> None:
    _, port = receiver
    body = _body(4)
    headers = standard_headers(STANDARD_SECRET_NEW, "msg_4", body)
    if case == "tampered body":
        body = _body(5)
    elif case == "wrong secret":
        headers = standard_headers("whsec_" + "QUJD" * 8, "msg_4", body)
    # Past the 300 s tolerance by a margin: the header carries whole seconds
    # (floored), and the request reaches the receiver a moment later, so a
    # second beyond it was within it on a loaded machine (seen in a full
    # run: the "future" delivery was stored).
    elif case == "stale":
        headers = standard_headers(STANDARD_SECRET_NEW, "msg_4", body, at=time.time() - 330)
    elif case == "future":
        headers = standard_headers(STANDARD_SECRET_NEW, "msg_4", body, at=time.time() + 330)
    elif case == "no signature":
        del headers["webhook-signature"]
    elif case == "v1a only":
        headers["webhook-signature"] = "v1a," + headers["webhook-signature"].split(",", 1)[1]
    else:
        headers["webhook-id"] = "msg_other"  # the id is signed
    answer = post(port, "/hooks/billing", body, headers)
    assert answer.status == 401, answer.body
    assert _inbox(db_url) == 0
    assert scalar(db_url, "SELECT count(*) FROM events") == 0


def test_refusals_before_the_body(receiver: tuple[SwitchboardProcess, int], db_url: str) -> None:
    _, port = receiver
    body = _body(6)
    headers = standard_headers(STANDARD_SECRET_NEW, "msg_6", body)
    assert post(port, "/hooks/nobody", body, headers).status == 404
    get = post(port, "/hooks/billing", b"", {}, method="GET")
    assert (get.status, get.headers["allow"]) == (405, "POST")
    assert post(port, "/hooks/billing", b"", {}, method="TRACE").status == 405
    assert post(port, "/hooks/nobody", b"", {}, method="GET").status == 404  # unknown first
    assert post(port, "/hooks/billing/", body, headers).status == 404  # no redirect built from Host
    both = {**headers, "Content-Encoding": "identity, gzip"}
    assert post(port, "/hooks/billing", body, both).status == 415
    assert post(port, "/hooks/billing", body, {**headers, "Content-Encoding": "gzip"}).status == 415
    big = json.dumps({"pad": "x" * 5000}).encode()
    assert (
        post(port, "/hooks/billing", big, standard_headers(STANDARD_SECRET_NEW, "msg_big", big)).status == 413
    )
    assert _inbox(db_url) == 0


def test_a_chunked_body_over_the_limit_is_413(receiver: tuple[SwitchboardProcess, int], db_url: str) -> None:
    _, port = receiver
    big = json.dumps({"pad": "x" * 5000}).encode()
    headers = standard_headers(STANDARD_SECRET_NEW, "msg_chunked", big)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        sock.sendall(
            f"POST /hooks/billing HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n{head}\r\n".encode()
        )
        for i in range(0, len(big), 1000):
            part = big[i : i + 1000]
            try:
                sock.sendall(f"{len(part):x}\r\n".encode() + part + b"\r\n")
            except OSError:
                break  # the server answered and closed: the rest is never read
        reply = _until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 413"), reply
    assert b"connection: close" in reply.lower()
    assert _inbox(db_url) == 0


def _until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes (a timeout if it never does)."""
    got = b""
    while chunk := sock.recv(65536):
        got += chunk
    return got


def test_a_refusal_before_the_body_closes_the_connection(
    receiver: tuple[SwitchboardProcess, int], db_url: str
) -> None:
    """413 by the declared length: the server closes rather than read (and
    throw away) the 100 MB the sender says it will send."""
    _, port = receiver
    headers = standard_headers(STANDARD_SECRET_NEW, "msg_huge", b"{}")
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        sock.sendall(
            f"POST /hooks/billing HTTP/1.1\r\nHost: x\r\nContent-Length: 100000000\r\n{head}\r\n".encode()
        )
        sock.sendall(b"x" * 65536)
        reply = _until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 413"), reply
    assert _inbox(db_url) == 0


def test_a_body_that_does_not_arrive_is_408(procs: Processes, tmp_path: Path, db_url: str) -> None:
    config, port = receiver_config(
        tmp_path / "receive.toml",
        with_secret_db(db_url),
        [BILLING],
        body_timeout_ms=500,
        respond_within_ms=2000,
    )
    proc = procs.start("receive", config, name="receiver-1", env=ENV)
    wait_listening(proc)
    body = _body(7)
    headers = standard_headers(STANDARD_SECRET_NEW, "msg_7", body)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        sock.sendall(
            f"POST /hooks/billing HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n{head}\r\n".encode()
            + body[:10]
        )
        reply = sock.recv(4096)
    assert reply.startswith(b"HTTP/1.1 408"), reply
    assert _inbox(db_url) == 0
    assert_clean_exit(proc, proc.stop())


def test_an_authentic_poison_body_is_stored_rejected_and_answered_200(
    receiver: tuple[SwitchboardProcess, int], db_url: str
) -> None:
    _, port = receiver
    body = b'{"not json'
    answer = post(port, "/hooks/billing", body, standard_headers(STANDARD_SECRET_NEW, "msg_poison", body))
    assert answer.status == 200
    assert answer.json() == {"status": "rejected"}
    [(status, error)] = query(db_url, "SELECT status, error FROM inbox")
    assert status == "rejected"
    assert error.startswith("invalid_json")
    assert scalar(db_url, "SELECT count(*) FROM todos") == 0


def test_fifty_concurrent_copies_of_one_delivery_make_one_todo(
    receiver: tuple[SwitchboardProcess, int], db_url: str
) -> None:
    _, port = receiver
    body = _body(8)
    headers = standard_headers(STANDARD_SECRET_NEW, "msg_dup", body)
    with ThreadPoolExecutor(50) as pool:
        answers = list(pool.map(lambda _: post(port, "/hooks/billing", body, headers), range(50)))
    assert [a.status for a in answers] == [200] * 50
    assert len(_todos(db_url, "webhook:billing:msg_dup")) == 1
    # One row; its count says it came again (copies that shared a commit
    # are merged first, so it is no exact count of the requests).
    assert scalar(db_url, "SELECT count(*) FROM inbox") == 1
    assert 2 <= scalar(db_url, "SELECT deliveries FROM inbox") <= 50
    assert scalar(db_url, "SELECT count(*) FROM events") == 1


def test_github_and_stripe_samples(receiver: tuple[SwitchboardProcess, int], db_url: str) -> None:
    _, port = receiver
    push = json.dumps({"ref": "refs/heads/main", "after": "abc"}).encode()
    assert (
        post(
            port,
            "/hooks/gh",
            push,
            github_headers(GITHUB_SECRET, "72d3162e-cc78-11e3-81ab-4c9367dc0958", push),
        ).status
        == 200
    )
    bad = github_headers("not the secret", "72d3162e-0000", push)
    assert post(port, "/hooks/gh", push, bad).status == 401
    event = json.dumps({"id": "evt_1NG8Du2eZvKYlo2C", "type": "charge.succeeded"}).encode()
    assert post(port, "/hooks/stripe", event, stripe_headers(STRIPE_SECRET, event)).status == 200
    stale = stripe_headers(STRIPE_SECRET, event, at=time.time() - 600)
    assert post(port, "/hooks/stripe", event, stale).status == 401
    # Stripe's whole whsec_ string is the key, not its base64 bytes.
    assert post(port, "/hooks/stripe", event, stripe_headers("whsec_other", event)).status == 401
    keys = dict(query(db_url, "SELECT idempotency_key, verify_detail FROM events ORDER BY id"))
    assert keys == {
        "webhook:gh:72d3162e-cc78-11e3-81ab-4c9367dc0958": "github secret: GH_SECRET",
        "webhook:stripe:evt_1NG8Du2eZvKYlo2C": "stripe secret: STRIPE_SECRET",
    }


def test_a_disabled_adapter_is_503_with_retry_after(
    receiver: tuple[SwitchboardProcess, int], db_url: str
) -> None:
    proc, port = receiver
    query(db_url, "UPDATE adapters SET enabled = false WHERE name = 'billing'")
    wait_for(lambda: proc.events("adapter_disabled"), timeout_s=20, what="the flag read")
    body = _body(9)
    answer = post(port, "/hooks/billing", body, standard_headers(STANDARD_SECRET_NEW, "msg_9", body))
    assert answer.status == 503
    assert answer.headers["retry-after"].isdigit()
    assert _inbox(db_url) == 0


def test_status_and_trace_show_a_push_adapter_and_its_message(
    receiver: tuple[SwitchboardProcess, int], db_url: str, tmp_path: Path
) -> None:
    _, port = receiver
    body = _body(10)
    assert (
        post(port, "/hooks/billing", body, standard_headers(STANDARD_SECRET_NEW, "msg_10", body)).status
        == 200
    )
    config = tmp_path / "receive.toml"
    wait_for(
        lambda: scalar(db_url, "SELECT count(*) FROM processes WHERE role = 'receive'") == 1,
        timeout_s=30,
        what="the receiver's heartbeat",
    )
    shown = switchboard("--config", str(config), "status", "--json")
    report = {r["adapter"]: r for r in json.loads(shown.stdout)}
    billing = report["billing"]
    assert (billing["family"], billing["route"], billing["stored"]) == ("push", "POST /hooks/billing", 1)
    assert billing["processes"]["receive"], billing
    assert billing["healthy"] is True
    text = switchboard("--config", str(config), "status").stdout
    assert "receive alive" in text
    trail = switchboard("--config", str(config), "trace", "webhook:billing:msg_10")
    assert trail.returncode == 0, trail.stderr
    assert "webhook:billing:msg_10" in trail.stdout


def test_a_sender_that_hangs_up_mid_body_is_a_refusal_not_a_crash(
    receiver: tuple[SwitchboardProcess, int], db_url: str
) -> None:
    proc, port = receiver
    body = _body(11)
    headers = standard_headers(STANDARD_SECRET_NEW, "msg_11", body)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        sock.sendall(
            f"POST /hooks/billing HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n{head}\r\n".encode()
            + body[:10]
        )
    wait_for(
        lambda: [e for e in proc.events("delivery_refused") if e["reason"] == "disconnected"],
        timeout_s=20,
        what="the refusal",
    )
    assert _inbox(db_url) == 0
    assert "Traceback" not in proc.raw_log()


def test_a_resend_under_the_same_id_with_its_body_serialized_anew_is_a_duplicate(
    receiver: tuple[SwitchboardProcess, int], db_url: str
) -> None:
    """The delivery id names the delivery: Stripe signs a retry afresh, its
    counters moved; a sender may re-serialize. One row, one todo (the first
    body's), never a second todo under a derived key."""
    _, port = receiver
    first = json.dumps({"id": "evt_9", "type": "charge.succeeded", "pending_webhooks": 2}).encode()
    again = json.dumps({"type": "charge.succeeded", "id": "evt_9", "pending_webhooks": 1}).encode()
    for body in (first, again):
        assert post(port, "/hooks/stripe", body, stripe_headers(STRIPE_SECRET, body)).status == 200
    same_a = _body(12)
    same_b = json.dumps({"invoice": 12, "type": "invoice.paid"}).encode()
    for body in (same_a, same_b):
        assert (
            post(port, "/hooks/billing", body, standard_headers(STANDARD_SECRET_NEW, "msg_12", body)).status
            == 200
        )
    assert query(db_url, "SELECT idempotency_key, deliveries FROM inbox ORDER BY 1") == [
        ("webhook:billing:msg_12", 2),
        ("webhook:stripe:evt_9", 2),
    ]
    assert query(db_url, "SELECT payload FROM todos WHERE idempotency_key = 'webhook:stripe:evt_9'") == [
        ({"id": "evt_9", "type": "charge.succeeded", "pending_webhooks": 2},)
    ]
    assert scalar(db_url, "SELECT count(*) FROM todos") == 2


def test_malformed_requests_flood_no_log(receiver: tuple[SwitchboardProcess, int]) -> None:
    """Anyone can send bytes that are no HTTP: uvicorn's own line for each
    (a warning) stays out of the log."""
    proc, port = receiver
    for _ in range(30):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
            _until_closed(sock)
    assert post(port, "/healthz", b"", {}, method="GET").status == 200
    assert "Invalid HTTP request" not in proc.raw_log()
