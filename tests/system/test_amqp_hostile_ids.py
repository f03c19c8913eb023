"""A producer's ``message_id`` is data (issue 43): whatever it holds, its
message gets exactly one inbox row and the adapter goes on storing the
messages after it, each in one delivery. The review's reproductions, on a
RabbitMQ of the test's own: a NUL in the id (no PostgreSQL text holds one),
three ids that collided through ``:`` with a reused id's derived key, bytes
that are not UTF-8 (RabbitMQ passes properties through unchecked), the
longest id AMQP carries, a header key that is not UTF-8 and a timestamp
past the year 9999."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from ingest.embedded.processes import wait_for, wait_ready
from ingest.embedded.rabbitmq_server import RabbitMqServer
from tests.support.amqp import declare_queue, owned_rabbitmq, queue_counts
from tests.support.amqp_plain import publish_plain
from tests.support.db import query, scalar
from tests.support.processes import Processes, assert_clean_exit

pytestmark = pytest.mark.system
QUEUE = "orders"


@pytest.fixture
def rabbit() -> Iterator[RabbitMqServer]:
    with owned_rabbitmq() as server:
        yield server


def publish_raw(url: str, messages: Sequence[tuple[bytes | str | None, bytes]], **extra: Any) -> None:
    publish_plain(url, QUEUE, messages, **extra)


def body(n: int) -> bytes:
    return json.dumps({"order": n}).encode()


def test_hostile_message_ids_each_get_one_row_and_stop_nothing(
    procs: Processes, make_config: Callable[..., Path], db_url: str, rabbit: RabbitMqServer
) -> None:
    declare_queue(rabbit.url, QUEUE)
    b_body = body(2)
    squatter = f"order-42:{hashlib.sha256(b_body).hexdigest()}"
    hostile: list[tuple[bytes | str | None, bytes]] = [
        ("nul\x00id", body(0)),
        ("order-42", body(1)),
        (squatter, body(3)),
        ("order-42", b_body),  # a reused id: its derived key is what the squatter's id spelled
        (b"\xff\xfe not utf-8", body(4)),
        ("x:" * 127, body(5)),  # 254 bytes, colons throughout
    ]
    normal = [(f"m-{i}", body(100 + i)) for i in range(40)]
    config = make_config(
        {
            "name": "orders",
            "transport": "amqp",
            "source": QUEUE,
            "queue": "orders",
            "url": rabbit.url,
            "batch_size": 10,
            "block_ms": 200,
        }
    )
    ingester = procs.start("ingest", config, name="ingester-1")
    wait_ready(ingester)
    publish_raw(rabbit.url, [*hostile[:4], *normal[:20], *hostile[4:], *normal[20:30]])
    # Properties pamqp cannot decode at all: a header key that is not UTF-8,
    # a timestamp past the year 9999. Kept, keyed by their bodies.
    publish_raw(rabbit.url, [("h-1", body(6))], headers={b"\xff\xfe": "x"})
    publish_raw(rabbit.url, [("t-1", body(7))], timestamp=2**63 - 1)
    publish_raw(rabbit.url, normal[30:])
    total = len(hostile) + len(normal) + 2

    def settled() -> bool:
        ready, unacked, _ = queue_counts(rabbit.url, QUEUE)
        acked = scalar(db_url, "SELECT count(*) FROM inbox WHERE ack_state = 'acked'")
        return ready == 0 and unacked == 0 and acked == total

    wait_for(settled, timeout_s=60, interval_s=0.2, what="every message stored and acked")
    rows = query(
        db_url,
        "SELECT idempotency_key, source_message_id, status, deliveries, body FROM inbox ORDER BY id",
    )
    # One row per message, and none delivered twice: no batch failed.
    assert len(rows) == total
    assert len({key for key, *_ in rows}) == total
    assert [d for *_, d, _ in rows] == [1] * total
    by_body = {b: (key, mid, status) for key, mid, status, _, b in rows}
    assert by_body[body(0)] == ("amqp:orders:nul%00id", "nul\ufffdid", "stored")
    assert by_body[body(1)] == ("amqp:orders:order-42", "order-42", "stored")
    assert by_body[body(3)][0] == f"amqp:orders:order-42%3A{hashlib.sha256(b_body).hexdigest()}"
    assert by_body[b_body] == (
        f"amqp:orders:order-42:{hashlib.sha256(b_body).hexdigest()}",
        "order-42",
        "stored",
    )
    assert by_body[body(5)][0] == "amqp:orders:" + "x%3A" * 127
    assert by_body[body(5)][1] == "x:" * 127
    assert by_body[body(6)] == ("amqp:orders:h-1", "h-1", "stored")  # a table key: decoded
    assert by_body[body(7)] == (  # the timestamp: its properties dropped, keyed by its body
        f"amqp:orders:{hashlib.sha256(body(7)).hexdigest()}",
        hashlib.sha256(body(7)).hexdigest(),
        "stored",
    )
    assert ingester.events("amqp_properties_undecodable")
    # Bytes that are not UTF-8 (which once ended every connection that
    # read them): escaped byte for byte in the key, U+FFFD in the row.
    assert by_body[body(4)] == ("amqp:orders:%uDCFF%uDCFE%20not%20utf-8", "\ufffd\ufffd not utf-8", "stored")
    assert all(status == "stored" for key, (_, _, status) in by_body.items() if key in dict(normal).values())
    assert scalar(db_url, "SELECT count(*) FROM todos") == total
    assert queue_counts(rabbit.url, QUEUE)[:2] == (0, 0)
    assert not ingester.events("poll_step_crashed")
    assert not ingester.events("store_failed")
    assert_clean_exit(ingester, ingester.terminate())
