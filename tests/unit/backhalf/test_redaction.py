"""Redaction of the usual secret carriers (issue 32.7), and its cost on any
input (issue 33.3). The URL and DSN password cases, and the log processor
that applies the redaction, are in tests/unit/observe/test_logs.py."""

from __future__ import annotations

import time

import pytest

from backhalf.redaction import redact
from ingest.observe import logs

# (text, what it must become): each secret carrier once, as it reaches logs
# and last_error.
CARRIERS = [
    # key=value: query strings, keyword lists, environment dumps.
    ("GET /cb?token=abc123XYZ&state=7", "GET /cb?token=***&state=7"),
    ("refresh failed: access_token=ya29.a0Af&x=1", "refresh failed: access_token=***&x=1"),
    ("refresh_token=1//0gLx-Yz", "refresh_token=***"),
    ("client_id=app client_secret=s3cr3tV4l", "client_id=app client_secret=***"),
    ("secret=s3cr3tV4l", "secret=***"),
    ("api_key=AKIAxyz123 region=eu", "api_key=*** region=eu"),
    ("https://api.example.com/v1?apikey=abcdef0123&q=x", "https://api.example.com/v1?apikey=***&q=x"),
    ("API-KEY=abcdef0123", "API-KEY=***"),
    ("aws_secret_access_key = wJalrXUtnFEMI/K7MDENG", "aws_secret_access_key = ***"),
    ("private_key='-----BEGIN KEY-----'", "private_key=***"),
    ('token="quoted value" next', "token=*** next"),
    ("Server=db;Uid=app;Pwd=s3cr3tV4l", "Server=db;Uid=app;Pwd=***"),
    ("DB_PWD=s3cr3tV4l ./run", "DB_PWD=*** ./run"),
    ("passwd=s3cr3tV4l", "passwd=***"),
    # URL query signatures: Azure SAS, S3 and GCS presigned URLs, CloudFront.
    (
        "https://acct.blob.core.windows.net/c/b.json?sv=2021-08-06&se=2030-01-01&sp=r&sig=AbC%2Bd%3D",
        "https://acct.blob.core.windows.net/c/b.json?sv=2021-08-06&se=2030-01-01&sp=r&sig=***",
    ),
    (
        "https://b.s3.amazonaws.com/k?X-Amz-Algorithm=AWS4-HMAC-SHA256"
        "&X-Amz-Credential=AKIAEXAMPLE%2F20240101%2Fus-east-1%2Fs3%2Faws4_request"
        "&X-Amz-Date=20240101T000000Z&X-Amz-SignedHeaders=host&X-Amz-Signature=deadbeef01",
        "https://b.s3.amazonaws.com/k?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=***"
        "&X-Amz-Date=20240101T000000Z&X-Amz-SignedHeaders=host&X-Amz-Signature=***",
    ),
    ("s3.get?X-Amz-Security-Token=FwoGZXIvYXdzE", "s3.get?X-Amz-Security-Token=***"),
    (
        "https://storage.googleapis.com/b/o?X-Goog-Signature=0a1b2c",
        "https://storage.googleapis.com/b/o?X-Goog-Signature=***",
    ),
    (
        "https://d1.cloudfront.net/f?Expires=1&Signature=abc~def&Key-Pair-Id=K1",
        "https://d1.cloudfront.net/f?Expires=1&Signature=***&Key-Pair-Id=K1",
    ),
    ("fetching 'https://h/p?sig=AbCd' failed", "fetching 'https://h/p?sig=***' failed"),
    # Authorization headers, whatever the scheme; a bearer token anywhere.
    ("Authorization: Bearer eyJhbGciOi.eyJzdWIi.c2lnbmF0", "Authorization: Bearer ***"),
    ("Authorization: Basic dXNlcjpwYXNzd29yZA==", "Authorization: Basic ***"),
    ("Proxy-Authorization: Basic dXNlcjpwYXNz", "Proxy-Authorization: Basic ***"),
    (
        "headers={'Authorization': 'Bearer abcdef', 'Host': 'h'}",
        "headers={'Authorization': 'Bearer ***', 'Host': 'h'}",
    ),
    ("curl -H 'X: y' Bearer eyJhbGciOiJIUzI1NiJ9.e30.sig", "curl -H 'X: y' Bearer ***"),
    ("authorization=Token 0123456789abcdef", "authorization=Token ***"),
    # key: value, where a key starts: YAML, headers, flow mappings, after an
    # exception's name.
    ("password: hunter2", "password: ***"),
    (
        "db:\n  user: app\n  password: two words\n  host: db\n",
        "db:\n  user: app\n  password: ***\n  host: db\n",
    ),
    ("- token: abc123\n", "- token: ***\n"),
    ("{user: app, password: hunter2, host: db}", "{user: app, password: ***, host: db}"),
    ("X-Api-Key: abcdef0123\nAccept: */*", "X-Api-Key: ***\nAccept: */*"),
    ("X-Auth-Token: abcdef0123", "X-Auth-Token: ***"),
    ("ValueError: client_secret: s3cr3tV4l", "ValueError: client_secret: ***"),
    # "key": value in JSON and reprs.
    (
        '{"access_token": "ya29.a0Af", "token_type": "bearer", "expires_in": 3599}',
        '{"access_token": ***, "token_type": "bearer", "expires_in": 3599}',
    ),
    ('{"password":"hunter2","user":"u"}', '{"password":***,"user":"u"}'),
    ("{'api_key': 'abcdef', 'n': 1}", "{'api_key': ***, 'n': 1}"),
    ('{"secret": 12345, "n": 1}', '{"secret": ***, "n": 1}'),
    # Issue 43. ("key", value) pairs in a repr: a tuple, a header list.
    ("('password', 'x')", "('password', ***)"),
    ("[('user', 'u'), ('password', \"hunter2\")]", "[('user', 'u'), ('password', ***)]"),
    (
        "[(b'host', b'h'), (b'cookie', b'sid=abc'), (b'authorization', b'Basic dXNlcjpwYXNz')]",
        "[(b'host', b'h'), (b'cookie', ***), (b'authorization', ***)]",
    ),
    # Cookies, whatever their parts.
    ("Cookie: session=abc; csrftoken=def", "Cookie: ***"),
    ("Set-Cookie: sid=abc; Path=/; HttpOnly\r\nHost: h", "Set-Cookie: ***\r\nHost: h"),
    # A passphrase is a password.
    ("passphrase=correct-horse ./run", "passphrase=*** ./run"),
    ("ssh:\n  passphrase: correct horse\n", "ssh:\n  passphrase: ***\n"),
    # A NATS URL's token (its user name alone), and its password.
    ("nats://s3cr3tT0ken@nats.internal:4222", "nats://***@nats.internal:4222"),
    ("connect tls://s3cr3tT0ken@nats.internal:4222 failed", "connect tls://***@nats.internal:4222 failed"),
    ("nats://ingest:hunter2@nats.internal:4222", "nats://ingest:***@nats.internal:4222"),
    # Webhook signatures: a list of them is one value.
    (
        "webhook-signature: v1,K5oZfzN95Z9UVu1EsfQmfVNQhnkZ2pj9o9NDN/H/pI4= v1,3ruV2RuUEuvTCDHnjJ=\nx: 1",
        "webhook-signature: ***\nx: 1",
    ),
    ("Stripe-Signature: t=1492774577,v1=5257a869e7ec,v0=6ffbb59b2300", "Stripe-Signature: ***"),
    ("X-Hub-Signature-256: sha256=757107ea0eb2509fc211", "X-Hub-Signature-256: ***"),
    ("webhook_signature=v1,abc= v1,def=&n=1", "webhook_signature=***&n=1"),
    # A dotted key in the middle of a line, with one value.
    ("ConfigError: settings.password: hunter2", "ConfigError: settings.password: ***"),
]


