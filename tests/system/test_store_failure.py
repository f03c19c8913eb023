"""A todo-creation failure in PostgreSQL: logged, nothing stored or acked, and
redelivered once the fault is fixed."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from ingest.embedded.processes import wait_for
from tests.support.config import stream_adapter
from tests.support.db import query, scalar
from tests.support.oracle import assert_clean_end, wait_all_acked
from tests.support.processes import Processes
from tests.support.streams import produce, xpending

pytestmark = pytest.mark.system
STREAM = "orders"


def test_todo_creation_failure_is_logged_not_acked_and_redelivered(
    procs: Processes, make_config: Callable[..., Path], db_url: str, redis_url: str
) -> None:
    query(
        db_url,
        """CREATE FUNCTION fail_todo() RETURNS trigger LANGUAGE plpgsql AS
           $$ BEGIN RAISE EXCEPTION 'todo insert refused by test'; END $$;
           CREATE TRIGGER fail_todo BEFORE INSERT ON todos FOR EACH ROW EXECUTE FUNCTION fail_todo();""",
    )
    config = make_config(stream_adapter(STREAM))
    ids = produce(redis_url, STREAM, 5)
    ingester = procs.start("ingest", config, name="ingester-1")
    acker = procs.start("ack", config, name="acker-1")
    failures = wait_for(lambda: ingester.events("store_failed"), timeout_s=30, what="a logged store failure")
    f = failures[0]
    assert f["error_type"] == "StoreError"
    assert f["cause"] == "RaiseException"
    assert "adapter orders" in f["error"]
    assert "todo insert refused by test" in f["error"]
    assert f["level"] == "warning"
    assert scalar(db_url, "SELECT count(*) FROM inbox") == 0
    assert xpending(redis_url, STREAM) == 5  # delivered, never acked
    query(db_url, "DROP TRIGGER fail_todo ON todos")
    wait_all_acked(db_url, redis_url, 5, timeout_s=30, what="redelivery after the fault is fixed")
    assert_clean_end(db_url, redis_url, ids, ingester, acker)
