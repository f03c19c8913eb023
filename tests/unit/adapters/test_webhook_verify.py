"""The three signing schemes, checked against deliveries signed by the
Standard Webhooks reference library and by GitHub's and Stripe's recipes;
and the secrets read from the environment."""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Mapping
from typing import Any

import pytest

from ingest.adapters.webhook.verify import Refused, scheme_for
from ingest.config import WebhookConfig, from_mapping
from ingest.config.webhook import resolve_secrets
from ingest.errors import ConfigError
from tests.support.webhooks import (
    GITHUB_SECRET,
    STANDARD_SECRET,
    STANDARD_SECRET_NEW,
    STRIPE_SECRET,
    github_headers,
    standard_headers,
    stripe_headers,
)

NOW = time.time()


def _cfg(mode: str, names: list[str], **more: Any) -> WebhookConfig:
    table = {"name": "hook", "transport": "webhook", "mode": mode, "secrets_env": names, **more}
    return from_mapping(
        {"database": {"url": "postgresql+psycopg://x@h/db"}, "adapters": [table]}, {}
    ).webhooks[0]


def _check(mode: str, env: Mapping[str, str], headers: Mapping[str, str], body: bytes, **more: Any) -> Any:
    cfg = _cfg(mode, list(env), **more)
    scheme = scheme_for(cfg, resolve_secrets(cfg, env), clock=lambda: NOW)
    lowered = {k.lower(): v for k, v in headers.items()}
    return scheme.verify(scheme.check_headers(lowered), body)


BODY = b'{"type": "invoice.paid"}'


def test_standard_webhooks_accepts_the_reference_signature_under_either_secret() -> None:
    env = {"NEW": STANDARD_SECRET_NEW, "OLD": STANDARD_SECRET}
    got = _check("standard-webhooks", env, standard_headers(STANDARD_SECRET, "msg_1", BODY, at=NOW), BODY)
    assert (got.delivery_id, got.secret) == ("msg_1", "OLD")
    got = _check("standard-webhooks", env, standard_headers(STANDARD_SECRET_NEW, "msg_1", BODY, at=NOW), BODY)
    assert got.secret == "NEW"


def test_standard_webhooks_takes_one_good_signature_among_several_and_svix_names() -> None:
    env = {"S": STANDARD_SECRET}
    headers = standard_headers(STANDARD_SECRET, "msg_2", BODY, at=NOW, svix=True)
    headers["svix-signature"] = "v1,AAAA v1a,BBBB " + headers["svix-signature"]
    assert _check("standard-webhooks", env, headers, BODY).delivery_id == "msg_2"


@pytest.mark.parametrize(
    ("change", "status", "reason"),
    [
        (lambda h: h.pop("webhook-signature"), 401, "missing_header"),
        (lambda h: h.update({"webhook-timestamp": str(int(NOW) - 301)}), 401, "stale_timestamp"),
        (lambda h: h.update({"webhook-timestamp": str(int(NOW) + 301)}), 401, "stale_timestamp"),
        (lambda h: h.update({"webhook-timestamp": "soon"}), 401, "bad_timestamp"),
        (lambda h: h.update({"webhook-signature": "v1a,abc"}), 401, "bad_signature"),
        (lambda h: h.update({"webhook-id": "msg 2"}), 400, "bad_delivery_id"),
        (lambda h: h.update({"webhook-id": "x" * 201}), 400, "bad_delivery_id"),
        (lambda h: h.update({"webhook-id": "msg:2"}), 400, "bad_delivery_id"),
    ],
)
def test_standard_webhooks_refusals(change: Any, status: int, reason: str) -> None:
    headers = standard_headers(STANDARD_SECRET, "msg_3", BODY, at=NOW)
    change(headers)
    with pytest.raises(Refused) as refused:
        _check("standard-webhooks", {"S": STANDARD_SECRET}, headers, BODY)
    assert (refused.value.status, refused.value.reason) == (status, reason)


def test_a_tampered_body_or_a_timestamp_moved_after_signing_is_refused() -> None:
    env = {"S": STANDARD_SECRET}
    headers = standard_headers(STANDARD_SECRET, "msg_4", BODY, at=NOW)
    with pytest.raises(Refused, match="no signature matches"):
        _check("standard-webhooks", env, headers, BODY + b" ")
    headers["webhook-timestamp"] = str(int(NOW) - 1)  # within tolerance, but not what was signed
    with pytest.raises(Refused, match="no signature matches"):
        _check("standard-webhooks", env, headers, BODY)


