"""Issue 32, item 9: a warning at start for each server reached without TLS
over the network; loopback and unix sockets exempt; no credential in it."""

from __future__ import annotations

from typing import Any

import pytest
from structlog.testing import capture_logs

from ingest.config import Settings, from_mapping
from ingest.config.transports import default as default_transport
from ingest.config.transports import definitions
from ingest.observe.transport import (
    Plaintext,
    database_plaintext,
    plaintext_servers,
    warn_plaintext,
)

PASSWORD = "s3cret-never-logged"


@pytest.mark.parametrize(
    ("url", "env", "expected"),
    [
        (f"postgresql://u:{PASSWORD}@db.internal:5433/x", {}, [("db.internal", 5433, "sslmode=prefer")]),
        (f"postgresql://u:{PASSWORD}@db.internal/x", {}, [("db.internal", 5432, "sslmode=prefer")]),
        ("postgresql://u@10.1.2.3/x?sslmode=disable", {}, [("10.1.2.3", 5432, "sslmode=disable")]),
        ("postgresql://u@10.1.2.3/x?sslmode=allow", {}, [("10.1.2.3", 5432, "sslmode=allow")]),
        ("postgresql://u@[2001:db8::1]:6432/x", {}, [("2001:db8::1", 6432, "sslmode=prefer")]),
        # A name is never resolved: remote, even one that is this host.
        ("postgresql://u@db/x?hostaddr=10.0.0.9", {}, [("10.0.0.9", 5432, "sslmode=prefer")]),
        (
            "postgresql://u@db.internal/x",
            {"PGSSLMODE": "disable"},
            [("db.internal", 5432, "sslmode=disable")],
        ),
        # The environment's host, when the URL names none.
        ("postgresql://u@/x", {"PGHOST": "db.internal"}, [("db.internal", 5432, "sslmode=prefer")]),
        # TLS required: no warning.
        ("postgresql://u@db.internal/x?sslmode=require", {}, []),
        ("postgresql://u@db.internal/x?sslmode=verify-ca", {}, []),
        ("postgresql://u@db.internal/x?sslmode=verify-full&sslrootcert=/ca.pem", {}, []),
        ("postgresql://u@db.internal/x", {"PGSSLMODE": "verify-full"}, []),
        ("postgresql://u@db.internal/x?gssencmode=require", {}, []),
        # Local: no warning.
        ("postgresql://u@127.0.0.1/x", {}, []),
        ("postgresql://u@127.0.0.2:5433/x", {}, []),
        ("postgresql://u@localhost/x", {}, []),
        ("postgresql://u@[::1]/x", {}, []),
        ("postgresql://u@/x", {}, []),  # libpq's unix socket
        ("postgresql://u@/x?host=/var/run/postgresql", {}, []),
        ("postgresql://u@db/x?hostaddr=127.0.0.1", {}, []),
    ],
)
def test_the_database_is_plaintext_when_remote_and_tls_is_not_required(
    url: str, env: dict[str, str], expected: list[tuple[str, int, str]]
) -> None:
    found = database_plaintext(url.replace("postgresql://", "postgresql+psycopg://"), env)
    assert [(p.host, p.port, p.tls) for p in found] == expected


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        (f"redis://default:{PASSWORD}@cache.internal:6380/0", ("cache.internal", 6380)),
        ("redis://10.0.0.5", ("10.0.0.5", 6379)),
        ("redis://[2001:db8::5]:6379/0", ("2001:db8::5", 6379)),
        ("rediss://cache.internal:6380/0?ssl_ca_certs=/ca.pem", None),
        ("redis://127.0.0.1:6379/0", None),
        ("redis://localhost", None),
        ("redis://[::1]:6379", None),
        ("redis:///0", None),  # redis-py's default host, localhost
        ("unix:///run/redis.sock", None),
    ],
)
def test_a_redis_is_plaintext_when_remote_and_not_rediss(url: str, expected: tuple[str, int] | None) -> None:
    found = default_transport().plaintext(url, None)
    assert (None if found is None else (found.host, found.port)) == expected


