"""The back half's SQL, loaded once at import from ``queries.sql`` beside this
module (shipped as package data).

``queries.sql`` is a sequence of named blocks (``-- name: <name>``), each with
comment lines saying why it is shaped as it is; comment lines are not sent.
Most blocks are whole statements. A few statements share parts, so those are
written as complete CTEs (blocks named ``*_cte``) and composed here with
:func:`_with`, at CTE boundaries only: the two store writes share all but the
inbox insert, and every statement that creates todos embeds the one
``todos_create_cte`` (``backhalf.lifecycle.todos`` owns it). The composed statements
are rendered to ``tests/unit/backhalf/snapshots/`` so that they can be read whole.

A block the file lacks, or one it has that nothing here uses, fails the
import.
"""

from __future__ import annotations

import re
from importlib.resources import files
from typing import LiteralString

# Channel the acker LISTENs on; NOTIFY is delivered only when the store commits.
ACK_CHANNEL = "switchboard_ack"
# Channel the workers LISTEN on: todos are due (created, given back, rescued,
# retried); the payload is the queue.
TODO_CHANNEL = "switchboard_todos"

_NAME = re.compile(r"-- name: (?P<name>[a-z][a-z0-9_]*)\s*")


def parse(text: str) -> dict[str, str]:
    """The blocks of a query file: name -> SQL text without its comment lines."""
    blocks: dict[str, list[str]] = {}
    current: list[str] | None = None
    for number, line in enumerate(text.splitlines(), 1):
        if match := _NAME.fullmatch(line):
            name = match["name"]
            if name in blocks:
                raise ValueError(f"queries.sql:{number}: block {name!r} named twice")
            current = blocks[name] = []
        elif line.lstrip().startswith("--") or not line.strip():
            continue
        elif current is None:
            raise ValueError(f"queries.sql:{number}: SQL before the first '-- name:' line")
        else:
            current.append(line.rstrip())
    empty = [name for name, lines in blocks.items() if not lines]
    if empty:
        raise ValueError(f"queries.sql: blocks without SQL: {', '.join(empty)}")
    return {name: "\n".join(lines) + "\n" for name, lines in blocks.items()}


# LiteralString: the text of the package's own file, never of a runtime value.
_BLOCKS: dict[str, LiteralString] = parse(
    files("backhalf").joinpath("queries.sql").read_text(encoding="utf-8")
)
_used: set[str] = set()


def _block(name: str) -> LiteralString:
    _used.add(name)
    return _BLOCKS[name]


def _with(*ctes: str, then: str) -> LiteralString:
    """``WITH <cte>, <cte>, ... <then>``: a statement from complete CTE blocks."""
    return "WITH " + ",\n".join(_block(c).rstrip("\n") for c in ctes) + "\n" + _block(then)


# The store (backhalf.writes.store). What the inbox holds already:
EXISTING_NATIVE = _block("existing_native")
EXISTING_BODY_PENDING = _block("existing_body_pending")
MERGE_INBOX_BODY = _block("merge_inbox_body")
# The write: todos, their log rows, events, inbox rows, the acker's queue, in
# that order (the lock order), differing only in how the inbox insert dedups.
STORE_NATIVE = _with(
    "store_rows_cte",
    "todos_create_cte",
    "store_events_cte",
    "store_keys_cte",
    "store_inbox_native_cte",
    "store_again_cte",
    "store_written_native_cte",
    "store_ack_queue_cte",
    then="store_result",
)
# The redeliveries a write could not see (rows committed by another store
# after its snapshot): asked again in a statement of their own.
REDELIVER_NATIVE = _with(
    "store_rows_cte",
    "known_keys_cte",
    "store_again_cte",
    "store_written_again_cte",
    "store_ack_queue_cte",
    then="redeliver_result",
)
STORE_BODY = _with(
    "store_rows_cte",
    "todos_create_cte",
    "store_events_cte",
    "store_inbox_body_cte",
    "store_ack_queue_cte",
    then="store_result",
)
DELETE_EVENTS = _block("delete_events")
NOTIFY_STORE = _block("notify_store")

# Todos (backhalf.lifecycle.todos): one todo created or deduped (inbox replay), and the
# store's undo of the todos it created for messages stored already.
CREATE_TODO = _with("replay_row_cte", "todos_create_cte", then="create_todo_result")
DELETE_TODOS = _block("delete_todos")

# Delivery attempts (backhalf.writes.attempts).
RECORD_ATTEMPTS = _block("record_attempts")
KNOWN_ATTEMPTS = _block("known_attempts")
CLEAR_ATTEMPTS = _block("clear_attempts")

# The acker and list recovery (backhalf.writes.acks).
CLAIM_PLAN = _block("claim_plan")
CLAIM_ACKS = _block("claim_acks")
LOCK_PENDING_COPIES = _block("lock_pending_copies")
OWED_NATIVE = _block("owed_native")
MARK_OWN_ACKS = _block("mark_own_acks")
SETTLE_OWN_ACKS = _block("settle_own_acks")
# The horizon first: the cursor's statements read one snapshot. Which
# sessions may write what the cursor reads (the writers), the horizon, and
# `status`'s question by the same rule.
CURSOR_PEEK = _with("ack_writers_cte", "ack_horizon_cte", "cursor_peek_cte", then="cursor_peek")
CURSOR_ACKS = _with("ack_writers_cte", "ack_horizon_cte", "cursor_acks_cte", then="cursor_acks")
ACK_HORIZON_HOLDER = _with("ack_writers_cte", then="ack_horizon_holder")
RESET_ACK_CURSOR = _block("reset_ack_cursor")
MARK_CURSOR_ACKS = _block("mark_cursor_acks")

# The todo lifecycle (backhalf.lifecycle.todos): the workers' claims, ends and leases,
# the rescuer, the operator's cancel and retry.
CLAIM_TODOS = _block("claim_todos")
BY_ID_SESSION = _block("by_id_session")
CLAIMER_SESSION = _block("claimer_session")
END_RUNS = _block("end_runs")
EXTEND_LEASES = _block("extend_leases")
RESCUE_TODOS = _block("rescue_todos")
NOTIFY_WORKERS = _block("notify_workers")
CANCEL_TODOS = _block("cancel_todos")
RETRY_TODOS = _block("retry_todos")
RELEASE_ACKS = _block("release_acks")
RELEASE_ORPHANED_ACKS = _block("release_orphaned_acks")

# The statements composed from several blocks, by name, for the snapshot test.
COMPOSED: dict[str, str] = {
    "store_native": STORE_NATIVE,
    "redeliver_native": REDELIVER_NATIVE,
    "store_body": STORE_BODY,
    "create_todo": CREATE_TODO,
    "cursor_peek": CURSOR_PEEK,
    "cursor_acks": CURSOR_ACKS,
    "ack_horizon_holder": ACK_HORIZON_HOLDER,
}

if _unused := sorted(set(_BLOCKS) - _used):
    raise ValueError(f"queries.sql: blocks not used by backhalf.queries: {', '.join(_unused)}")
del _unused
