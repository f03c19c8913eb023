"""A producer's id is data (issue 43, decision 0003): ``keys.key_id`` is
injective and keeps out of a key what could collide or fail storage;
``keys.storable_id`` keeps the id as sent but what PostgreSQL refuses; the
SQS adapter takes an SQS-compatible server's fields through both."""

from __future__ import annotations

import json
from pathlib import Path

from backhalf.writes.keys import key_id, native_key, reused_key, storable_id
from ingest.adapters.sqs.queue import SqsQueueAdapter
from ingest.config import from_mapping

HOSTILE = [
    "order-42",
    "order-42:" + "a" * 64,
    "order-42%3A" + "a" * 64,
    "nul\x00id",
    "nul\ufffdid",
    "sp ace",
    "tab\tid",
    "x:" * 127,
    "\udcff\udcfe raw bytes",
    "\ud800 lone",
    "%",
    "%25",
    "é😀",
    "",
    "\x80",
    "\udcc2\udc80",  # the bytes of "\x80", as a surrogate escape or a JSON client keeps them
    "\udced\udca0\udc80",
]


def test_key_id_is_injective_and_holds_no_separator_nul_or_surrogate() -> None:
    forms = [key_id(i) for i in HOSTILE]
    assert len(set(forms)) == len(HOSTILE)
    for form in forms:
        assert ":" not in form
        assert "\x00" not in form
        form.encode("utf-8")  # strict: storable as text
    assert key_id("order-42") == "order-42"
    assert key_id("3f2a1c9e-7d7b-4c4e-9a51-0a2b7a3c9d10") == "3f2a1c9e-7d7b-4c4e-9a51-0a2b7a3c9d10"


def test_no_producer_id_spells_a_reused_ids_derived_key() -> None:
    digest = bytes(range(32))
    derived = reused_key(native_key("amqp", "orders", key_id("order-42")), digest)
    for producer_id in (f"order-42:{digest.hex()}", *HOSTILE):
        assert native_key("amqp", "orders", key_id(producer_id)) != derived


def test_storable_id_keeps_the_id_but_what_text_refuses() -> None:
    assert storable_id("order-42:abc") == "order-42:abc"
    assert storable_id("a\x00b\ud800c\udcffd") == "a\ufffdb\ufffdc\ufffdd"
    for form in map(storable_id, HOSTILE):
        assert "\x00" not in form
        form.encode("utf-8")


def test_an_sqs_compatible_servers_fields_cannot_fail_the_store(tmp_path: Path) -> None:
    settings = from_mapping(
        {
            "database": {"url": "postgresql+psycopg://u@127.0.0.1:5432/d"},
            "adapters": [{"name": "q", "transport": "sqs", "source": "jobs.fifo", "region": "eu-west-1"}],
        },
        {},
        tmp_path,
    )
    adapter = SqsQueueAdapter(settings.adapters[0])
    # The parse of one received message, offline.
    delivery = adapter._delivery(
        {
            "MessageId": "id:with\x00nul",
            "ReceiptHandle": "h",
            "Body": "body \ud800",
            "Attributes": {"MessageGroupId": "g\x00\ud800", "ApproximateReceiveCount": "1"},
        }
    )
    assert delivery.idempotency_key == "sqs:jobs.fifo:id%3Awith%00nul"
    assert delivery.message_id == "id:with\ufffdnul"
    assert delivery.body == "body \ud800".encode("utf-8", "surrogatepass")  # not UTF-8: poison, not a crash
    assert delivery.attributes is not None
    assert json.loads(delivery.attributes) == {"MessageGroupId": "g\ufffd\ufffd"}