@pytest.mark.parametrize(
    ("adapter", "expected"),
    [
        # An SQS-compatible endpoint in clear; AWS's own (the default) is HTTPS.
        ({"transport": "sqs", "url": "http://sqs.internal:9324"}, ("sqs.internal", 9324, "http://")),
        ({"transport": "sqs", "url": "http://127.0.0.1:5000"}, None),
        ({"transport": "sqs", "url": "https://sqs.eu-west-1.amazonaws.com"}, None),
        ({"transport": "sqs"}, None),
        # NATS: tls:// or a CA file make the client speak TLS.
        (
            {"transport": "nats", "url": f"nats://u:{PASSWORD}@nats.internal"},
            ("nats.internal", 4222, "nats://"),
        ),
        ({"transport": "nats", "url": "tls://nats.internal:4222"}, None),
        ({"transport": "nats", "url": "nats://nats.internal", "tls_ca_file": "/ca.pem"}, None),
        ({"transport": "nats", "url": "nats://127.0.0.1:4222"}, None),
        (
            {"transport": "amqp", "url": f"amqp://u:{PASSWORD}@mq.internal/%2f"},
            ("mq.internal", 5672, "amqp://"),
        ),
        ({"transport": "amqp", "url": "amqps://mq.internal:5671/%2f"}, None),
        ({"transport": "amqp", "url": "amqp://localhost/%2f"}, None),
    ],
)
def test_each_transport_says_when_its_broker_is_remote_in_plain_text(
    adapter: dict[str, Any], expected: tuple[str, int, str] | None
) -> None:
    table = {"name": "orders", "source": "orders", "queue": "orders", "region": "eu-west-1", **adapter}
    if adapter["transport"] == "nats":
        table["group"] = "switchboard"
    if adapter["transport"] != "sqs":
        table.pop("region")
    settings = from_mapping({"database": {"url": "postgresql://sb@127.0.0.1/sb"}, "adapters": [table]}, {})
    (config,) = settings.adapters
    found = definitions()[config.transport].plaintext(config.broker.url(), config.options)
    assert (None if found is None else (found.host, found.port, found.scheme)) == expected
    if found is not None:
        assert PASSWORD not in repr(found)


def _settings(**raw: Any) -> Settings:
    return from_mapping(
        {
            "database": {"url": f"postgresql://sb:{PASSWORD}@db.internal:5432/sb"},
            "adapters": [
                {
                    "name": "orders",
                    "mode": "stream",
                    "source": "orders",
                    "url": f"redis://u:{PASSWORD}@a.internal",
                },
                {
                    "name": "refunds",
                    "mode": "stream",
                    "source": "refunds",
                    "url": f"redis://u:{PASSWORD}@a.internal",
                },
                {"name": "local", "mode": "stream", "source": "local", "url": "redis://127.0.0.1:6379/0"},
                {"name": "tls", "mode": "stream", "source": "tls", "url": "rediss://b.internal:6380/0"},
            ],
            "queues": {"orders": {"handler": "tests.support.handlers:scripted"}},
            "dramatiq": {"url": f"redis://u:{PASSWORD}@d.internal:6379/1"},
            **raw,
        },
        {},
    )


def _found(settings: Settings, verb: str) -> dict[str, Plaintext]:
    return {f"{p.server} {p.host}": p for p in plaintext_servers(settings, verb, {})}


def test_each_process_is_warned_of_the_servers_it_reaches() -> None:
    settings = _settings()
    ingest = _found(settings, "ingest")
    assert sorted(ingest) == ["broker a.internal", "database db.internal"]
    # One warning for one server, naming every adapter on it.
    assert ingest["broker a.internal"].used_by == ("adapter 'orders'", "adapter 'refunds'")
    assert ingest["database db.internal"].used_by == ("[database] url",)
    # The acker reaches the adapters' brokers; the workers the database only
    # (their broker is PostgreSQL). The retired [dramatiq] url is reached by
    # none, so no warning names it.
    assert sorted(_found(settings, "ack")) == ["broker a.internal", "database db.internal"]
    assert sorted(_found(settings, "worker")) == ["database db.internal"]


def test_the_warning_is_structured_and_carries_no_credential() -> None:
    with capture_logs() as logged:
        warn_plaintext(_settings(), "ingest", {})
    warnings = [e for e in logged if e["event"] == "plaintext_connection"]
    assert [(e["log_level"], e["server"], e["host"], e["port"]) for e in warnings] == [
        ("warning", "database", "db.internal", 5432),
        ("warning", "broker", "a.internal", 6379),
    ]
    assert warnings[0]["tls"] == "sslmode=prefer"
    assert warnings[1]["tls"] == "redis://"
    assert "sslmode=verify-full" in warnings[0]["hint"]
    assert "rediss://" in warnings[1]["hint"]
    assert PASSWORD not in repr(logged)


def test_nothing_is_said_when_every_server_is_local_or_encrypted() -> None:
    settings = from_mapping(
        {
            "database": {"url": "postgresql://sb@127.0.0.1:5432/sb?sslmode=disable"},
            "adapters": [
                {"name": "orders", "mode": "stream", "source": "orders", "url": "redis://127.0.0.1"}
            ],
            "dramatiq": {"url": "rediss://d.internal:6380/1"},
        },
        {},
    )
    with capture_logs() as logged:
        for verb in ("ingest", "ack", "worker"):
            warn_plaintext(settings, verb, {})
    assert logged == []
