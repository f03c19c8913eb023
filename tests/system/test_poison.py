"""A message whose processing crashes the ingester every time is rejected
after max_deliveries, and the good messages around it are not held back."""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest
import redis

from ingest.embedded.processes import SwitchboardProcess, wait_for
from tests.support.config import stream_adapter
from tests.support.db import query, scalar
from tests.support.processes import Processes, assert_clean_exit
from tests.support.streams import xpending

pytestmark = pytest.mark.system
STREAM = "orders"
MAX_DELIVERIES = 3


def test_crashing_message_is_rejected_after_max_deliveries(
    procs: Processes, make_config: Callable[..., Path], db_url: str, redis_url: str
) -> None:
    config = make_config(stream_adapter(STREAM, batch_size=50, max_deliveries=MAX_DELIVERIES))
    with redis.Redis.from_url(redis_url, socket_timeout=10) as r:
        good = [r.xadd(STREAM, {"body": json.dumps({"n": i})}).decode() for i in range(60)]
        crasher = r.xadd(STREAM, {"body": b'{"CRASH-ME": true}'}).decode()
        good += [r.xadd(STREAM, {"body": json.dumps({"n": i})}).decode() for i in range(60, 120)]
    acker = procs.start("ack", config, name="acker-1")

    def crashed_or_done(proc: SwitchboardProcess) -> bool:
        acked = scalar(db_url, "SELECT count(*) FROM inbox WHERE ack_state = 'acked'")
        return not proc.alive() or acked == 121

    crashes = 0
    # Play supervisor (systemd's Restart=always): restart the ingester each time it dies.
    for _ in range(MAX_DELIVERIES + 3):
        ingester = procs.start("ingest", config, name="ingester-1", failpoints="before_store=kill~CRASH-ME")
        wait_for(partial(crashed_or_done, ingester), timeout_s=60, what="a crash or the end")
        if ingester.alive():
            break
        crashes += 1
    assert ingester.alive()
    assert crashes == MAX_DELIVERIES  # it took the ingester down exactly that often
    wait_for(lambda: xpending(redis_url, STREAM) == 0, timeout_s=30, what="an empty PEL")
    assert_clean_exit(ingester, ingester.terminate())
    assert_clean_exit(acker, acker.terminate())
    rejected = query(
        db_url, "SELECT source_message_id, error, deliveries FROM inbox WHERE status = 'rejected'"
    )
    assert [(m, e.split(":")[0]) for m, e, _ in rejected] == [(crasher, "max_deliveries_exceeded")]
    assert rejected[0][2] > MAX_DELIVERIES
    keys = sorted(k for (k,) in query(db_url, "SELECT idempotency_key FROM todos"))
    assert keys == sorted(f"redis:{STREAM}:{i}" for i in good)
    assert scalar(db_url, "SELECT count(*) FROM delivery_attempts") == 0  # cleared once stored


def test_body_failing_the_adapter_schema_is_rejected_and_acked(
    procs: Processes, make_config: Callable[..., Path], db_url: str, redis_url: str, tmp_path: Path
) -> None:
    schema = tmp_path / "order.schema.json"
    schema.write_text(
        json.dumps({"type": "object", "required": ["n"], "properties": {"n": {"type": "integer"}}})
    )
    config = make_config(stream_adapter(STREAM, batch_size=50, schema=str(schema)))
    good: list[str] = []
    bad: dict[str, str] = {}
    with redis.Redis.from_url(redis_url, socket_timeout=10) as r:
        for i in range(200):
            if i % 20 == 7:
                bad[r.xadd(STREAM, {"body": json.dumps({"n": str(i)})}).decode()] = "/n"
            elif i % 20 == 13:
                bad[r.xadd(STREAM, {"body": json.dumps({"m": i})}).decode()] = "/"
            else:
                good.append(r.xadd(STREAM, {"body": json.dumps({"n": i})}).decode())
    ingester = procs.start("ingest", config, name="ingester-1")
    acker = procs.start("ack", config, name="acker-1")
    acked = "SELECT count(*) FROM inbox WHERE ack_state = 'acked'"
    wait_for(
        lambda: scalar(db_url, acked) == 200 and xpending(redis_url, STREAM) == 0,
        timeout_s=60,
        what="all acked",
    )
    assert_clean_exit(ingester, ingester.terminate())
    assert_clean_exit(acker, acker.terminate())
    rejected = dict(query(db_url, "SELECT source_message_id, error FROM inbox WHERE status = 'rejected'"))
    assert set(rejected) == set(bad)
    for entry_id, where in bad.items():
        assert rejected[entry_id].startswith(f"schema_mismatch: at {where}: ")
    keys = sorted(k for (k,) in query(db_url, "SELECT idempotency_key FROM todos"))
    assert keys == sorted(f"redis:{STREAM}:{i}" for i in good)
    assert scalar(db_url, "SELECT count(*) FROM audit_rejected") == len(bad)
