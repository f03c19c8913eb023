"""``switchboard trace`` and ``inbox show`` run as the real CLI after real
``ingest``, ``ack`` and ``worker`` processes carried a message all the way;
every figure they print is checked against PostgreSQL. The other paths of
these commands (not found, replay by filter) run in-process:
tests/integration/actions/test_operator_commands.py."""

from __future__ import annotations

import hashlib
import json
import subprocess
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import pytest
import redis

from ingest.embedded.processes import wait_for
from tests.support import db
from tests.support.config import stream_adapter
from tests.support.downstream import QUEUE, statuses, stop_all
from tests.support.processes import SECRET, Processes, error_lines, switchboard

pytestmark = pytest.mark.system

POISON = b"plain words,\nnot JSON \x1b[31m"  # a terminal escape in it, too


def cli(config: Path) -> Callable[..., subprocess.CompletedProcess[str]]:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        result = switchboard("--config", str(config), *args)
        assert SECRET not in result.stdout + result.stderr
        assert "Traceback" not in result.stderr, result.stderr
        return result

    return run


def one_line(result: subprocess.CompletedProcess[str]) -> str:
    (line,) = error_lines(result)
    return line


def at(text: str) -> datetime:
    return datetime.fromisoformat(text)


def test_trace_follows_a_message_from_xadd_to_done_and_acked(
    procs: Processes, make_config: Callable[..., Path], db_url: str, redis_url: str, runs_db: str
) -> None:
    config = make_config(stream_adapter("orders", batch_size=10), queues={"orders": QUEUE})
    with redis.Redis.from_url(redis_url, socket_timeout=10) as r:
        good = r.xadd("orders", {"body": json.dumps({"n": 1})}).decode()
        poison = r.xadd("orders", {"body": POISON}).decode()
    running = [
        procs.start("ingest", config, name="ingester-1"),
        procs.start("ack", config, name="acker-1"),
        procs.start("worker", config, name="worker-1"),
    ]
    wait_for(
        lambda: statuses(db_url) == {"done": 1} and db.acked(db_url) == 2,
        timeout_s=60,
        what="the todo done and both entries acked",
    )
    stop_all(running)
    run = cli(config)

    key = f"redis:orders:{good}"
    traced = run("trace", key, "--json")
    assert traced.returncode == 0, traced.stderr
    (trail,) = json.loads(traced.stdout)
    ((inbox_id, deliveries, consumer, status, ack_state, acked_at, stored_at, todo_id, event_id),) = db.query(
        db_url,
        "SELECT id, deliveries, consumer, status, ack_state, acked_at, stored_at, todo_id, event_id"
        " FROM inbox WHERE idempotency_key = %(k)s",
        {"k": key},
    )
    row = trail["inbox"]
    assert (row["inbox_id"], row["deliveries"], row["consumer"], row["status"], row["ack_state"]) == (
        inbox_id, deliveries, consumer, status, ack_state,
    )  # fmt: skip
    assert (row["adapter"], row["mode"], row["source"]) == ("orders", "stream", "orders")
    assert (row["ack_kind"], row["ack_key"], row["ack_group"], row["ack_entry_id"]) == (
        "xack", "orders", "switchboard", good,
    )  # fmt: skip
    assert at(row["acked_at"]) == acked_at
    assert at(row["stored_at"]) == stored_at
    assert trail["event"]["id"] == event_id
    assert at(trail["event"]["received_at"]) == db.scalar(
        db_url, "SELECT received_at FROM events WHERE id = %(id)s", {"id": event_id}
    )
    assert (trail["todo"]["id"], trail["todo"]["status"], trail["todo"]["payload"]) == (
        todo_id,
        "done",
        {"n": 1},
    )
    history = db.query(
        db_url,
        "SELECT from_status, to_status, detail, created_at FROM todo_events"
        " WHERE todo_id = %(id)s ORDER BY id",
        {"id": todo_id},
    )
    assert [
        (e["from_status"], e["to_status"], e["detail"], at(e["created_at"])) for e in trail["todo_events"]
    ] == [tuple(h) for h in history]
    assert [h[1] for h in history] == ["pending", "running", "done"]
    # The timeline starts at the XADD (the entry id's milliseconds) and runs
    # through every recorded moment in order.
    xadd = datetime.fromtimestamp(int(good.split("-")[0]) / 1000, UTC)
    assert at(trail["xadd_at"]) == xadd
    steps = trail["timeline"]
    assert at(steps[0]["at"]) == xadd
    assert steps[0]["offset_s"] == 0
    assert [at(s["at"]) for s in steps] == sorted(at(s["at"]) for s in steps)
    for s in steps:
        assert s["offset_s"] == pytest.approx((at(s["at"]) - xadd).total_seconds(), abs=1e-6)
    moments = {s["what"].split(" (")[0]: at(s["at"]) for s in steps}
    assert moments[f"stored: inbox row {inbox_id}, stored"] == stored_at
    assert moments[f"acked: XACK orders switchboard {good}"] == acked_at
    assert moments[f"todo {todo_id}: running -> done"] == history[-1][3]

    # The bare entry id finds the same row; the text form shows the trail.
    text = run("trace", good)
    assert text.returncode == 0, text.stderr
    assert text.stdout.startswith(f"inbox row {inbox_id}: adapter orders (redis stream, source orders)\n")
    assert "+0.000 s  XADD" in text.stdout
    assert f"todo {todo_id}: pending -> running" in text.stdout
    assert f"acked: XACK orders switchboard {good}" in text.stdout

    # The poison entry: its body readable (the terminal escape shown, not
    # sent), its error, and no todo.
    (poison_id, error) = db.query(
        db_url, "SELECT id, error FROM inbox WHERE source_message_id = %(m)s", {"m": poison}
    )[0]
    assert error.startswith("invalid_json")
    shown = run("inbox", "show", str(poison_id))
    assert shown.returncode == 0, shown.stderr
    assert "status             rejected" in shown.stdout
    assert f"error              {error.splitlines()[0]}" in shown.stdout
    assert (
        f"body: {len(POISON)} bytes, sha256 {hashlib.sha256(POISON).hexdigest()}; UTF-8 text" in shown.stdout
    )
    assert "; UTF-8 text\n  plain words,\n  not JSON \\u001b[31m\n" in shown.stdout
    assert "\x1b" not in shown.stdout
    assert f"\n{'todo_id'.ljust(17)}  -\n" in shown.stdout


def test_trace_and_todos_show_say_why_a_pending_todo_waits(
    procs: Processes, make_config: Callable[..., Path], db_url: str, redis_url: str
) -> None:
    """Issue 44: a todo left pending says why: here no worker serves its
    queue; then a retry's backoff."""
    config = make_config(stream_adapter("orders", batch_size=10), queues={"orders": QUEUE})
    with redis.Redis.from_url(redis_url, socket_timeout=10) as r:
        entry = r.xadd("orders", {"body": json.dumps({"n": 2})}).decode()
    ingester = procs.start("ingest", config, name="ingester-1")
    wait_for(lambda: statuses(db_url) == {"pending": 1}, timeout_s=60, what="the todo stored")
    stop_all([ingester])
    run = cli(config)
    text = run("trace", f"redis:orders:{entry}")
    assert text.returncode == 0, text.stderr
    assert "waiting     no live worker serves queue orders" in text.stdout, text.stdout
    todo_id = db.scalar(db_url, "SELECT id FROM todos")
    db.query(db_url, "UPDATE todos SET run_after = now() + interval '1 hour'")
    shown = run("todos", "show", str(todo_id), "--json")
    assert json.loads(shown.stdout)["waiting"].startswith("waits for its retry's backoff: claimable in 3")
