"""Handlers for the worker tests, imported by real dramatiq worker processes
(``[queues.*] handler = "tests.support.handlers:..."``). Each run is recorded
in the test database's ``handler_runs`` (created by :func:`create_runs_table`),
so a test asserts on what ran, how often and where."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import dramatiq
import psycopg
from dramatiq.brokers.stub import StubBroker

from backhalf.lifecycle.todos import Todo

# The test database: set by the test before it starts the workers.
DB_VARIABLE = "SB_TEST_HANDLER_DB"


def create_runs_table(libpq_url: str) -> None:
    with psycopg.connect(libpq_url, connect_timeout=10) as conn:
        conn.execute(
            "CREATE TABLE IF NOT EXISTS handler_runs ("
            " id bigserial PRIMARY KEY, todo_id bigint NOT NULL, attempt int NOT NULL,"
            " pid int NOT NULL, outcome text NOT NULL, at timestamptz NOT NULL DEFAULT now())"
        )


def _record(todo: Todo, outcome: str) -> None:
    with psycopg.connect(os.environ[DB_VARIABLE], connect_timeout=10) as conn:
        conn.execute(
            "INSERT INTO handler_runs (todo_id, attempt, pid, outcome) VALUES (%s, %s, %s, %s)",
            (todo.id, todo.attempt, os.getpid(), outcome),
        )


class Planned(Exception):
    """A failure the payload asked for."""


def scripted(todo: Todo) -> None:
    """Does what the payload says: ``fail_times`` (fail the first N runs),
    ``always_fail``, ``sleep_s`` (after recording the start), ``raise`` (one
    of :data:`ERROR_TEXTS`, every run)."""
    payload: dict[str, Any] = todo.payload if isinstance(todo.payload, dict) else {}
    if payload.get("w") is not None:
        return  # a warm-up run: quick, unrecorded, so the worker times its queue quick
    _record(todo, "started")
    if payload.get("sleep_s"):
        time.sleep(float(payload["sleep_s"]))
    if payload.get("raise"):
        _record(todo, "failed")
        raise Planned(ERROR_TEXTS[str(payload["raise"])])
    if payload.get("always_fail") or todo.attempt <= int(payload.get("fail_times", 0)):
        _record(todo, "failed")
        raise Planned(f"planned failure of run {todo.attempt}")
    _record(todo, "done")


def nothing(todo: Todo) -> None:
    """Does nothing, records nothing: the quickest run there is (a worker's
    recent pace quick, so it prefetches; tests/system/test_claims.py)."""


# Errors built from input, as real handlers raise them (``"raise": NAME``):
# what PostgreSQL's text refuses, what UTF-8 cannot encode, a megabyte of
# letters (a slow path for a careless pattern).
ERROR_TEXTS = {
    "nul": "bad byte \x00 in the input",
    "surrogate": "bad input \udcff here",
    "huge": "echoed input: " + "a" * 1_000_000,
}


async def scripted_async(todo: Todo) -> None:
    """The same, as a coroutine function that awaits."""
    await asyncio.sleep(0.01)
    scripted(todo)


# Existing dramatiq actors, as an application that already uses dramatiq has
# them (on a broker of its own here: the worker calls their functions).
_APP_BROKER = StubBroker()


@dramatiq.actor(broker=_APP_BROKER, actor_name="app_sync_actor")
def existing_sync_actor(todo: Todo) -> None:
    scripted(todo)


@dramatiq.actor(broker=_APP_BROKER, actor_name="app_async_actor")
async def existing_async_actor(todo: Todo) -> None:
    await asyncio.sleep(0.01)  # a real await: the loop runs, the time limit applies
    scripted(todo)


# The URL a leaky handler puts in its error (tests/system/test_secrets_never_leak.py).
LEAKY_URL_VARIABLE = "SB_TEST_LEAKY_URL"


class DownstreamRefused(Exception):
    """A client library's error that names its connection string, password included."""


def leaky(todo: Todo) -> None:
    """Fails every run as a handler whose client library puts its connection
    string in its error message: the URL in ``SB_TEST_LEAKY_URL``."""
    raise DownstreamRefused(f"todo {todo.id}: cannot connect to {os.environ[LEAKY_URL_VARIABLE]}: refused")


def traced(todo: Todo) -> None:
    """Makes a span of its own, as an instrumented handler does (a child of
    its run's: DESIGN.md section 14), and fails the first ``fail_times``
    runs as :func:`scripted` does; with ``sleep_s``, records its start in
    ``handler_runs`` and sleeps (a run to kill) (tests/system/test_traces.py)."""
    from opentelemetry import trace

    payload: dict[str, Any] = todo.payload if isinstance(todo.payload, dict) else {}
    with trace.get_tracer(__name__).start_as_current_span(
        "handler work", attributes={"todo.id": todo.id, "todo.attempt": todo.attempt}
    ):
        if payload.get("sleep_s"):
            _record(todo, "started")
            time.sleep(float(payload["sleep_s"]))
        if todo.attempt <= int(payload.get("fail_times", 0)):
            raise Planned(f"planned failure of run {todo.attempt}")
