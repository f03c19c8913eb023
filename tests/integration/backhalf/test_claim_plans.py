"""The workers' claim (``claim_todos``) reads no finished todo, and no more
of a backlog than it claims, whatever the statistics and whether its plan is
custom or generic (DESIGN.md section 7b).

50,000 done todos are retained beside a few pending ones and a few retries
waiting out their backoff. Three cases of statistics: taken while every
todo was pending (the trap measured on a prototype: a generic plan walked
the primary key through every finished todo, and guessed ``LIMIT $n`` at a
tenth of the table, hashing the whole primary key for the update); current
ones; and taken while few todos were pending, before a backlog of 20,000
arrived (PostgreSQL then read the queue by ``ix_todos_queue_status`` and
sorted it whole, every claim). The claim is run as the claimer's connection
runs it (``by_id_session``, then ``claimer_session``), under ``EXPLAIN
(ANALYZE, BUFFERS)``, and rolled back (the generic case overrides the
session's custom plans). Either way its walk is ``ix_todos_claimable``
(claimable rows only, in their order), its update reaches each claimed row
by the primary key, and it reads a handful of rows and pages, not the
table."""

from __future__ import annotations

import json
from typing import Any

import psycopg
import pytest
from psycopg import sql

from backhalf import queries
from backhalf.lifecycle import todos
from tests.support.db import libpq
from tests.support.plans import scans_of

DONE = 50_000
BACKLOG = 20_000
LIMIT = 8  # more than a queue's pending todos: both queues are walked
PARAMS = {"queues": ["orders", "refunds"], "limits": [LIMIT, LIMIT], "limit": LIMIT, "lease_s": 60.0,
          "detail": todos.CLAIMED}  # fmt: skip
# The statement as a server-side prepared one ($n for each parameter), for
# a plan PostgreSQL makes once, before it knows the values.
GENERIC = (
    queries.CLAIM_TODOS.replace("%(queues)b", "$1")
    .replace("%(limit)s", "$2")
    .replace("%(lease_s)s", "$3")
    .replace("%(detail)s", "$4")
    .replace("%(limits)b", "$5")
)


def _retained_history(conn: psycopg.Connection[Any], stats: str) -> None:
    pad = '{"pad": "' + "x" * 100 + '"}'
    conn.execute(
        "INSERT INTO todos (queue, idempotency_key, payload)"
        " SELECT 'orders', 'old-' || g, %s::jsonb FROM generate_series(1, %s::int) g",
        (pad, DONE),
    )
    if stats == "all_pending":
        conn.execute("ANALYZE todos")  # every todo pending, as the statistics will go on saying
    conn.execute("UPDATE todos SET status = 'done', lease_until = NULL")
    # Their old versions vacuumed away, as autovacuum does; column statistics untouched.
    conn.execute("VACUUM todos")
    conn.execute(
        "INSERT INTO todos (queue, idempotency_key, payload)"
        " SELECT q, 'new-' || g, '{}' FROM unnest(ARRAY['orders', 'refunds']) q, generate_series(1, 5) g"
    )
    conn.execute(
        "INSERT INTO todos (queue, idempotency_key, payload, run_after)"
        " SELECT 'orders', 'retry-' || g, '{}', now() + interval '1 hour' FROM generate_series(1, 5) g"
    )
    if stats != "all_pending":
        conn.execute("ANALYZE todos")
    if stats == "few_pending_then_a_backlog":
        conn.execute(
            "INSERT INTO todos (queue, idempotency_key, payload)"
            " SELECT 'orders', 'backlog-' || g, '{}' FROM generate_series(1, %s::int) g",
            (BACKLOG,),
        )