@pytest.mark.parametrize(("text", "redacted"), CARRIERS)
def test_each_secret_carrier_is_redacted(text: str, redacted: str) -> None:
    assert redact(text) == redacted


def test_a_logged_pair_named_as_a_secret_is_masked() -> None:
    """A tuple logged as a field is rendered as a list of its items, each
    redacted alone: a pair's name must mask its value there too."""
    event = logs.redact_credentials(
        None,
        "info",
        {
            "event": "x",
            "pair": ("password", "hunter2"),
            "headers": [(b"cookie", b"sid=abc"), ("Host", "h"), ("X-Hub-Signature-256", "sha256=ab")],
            "counted": ("token_count", 3),
        },
    )
    assert event["pair"] == ["password", "***"]
    assert event["headers"] == [[b"cookie", "***"], ["Host", "h"], ["X-Hub-Signature-256", "***"]]
    assert event["counted"] == ["token_count", 3]


@pytest.mark.parametrize(
    "text",
    [
        "tokens=5 max_tokens=100 token_type=bearer token_count: 3",
        "secretary: Jane\nsecretariat=UN",
        "invalid token: expired",  # mid-sentence: not a key
        "the secretary said the token count is low",
        "bearer tokens are refused; Basic authentication failed",
        "design=flat signal=3 signed=true sigma=2 api=v2 keys=3",
        "key=redis:orders:1-0 message_id=1-0 adapter=orders",
        "Authorization failed for user u",
        'password authentication failed for user "u"',
        "urn:secret:abc and a=b:c",
        "token==expected",  # no value after the sign
        # Issue 43: a column named in a migration's title, as alembic logs it.
        "Running upgrade 0004 -> 0005, ack_queue.waiting_for: acks that wait for their todo's end"
        ' (ack_after = "complete"); todos.run_token: a worker\'s start recognizes its own run',
        "nats://nats.internal:4222\npostgresql://switchboard@db/switchboard",  # a user name is no token
        "cookies=3 ('user', 'u') ('token_count', 3)",
    ],
)
def test_ordinary_words_are_left_alone(text: str) -> None:
    assert redact(text) == text


