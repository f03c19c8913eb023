"""backhalf/queries.sql and its composition: every composed statement can be
read whole in tests/unit/backhalf/snapshots/, and the shared blocks stay shared.

After a deliberate change to queries.sql, rewrite the snapshots with
``SWITCHBOARD_UPDATE_SNAPSHOTS=1 pytest tests/unit/backhalf/test_queries.py`` and review
their diff: it is the change PostgreSQL will see.
"""

from __future__ import annotations

import os
import re
from importlib.resources import files
from pathlib import Path
from typing import get_args

import pytest

from backhalf import queries
from backhalf.records import Family
from schema.tables import EVENT_FAMILIES

SNAPSHOTS = Path(__file__).parent / "snapshots"
UPDATE = os.environ.get("SWITCHBOARD_UPDATE_SNAPSHOTS") == "1"
BLOCKS = queries.parse(files("backhalf").joinpath("queries.sql").read_text(encoding="utf-8"))


@pytest.mark.parametrize("name", sorted(queries.COMPOSED))
def test_composed_statements_match_their_snapshots(name: str) -> None:
    snapshot = SNAPSHOTS / f"{name}.sql"
    if UPDATE:
        snapshot.write_text(queries.COMPOSED[name], encoding="utf-8")
    assert snapshot.read_text(encoding="utf-8") == queries.COMPOSED[name], (
        f"{snapshot} is stale: set SWITCHBOARD_UPDATE_SNAPSHOTS=1 to rewrite it, then review its diff"
    )


def test_every_snapshot_is_of_a_composed_statement() -> None:
    assert sorted(p.stem for p in SNAPSHOTS.glob("*.sql")) == sorted(queries.COMPOSED)


def test_every_statement_that_creates_todos_embeds_the_one_definition() -> None:
    block = BLOCKS["todos_create_cte"]
    for name in ("store_native", "store_body", "create_todo"):
        assert block.rstrip("\n") in queries.COMPOSED[name], name
    assert "INSERT INTO todos" not in BLOCKS["store_rows_cte"] + BLOCKS["store_events_cte"]


def _insert_parts(block: str) -> tuple[list[str], str]:
    """An inbox insert's columns and the select list that fills them."""
    found = re.search(r"INSERT INTO inbox \((.*?)\)\s*SELECT (.*?)\n    FROM", block, re.DOTALL)
    assert found is not None
    return [c.strip() for c in found[1].split(",")], " ".join(found[2].split())


def test_the_two_inbox_inserts_write_the_same_columns_the_native_one_its_keys_id() -> None:
    native_columns, native_values = _insert_parts(BLOCKS["store_inbox_native_cte"])
    body_columns, body_values = _insert_parts(BLOCKS["store_inbox_body_cte"])
    assert native_columns == ["id", *body_columns]
    assert native_values == "keyed.inbox_id, " + body_values


def test_a_redelivery_sets_what_the_insert_would_have() -> None:
    """store_again_cte's update takes each column from the message as the
    insert would (excluded.* in the ON CONFLICT it replaced)."""
    again = " ".join(BLOCKS["store_again_cte"].split())
    for assignment in (
        "consumer = %(consumer)s",
        "ack_key = coalesce(r.ak, %(ack_key)s)",
        "ack_group = %(ack_group)s",
        "ack_entry_id = CASE WHEN %(entry_is_id)s THEN r.m ELSE r.e END",
        "ack_xid = CASE WHEN %(by_cursor)s THEN (SELECT pg_current_xact_id()::text::int8) END",
    ):
        assert assignment in again, assignment


def test_the_store_writes_in_lock_order() -> None:
    # todos, then events, then inbox rows, then the queue: see queries.sql.
    for name in ("store_native", "store_body"):
        text = queries.COMPOSED[name]
        order = [
            text.index(f"INSERT INTO {t} ")
            for t in ("todos_live", "todo_events", "events", "inbox", "ack_queue")
        ]
        assert order == sorted(order), name


def test_no_family_or_trust_literal_is_left_in_the_events_insert() -> None:
    events = BLOCKS["store_events_cte"]
    assert "'queue'" not in events
    assert "false" not in events.lower()
    assert {"%(family)s", "%(trust_mode)s", "%(verified)s", "%(verify_detail)s"} <= set(
        re.findall(r"%\(\w+\)s", events)
    )


def test_the_family_type_names_the_schemas_families() -> None:
    assert get_args(Family) == EVENT_FAMILIES


def test_comment_lines_are_not_sent_and_blocks_keep_their_sql() -> None:
    parsed = queries.parse(
        "-- header\n\n-- name: one\n-- why\nSELECT 1\n  -- inside\nFROM t\n\n"
        "-- name: two_cte\nx AS (SELECT 2)\n"
    )
    assert parsed == {"one": "SELECT 1\nFROM t\n", "two_cte": "x AS (SELECT 2)\n"}
    assert not [name for name, text in BLOCKS.items() if "--" in text]


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("SELECT 1\n-- name: one\nSELECT 1\n", "SQL before the first"),
        ("-- name: one\nSELECT 1\n-- name: one\nSELECT 2\n", "named twice"),
        ("-- name: one\n-- only a comment\n", "without SQL: one"),
    ],
)
def test_a_malformed_query_file_is_refused(text: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        queries.parse(text)
