"""What the overview flags (ingest.web.attention), judged on readings made
up here: each kind stands only past its bound, and the verdict is ``ok``
only while nothing stands and no adapter is unhealthy. The reads behind it
run against PostgreSQL in tests/system/test_console_attention.py."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

from backhalf.housekeeping.heartbeats import ProcessRow
from backhalf.reads.attention_views import Bounded, FailedTodo, FailedTodos, RunningTodo
from ingest.config import Settings, from_mapping
from ingest.web import attention
from ingest.web.attention import DEFAULT_TIME_LIMIT_MS, WAITING_GRACE_S, Readings

NONE_FAILED = FailedTodos(0, False, {}, None)


def _settings() -> Settings:
    queues = {"fast": {"handler": "tests.support.handlers:nothing", "time_limit_ms": 1_000}}
    return from_mapping({"database": {"url": "postgresql://localhost/x"}, "queues": queues}, {})


def _proc(state: str, role: str = "worker", **detail: Any) -> ProcessRow:
    now = datetime.now(UTC)
    return ProcessRow(uuid.uuid4(), role, "h1", 1, detail, now, now, None, state, 0.0)


def _readings(**changed: Any) -> Readings:
    base: dict[str, Any] = {
        "failed": NONE_FAILED,
        "running": [],
        "waiting": {},
        "rejected": Bounded(0, False),
        "processes": [],
    }
    return Readings(**{**base, **changed})


def _kinds(readings: Readings) -> dict[str, tuple[int, bool, str]]:
    return {a.kind: (a.count, a.more, a.href) for a in attention.judge(readings, _settings())}


def test_nothing_stands_on_quiet_readings_and_the_verdict_is_ok() -> None:
    quiet = _readings(
        running=[RunningTodo(1, "fast", 0.5), RunningTodo(2, "other", DEFAULT_TIME_LIMIT_MS / 1000 - 1)],
        waiting={"orders": (3, WAITING_GRACE_S - 1)},
        processes=[_proc("alive"), _proc("stopped"), _proc("replaced")],
    )
    assert attention.judge(quiet, _settings()) == []
    assert attention.verdict([], []) == "ok"
    assert attention.verdict([], [{"adapter": "a", "healthy": False}]) == "attention"


def test_each_kind_stands_past_its_bound_with_its_count_and_link() -> None:
    newest = FailedTodo(9, "orders", 30.0, "boom")
    readings = _readings(
        failed=FailedTodos(1002, True, {"a": 1000, "b": 2}, newest),
        running=[RunningTodo(1, "fast", 1.5), RunningTodo(2, "other", DEFAULT_TIME_LIMIT_MS / 1000 + 1)],
        waiting={"orders": (3, WAITING_GRACE_S + 1), "soon": (1, -5.0)},
        rejected=Bounded(4, False),
        processes=[_proc("dead"), _proc("stuck", role="ingest"), _proc("alive")],
    )
    assert _kinds(readings) == {
        "failed-todos": (1002, True, "/todos?status=failed"),
        "long-running": (2, False, "/todos?status=running"),
        "waiting-no-worker": (3, False, "/todos?status=pending&queue=orders"),
        "rejected-inbox": (4, False, "/inbox?status=rejected"),
        "process-failing": (2, False, "/processes"),
    }
    standing = attention.judge(readings, _settings())
    assert [a.kind for a in standing] == list(attention.KINDS)
    assert attention.verdict(standing, []) == "attention"
    failed = standing[0]
    assert failed.example_href == "/todos/9"
    assert failed.detail == "boom"
    assert [href for _, href in failed.links] == [f"/todos?status=failed&queue={q}" for q in "ab"]
    assert standing[1].example_href == "/todos/2"  # the longest running
    assert (failed.example or "").startswith("newest: todo 9")
    # Past the count's limit, a newest not found among the highest ids is not called the newest.
    older = _readings(failed=FailedTodos(1002, True, {"a": 1000, "b": 2}, newest, newest_exact=False))
    [failed] = attention.judge(older, _settings())
    assert (failed.example or "").startswith("a recent one: todo 9")


def test_a_worker_serves_a_queue_only_while_alive_and_naming_it() -> None:
    assert attention.serves(_proc("alive", queues=["orders"]), "orders")
    assert not attention.serves(_proc("alive", queues=["other"]), "orders")
    assert not attention.serves(_proc("dead", queues=["orders"]), "orders")
    assert not attention.serves(_proc("alive", role="ingest", queues=["orders"]), "orders")
