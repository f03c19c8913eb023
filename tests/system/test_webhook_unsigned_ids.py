"""GitHub's delivery id is outside its signature (issue 43): a body captured
with its ``X-Hub-Signature-256`` verifies under any ``X-GitHub-Delivery``.
Over real HTTP against ``switchboard receive`` and a real PostgreSQL: such a
body sent under a stored delivery's id changes nothing of that delivery (its
inbox row, event and todo), sent under a pending delivery's id it does not
swallow the genuine delivery that comes after it, and an exact resend is
still a duplicate."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ingest.embedded.processes import SwitchboardProcess
from tests.support.db import query, scalar
from tests.support.processes import Processes, assert_clean_exit, with_secret_db
from tests.support.webhooks import GITHUB_SECRET, github_headers, post, receiver_config, wait_listening

pytestmark = pytest.mark.system

GITHUB = {"name": "gh", "transport": "webhook", "mode": "github", "secrets_env": ["GH_SECRET"]}
# A push GitHub signed once, captured (a log, a proxy, a request inspector).
CAPTURED = json.dumps({"ref": "refs/heads/main", "after": "1111111"}).encode()


@pytest.fixture
def port(procs: Processes, tmp_path: Path, db_url: str) -> Iterator[int]:
    config, listen_port = receiver_config(tmp_path / "receive.toml", with_secret_db(db_url), [GITHUB])
    proc: SwitchboardProcess = procs.start(
        "receive", config, name="receiver", env={"GH_SECRET": GITHUB_SECRET}
    )
    wait_listening(proc)
    yield listen_port
    if proc.alive():
        assert_clean_exit(proc, proc.stop())
    procs.assert_no_secret_logged()


def deliver(port: int, delivery: str, body: bytes) -> None:
    """A body with its own signature (GitHub's, or a capture's) under ``delivery``."""
    answer = post(port, "/hooks/gh", body, github_headers(GITHUB_SECRET, delivery, body))
    assert answer.status == 200, answer.body
    assert answer.json() == {"status": "stored"}


def push(after: str) -> bytes:
    return json.dumps({"ref": "refs/heads/main", "after": after}).encode()


def delivery_state(db_url: str, key: str) -> list[Any]:
    """Everything of one delivery: its inbox row, its event, its todo."""
    return query(
        db_url,
        "SELECT i.id, i.body, i.deliveries, i.status, i.todo_id, i.event_id, e.payload, e.received_at,"
        "       t.payload, t.status, t.updated_at"
        " FROM inbox i JOIN events e ON e.id = i.event_id JOIN todos t ON t.id = i.todo_id"
        " WHERE i.idempotency_key = %(k)s",
        {"k": key},
    )


def reused_key(delivery: str, body: bytes) -> str:
    return f"webhook:gh:{delivery}:{hashlib.sha256(body).hexdigest()}"


def test_a_captured_body_under_a_stored_deliverys_id_changes_nothing_of_it(port: int, db_url: str) -> None:
    deliver(port, "capture-1", CAPTURED)
    genuine = push("2222222")
    deliver(port, "delivery-2", genuine)
    before = delivery_state(db_url, "webhook:gh:delivery-2")
    assert len(before) == 1

    deliver(port, "delivery-2", CAPTURED)  # the capture, under the stored delivery's id

    assert delivery_state(db_url, "webhook:gh:delivery-2") == before
    # Stored as a message of its own (what a capture under a new id makes
    # anyway: docs/webhooks.md), never merged into the delivery it named.
    [(payload, status)] = query(
        db_url,
        "SELECT payload, status FROM todos WHERE idempotency_key = %(k)s",
        {"k": reused_key("delivery-2", CAPTURED)},
    )
    assert (payload, status) == (json.loads(CAPTURED), "pending")

    # An exact resend of the genuine delivery (GitHub's redelivery: same
    # id, same body) is a duplicate, as before.
    deliver(port, "delivery-2", genuine)
    [after] = delivery_state(db_url, "webhook:gh:delivery-2")
    assert after[2] == 2  # deliveries
    assert after[:2] + after[3:] == before[0][:2] + before[0][3:]
    assert scalar(db_url, "SELECT count(*) FROM todos") == 3


def test_a_captured_body_sent_first_under_a_pending_id_does_not_swallow_the_delivery(
    port: int, db_url: str
) -> None:
    # delivery-3 failed at GitHub (a timeout) and waits for its redelivery;
    # whoever holds a capture sends it under that id first.
    deliver(port, "capture-1", CAPTURED)
    deliver(port, "delivery-3", CAPTURED)
    genuine = push("3333333")
    deliver(port, "delivery-3", genuine)  # GitHub's redelivery

    payloads = sorted(json.dumps(p) for (p,) in query(db_url, "SELECT payload FROM todos"))
    assert payloads == sorted(json.dumps(json.loads(b)) for b in (CAPTURED, CAPTURED, genuine))
    [(status,)] = query(
        db_url,
        "SELECT t.status FROM inbox i JOIN todos t ON t.id = i.todo_id WHERE i.idempotency_key = %(k)s",
        {"k": reused_key("delivery-3", genuine)},
    )
    assert status == "pending"
    # And its redelivery again is a duplicate of that row, not a fourth todo.
    deliver(port, "delivery-3", genuine)
    assert scalar(db_url, "SELECT count(*) FROM todos") == 3
    assert (
        scalar(
            db_url,
            "SELECT deliveries FROM inbox WHERE idempotency_key = %(k)s",
            {"k": reused_key("delivery-3", genuine)},
        )
        == 2
    )