def _explain(conn: psycopg.Connection[Any], *, generic: bool) -> dict[str, Any]:
    """The claim's plan, run (and rolled back): the claim itself, not a guess."""
    if generic:
        conn.execute("SET plan_cache_mode = force_generic_plan")
        conn.execute(
            sql.SQL("PREPARE claim(text[], int, float8, text, int4[]) AS {}").format(sql.SQL(GENERIC))
        )
        statement = sql.SQL(
            "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) EXECUTE claim({}, {}, {}, {}, {})"
        ).format(*(sql.Literal(PARAMS[k]) for k in ("queues", "limit", "lease_s", "detail", "limits")))
        with conn.transaction(force_rollback=True):
            row = conn.execute(statement).fetchone()
        generic_plans = conn.execute("SELECT generic_plans FROM pg_prepared_statements").fetchone()
        assert generic_plans == (1,), "the claim was not planned generically"
    else:
        with conn.transaction(force_rollback=True):
            row = conn.execute(
                "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + queries.CLAIM_TODOS, PARAMS
            ).fetchone()
    assert row is not None
    plan: dict[str, Any] = row[0][0]["Plan"]
    return plan


def _index_of(scan: dict[str, Any]) -> str | None:
    """The index a scan reads by: its own, or its bitmap's (one index only)."""
    if scan["Node Type"] != "Bitmap Heap Scan":
        return scan.get("Index Name")
    bitmaps = scan["Plans"]
    if len(bitmaps) != 1 or bitmaps[0]["Node Type"] != "Bitmap Index Scan":
        return None  # a BitmapOr or BitmapAnd: more than one index
    return str(bitmaps[0]["Index Name"])


def _pages(node: dict[str, Any]) -> int:
    return int(node["Shared Hit Blocks"]) + int(node["Shared Read Blocks"])


@pytest.mark.parametrize("generic", [False, True], ids=["custom_plan", "generic_plan"])
@pytest.mark.parametrize("stats", ["all_pending", "current", "few_pending_then_a_backlog"])
def test_the_claim_reads_no_finished_todo_and_no_more_of_a_backlog_than_it_takes(
    db_url: str, generic: bool, stats: str
) -> None:
    with psycopg.connect(libpq(db_url), autocommit=True) as conn:
        _retained_history(conn, stats)
        todos.by_id_session(conn)  # the claimer's connection, as the worker sets it up
        conn.execute(queries.CLAIMER_SESSION)
        plan = _explain(conn, generic=generic)
        # The finished todos sit in todos_done's partitions (decision 0007).
        row = conn.execute("SELECT relpages FROM pg_class WHERE relname = 'todos_done_p000000'").fetchone()
        # Rolled back: the claim, run for real now, takes the due todos.
        claimed = todos.claim(conn, ["orders", "refunds"], LIMIT, 60)
    assert row is not None
    table_pages = int(row[0])
    assert table_pages > 500, "the retained history fills the table's pages"
    assert int(plan["Actual Rows"]) == len(claimed) == LIMIT
    # Oldest due first: never a finished todo, never a retry not due yet.
    assert {c.todo.idempotency_key.split("-")[0] for c in claimed} <= {"new", "backlog"}
    assert {f"new-{g}" for g in range(1, 6)} <= {
        c.todo.idempotency_key for c in claimed if c.todo.queue == "orders"
    }
    scans = scans_of(plan, "todos_live")
    kinds = [(s["Node Type"], _index_of(s)) for s in scans]
    # The walk on the claimable rows' index; the update by the primary key
    # (probed per id, or as one bitmap of the ids: a generic plan's choice
    # seen in a full run), never by a sequential scan (by_id_session prices
    # it out); never another index's walk, never a partition of finished
    # todos.
    walks = [kind for kind in kinds if kind == ("Index Scan", "ix_todos_live_claimable")]
    updates = [kind for kind in kinds if kind != ("Index Scan", "ix_todos_live_claimable")]
    assert len(walks) == 1, kinds
    assert updates in (
        [("Index Scan", "todos_live_pkey")],
        [("Bitmap Heap Scan", "todos_live_pkey")],
    ), kinds
    assert "todos_done" not in json.dumps(plan)
    # Rows read: the claimed ones, and under a generic plan each probe of
    # the update again for every claimed row (a few dozen), never the table.
    walked = sum(int(s["Actual Rows"]) * int(s["Actual Loops"]) for s in scans)
    assert walked <= LIMIT * (LIMIT + 2), scans
    read = sum(_pages(s) for s in scans)
    assert read < 150, f"{read} pages of todos read for a claim of {LIMIT} (the table has {table_pages})"
    assert _pages(plan) < 400, "the whole claim, its todo_events rows included"