def test_every_carrier_in_one_text() -> None:
    text = "\n".join(t for t, _ in CARRIERS)
    assert redact(text) == "\n".join(r for _, r in CARRIERS)


# Issue 33: redaction ran quadratic on a long run of letters (32 KB took
# 0.6 s, so 1 MB about ten minutes). Each shape below is a megabyte that
# would make a pattern that is not linear rescan the text from each of its
# positions; each starts with every hint the redaction looks for, so every
# pattern runs over it.
HINTS = "password token secret api sig credential private authorization bearer pwd := ://\n"
MB = 1 << 20
ADVERSARIAL = {
    "letters": "a" * MB,
    "digits then letters": ("1" * 64 + "a" * 64) * (MB // 128),
    "key run": "a_b.c-" * (MB // 6),
    "equals": "=" * MB,
    "spaces": " " * MB,
    "tabs after a key": "token" + "\t" * MB,
    "colons and spaces": ": " * (MB // 2),
    "newlines and spaces": ("\n" + " " * 1023) * (MB // 1024),
    "quotes": "'\"" * (MB // 2),
    "an open quote": "password='" + "a" * MB,
    "url heads, no @": "a://b:" * (MB // 6),
    "url heads on lines": "a://b:c\n" * (MB // 8),
    "a scheme run": "ab+c.d-" * (MB // 7),
    "keys without values": "token=" * (MB // 6),
    "secret names": "tokenpasswordsecret" * (MB // 19),
    "quoted keys": "'token': " * (MB // 9),
    "colon keys": ",token: " * (MB // 8),
    "authorization": "authorization: " * (MB // 15),
    "bearers": "bearer " * (MB // 7),
    "dashes": "- " * (MB // 2),
    "at signs": "@" * MB,
    "pairs": "('token', " * (MB // 9),
    "signature lists": "sig: v1,a v1,b " * (MB // 15),
    "dotted keys mid-line": ": a.token: " * (MB // 11),
    "nats heads, no @": "nats://a" * (MB // 8),
}
# Measured here at 0.01 to 0.35 s of CPU each. The bound only catches a
# pattern that is not linear (one rescan per position is minutes on a
# megabyte), never a slow or loaded machine: it counts this thread's CPU
# time, not the wall clock.
CPU_BOUND_S = 10.0


@pytest.mark.parametrize("shape", ADVERSARIAL)
def test_a_megabyte_of_any_shape_is_redacted_in_linear_time(shape: str) -> None:
    text = HINTS + ADVERSARIAL[shape]
    started = time.thread_time()
    redact(text)
    assert time.thread_time() - started < CPU_BOUND_S


@pytest.mark.parametrize(
    ("text", "kept"),
    [
        ("Error: settings.password: hunter2 (from env)", "Error: settings.password: ***"),
        ("Error: settings.password: correct horse battery", "Error: settings.password: ***"),
        ("x, db.token: abc123def456 rest", "x, db.token: ***"),
    ],
)
def test_a_dotted_key_mid_line_masks_its_value_to_the_end_of_the_line(text: str, kept: str) -> None:
    """A review's finding: a dotted key followed by more than one word once
    leaked its value (only a lone word was masked)."""
    assert redact(text) == kept
