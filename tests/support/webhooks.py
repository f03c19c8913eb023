"""Signed webhook deliveries for the receiver's tests: Standard Webhooks by
its reference library (``standardwebhooks``), GitHub and Stripe by their
documented recipes; sent over real HTTP on loopback (http.client)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import http.client
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from standardwebhooks.webhooks import Webhook

from ingest.embedded.processes import SwitchboardProcess, wait_for
from ingest.embedded.servers import free_port
from tests.support.config import write_config

# Test secrets: a Standard Webhooks one is whsec_ + base64 of 24 bytes.
STANDARD_SECRET = "whsec_" + base64.b64encode(b"switchboard-test-key-0001").decode()
STANDARD_SECRET_NEW = "whsec_" + base64.b64encode(b"switchboard-test-key-0002").decode()
GITHUB_SECRET = "It's a Secret to Everybody"
STRIPE_SECRET = "whsec_test_stripe_secret_0123456789"


@dataclass(frozen=True)
class Answer:
    status: int
    body: bytes
    headers: Mapping[str, str]

    def json(self) -> Any:
        return json.loads(self.body)


def standard_headers(
    secret: str, msg_id: str, body: bytes, *, at: float | None = None, svix: bool = False
) -> dict[str, str]:
    """Signed by the reference implementation."""
    when = datetime.fromtimestamp(time.time() if at is None else at, tz=UTC)
    signature = Webhook(secret).sign(msg_id, when, body.decode())
    prefix = "svix" if svix else "webhook"
    return {
        f"{prefix}-id": msg_id,
        f"{prefix}-timestamp": str(int(when.timestamp())),
        f"{prefix}-signature": signature,
        "content-type": "application/json",
    }


def github_headers(secret: str, delivery: str, body: bytes) -> dict[str, str]:
    digest = hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()
    return {
        "X-GitHub-Delivery": delivery,
        "X-GitHub-Event": "push",
        "X-Hub-Signature-256": f"sha256={digest}",
        "content-type": "application/json",
    }


def stripe_headers(secret: str, body: bytes, *, at: float | None = None) -> dict[str, str]:
    t = int(time.time() if at is None else at)
    v1 = hmac.new(secret.encode(), f"{t}.".encode() + body, hashlib.sha256).hexdigest()
    return {"Stripe-Signature": f"t={t},v1={v1}", "content-type": "application/json"}


def post(
    port: int,
    path: str,
    body: bytes,
    headers: Mapping[str, str],
    *,
    method: str = "POST",
    timeout_s: float = 30,
) -> Answer:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        conn.request(method, path, body=body, headers=dict(headers))
        resp = conn.getresponse()
        return Answer(resp.status, resp.read(), {k.lower(): v for k, v in resp.getheaders()})
    finally:
        conn.close()


def receiver_config(
    path: Path,
    db_url: str,
    adapters: list[Mapping[str, Any]],
    *,
    database: Mapping[str, Any] | None = None,
    queues: Mapping[str, Mapping[str, Any]] | None = None,
    **receiver: Any,
) -> tuple[Path, int]:
    """A config of webhook adapters (and any others given, and the workers'
    ``queues``) and a free port."""
    port = free_port()
    config = write_config(
        path,
        database_url=db_url,
        redis_url="redis://127.0.0.1:1/0",  # no pull adapter: never connected
        adapters=adapters,
        database=database,
        queues=queues,
        receiver={"listen": f"127.0.0.1:{port}", **receiver},
    )
    return config, port


def wait_listening(proc: SwitchboardProcess, timeout_s: float = 30) -> None:
    wait_for(
        lambda: proc.events("receiver_listening") or not proc.alive(), timeout_s=timeout_s, what="receiver"
    )
    assert proc.alive(), proc.raw_log()[-3000:]