def test_github_signature_and_its_unsigned_delivery_id() -> None:
    env = {"GH": GITHUB_SECRET}
    headers = github_headers(GITHUB_SECRET, "72d3162e-cc78-11e3-81ab-4c9367dc0958", BODY)
    got = _check("github", env, headers, BODY)
    assert (got.delivery_id, got.secret) == ("72d3162e-cc78-11e3-81ab-4c9367dc0958", "GH")
    headers["X-Hub-Signature-256"] = headers["X-Hub-Signature-256"].upper().replace("SHA256=", "sha256=")
    assert _check("github", env, headers, BODY).secret == "GH"  # hex in capitals is the same digest
    with pytest.raises(Refused, match="sha256=HEX"):
        _check("github", env, {**headers, "X-Hub-Signature-256": "sha1=abc"}, BODY)


def test_githubs_own_example_delivery() -> None:
    """GitHub's documented test values (docs: validating webhook deliveries)."""
    body = b"Hello, World!"
    headers = {
        "X-GitHub-Delivery": "d1",
        "X-Hub-Signature-256": "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17",
    }
    assert _check("github", {"GH": GITHUB_SECRET}, headers, body).delivery_id == "d1"


def test_stripe_event_id_from_the_body_its_whole_secret_and_several_v1() -> None:
    env = {"ST": STRIPE_SECRET}
    event = json.dumps({"id": "evt_123", "type": "charge.succeeded"}).encode()
    headers = stripe_headers(STRIPE_SECRET, event, at=NOW)
    headers["Stripe-Signature"] = headers["Stripe-Signature"].replace(",v1=", ",v1=00ff,v0=11,v1=")
    assert _check("stripe", env, headers, event).delivery_id == "evt_123"
    # The key is the whole whsec_ string, not the base64 bytes after the prefix.
    decoded_key = base64.b64encode(b"x" * 24).decode()
    wrong = stripe_headers("whsec_" + decoded_key, event, at=NOW)
    with pytest.raises(Refused):
        _check("stripe", {"ST": "whsec_" + decoded_key + "_"}, wrong, event)
    no_id = b'{"type": "charge.succeeded"}'
    got = _check("stripe", env, stripe_headers(STRIPE_SECRET, no_id, at=NOW), no_id)
    assert got.delivery_id.startswith("sha256-")
    with pytest.raises(Refused) as stale:
        _check("stripe", env, stripe_headers(STRIPE_SECRET, event, at=NOW - 61), event, tolerance_s=60)
    assert stale.value.reason == "stale_timestamp"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("", "BAD is unset or empty"),
        ("whsec_not*base64", "no Standard Webhooks secret"),
        ("whsec_" + base64.b64encode(b"short").decode(), "at least 16 expected"),
    ],
)
def test_secret_variables_are_checked_by_name_never_echoed(value: str, message: str) -> None:
    cfg = _cfg("standard-webhooks", ["BAD"])
    with pytest.raises(ConfigError, match=message) as refused:
        resolve_secrets(cfg, {"BAD": value})
    assert (value or "\0") not in str(refused.value)


def test_a_standard_secret_without_its_padding_is_taken() -> None:
    cfg = _cfg("standard-webhooks", ["S"])
    [secret] = resolve_secrets(cfg, {"S": STANDARD_SECRET.rstrip("=")})
    assert secret.key == base64.b64decode(STANDARD_SECRET.removeprefix("whsec_"))
    assert repr(secret) == "Secret(name='S')"  # the key never in a repr, so never in a traceback


@pytest.mark.parametrize(
    ("more", "message"),
    [
        ({"mode": "github", "tolerance_s": 30}, "does not apply to mode = 'github'"),
        ({"retain_acked_days": 1}, "shorter than standard-webhooks senders retry"),
        ({"batch_size": 10}, "unknown key 'batch_size'"),
        ({"secrets_env": ["A", "A"]}, "names a variable twice"),
        ({"mode": "svix"}, "must be one of standard-webhooks, github, stripe"),
        ({"name": "a/b"}, "must be a name for the route /hooks/NAME"),
        ({"max_message_bytes": 2**30}, "must be at most"),
    ],
)
def test_webhook_config_errors_name_the_adapter_and_key(more: dict[str, Any], message: str) -> None:
    table = {"name": "hook", "transport": "webhook", "secrets_env": ["A"], **more}
    with pytest.raises(ConfigError, match=message):
        from_mapping({"database": {"url": "postgresql+psycopg://x@h/db"}, "adapters": [table]}, {})


def test_a_webhook_and_a_pull_adapter_may_not_share_a_name() -> None:
    tables = [{"name": "a", "source": "s"}, {"name": "a", "transport": "webhook", "secrets_env": ["A"]}]
    with pytest.raises(ConfigError, match="adapter 'a': key 'name' is used by more than one adapter"):
        from_mapping({"database": {"url": "postgresql+psycopg://x@h/db"}, "adapters": tables}, {})
