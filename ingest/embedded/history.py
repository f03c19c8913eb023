"""A retained history for benches and tests (issue 45): what the pipeline
leaves behind for each finished message, written server-side.

For each message the rows the store, the acker and a worker write: an inbox
row (stored, acked), its event, its todo (``done``, one attempt) and the
todo's three ``todo_events`` rows (created, claimed, done), spread evenly
over the last ``days`` days in id order, the newest an hour ago. Keys are a
Redis stream's (``redis:{stream}:{ms}-{seq}``) of the millisecond the row was
stored, so a new entry's key sorts after every retained one, as in a real
stream. Each chunk is one transaction, whose id is the rows' ``ack_xid``, and
the adapter's ack cursor stands past them: the acker had acked them all.

Not product code: ``scripts/bench_history.py`` and the tests that check a
hot statement's cost does not grow with the history use it.
"""

from __future__ import annotations

from typing import Any

import psycopg

from backhalf.housekeeping import partitions
from schema.tables import PARTITIONED_TABLES

CHUNK = 250_000

# Row n of ``rows`` was written at this moment (a bound ``days`` and ``rows``).
_AT = (
    "(now() - %(days)s * interval '1 day'"
    " + (n::float8 / %(rows)s) * (%(days)s * interval '1 day' - interval '1 hour'))"
)
# The sequence part is n: unique whatever two fills' moments coincide.
_ENTRY = "((extract(epoch FROM $AT) * 1000)::int8 || '-' || n)"
_KEY = "('redis:' || %(stream)s || ':' || $ENTRY)"
_PAYLOAD = "jsonb_build_object('order_id', n, 'sku', 'SKU-' || n %% 97, 'qty', 1 + n %% 7, 'note', 'history')"
_SERIES = "generate_series(%(first)s::int8, %(last)s::int8) AS n"


def _expand(statement: str) -> str:
    """The statement with its fragments in place: constants of this module only."""
    for name, fragment in (("$KEY", _KEY), ("$ENTRY", _ENTRY), ("$AT", _AT), ("$PAYLOAD", _PAYLOAD),
                           ("$SERIES", _SERIES)):  # fmt: skip
        statement = statement.replace(name, fragment)
    return statement


_TODOS = _expand("""
INSERT INTO todos (queue, idempotency_key, payload, status, attempts, created_at, updated_at, run_after)
SELECT %(queue)s, $KEY, $PAYLOAD, 'done', 1, $AT, $AT + interval '20 ms', $AT
FROM $SERIES ORDER BY n
RETURNING id
""")
_TODO_EVENTS = _expand("""
INSERT INTO todo_events (todo_id, from_status, to_status, detail, created_at)
SELECT %(todo0)s + n - %(first)s, s.f, s.t, s.d, $AT + s.after
FROM $SERIES,
     (VALUES (NULL, 'pending', 'created by adapter ' || %(adapter)s, interval '0'),
             ('pending', 'running', 'claimed', interval '10 ms'),
             ('running', 'done', 'ran', interval '20 ms')) AS s(f, t, d, after)
ORDER BY n, s.after
""")
_EVENTS = _expand("""
INSERT INTO events (family, adapter, trust_mode, verified, verify_detail, idempotency_key,
                    source_message_id, payload, todo_id, received_at)
SELECT 'queue', %(adapter)s, 'queue', false, 'redis acl: default', $KEY, $ENTRY, $PAYLOAD,
       %(todo0)s + n - %(first)s, $AT
FROM $SERIES ORDER BY n
RETURNING id
""")
_INBOX = _expand("""
INSERT INTO inbox (adapter, idempotency_key, source_message_id, consumer, body, ack_kind, ack_key,
                   ack_group, ack_entry_id, ack_state, acked_at, status, todo_id, event_id,
                   stored_at, ack_xid)
SELECT %(adapter)s, $KEY, $ENTRY, 'history-1', convert_to($PAYLOAD::text, 'UTF8'), 'xack',
       %(stream)s, 'switchboard', $ENTRY, 'acked', $AT + interval '5 ms', 'stored',
       %(todo0)s + n - %(first)s, %(event0)s + n - %(first)s, $AT, pg_current_xact_id()::text::int8
FROM $SERIES ORDER BY n
RETURNING id
""")
_KEYS = """
INSERT INTO inbox_keys (adapter, idempotency_key, inbox_id)
SELECT adapter, idempotency_key, id FROM inbox WHERE id >= %(inbox0)s AND id < %(inbox0)s + %(count)s
"""
_JUMP = "SELECT setval(pg_get_serial_sequence(%(table)s, 'id'), %(first)s, false)"
_LAST_ID = "SELECT pg_sequence_last_value(pg_get_serial_sequence(%(t)s, 'id')::regclass)"
_CURSOR = """
INSERT INTO ack_cursors (adapter, xid, inbox_id, cluster)
SELECT %(adapter)s, max(ack_xid), max(id), (SELECT system_identifier::text FROM pg_control_system())
FROM inbox WHERE adapter = %(adapter)s
ON CONFLICT (adapter) DO UPDATE SET xid = excluded.xid, inbox_id = excluded.inbox_id
"""


def fill(
    conn: psycopg.Connection[Any],
    rows: int,
    *,
    days: float = 30,
    adapter: str = "bench",
    stream: str = "bench",
    queue: str = "bench",
    start: int = 1,
    on_chunk: Any = None,
    by_day: bool = False,
) -> None:
    """Write ``rows`` finished messages (numbered from ``start``) on an
    autocommit connection; the adapter must be registered. ``on_chunk(done)``
    after each chunk. ``by_day``: each day's rows in partitions of their
    own, as a deployment's acker would have begun them, and today's after."""
    base: dict[str, Any] = {
        "rows": start + rows - 1,
        "days": days,
        "adapter": adapter,
        "stream": stream,
        "queue": queue,
    }
    last = start + rows - 1
    per_day = max(1, -(-rows // max(1, int(days)))) if by_day else rows
    for day_first in range(start, last + 1, per_day):
        if by_day:
            _next_partition(conn)
        day_last = min(day_first + per_day - 1, last)
        for first in range(day_first, day_last + 1, CHUNK):
            span = {**base, "first": first, "last": min(first + CHUNK - 1, day_last)}
            _chunk(conn, span)
            if on_chunk is not None:
                on_chunk(span["last"] - start + 1)
    if by_day:
        _next_partition(conn)  # today's rows in a partition of their own
    conn.execute(_CURSOR, {"adapter": adapter})


def _chunk(conn: psycopg.Connection[Any], span: dict[str, Any]) -> None:
    with conn.transaction():
        # Nothing else writes meanwhile, so each identity hands the chunk
        # consecutive ids: row n's are the first ones plus n - first.
        span["todo0"] = _first_of(conn.execute(_TODOS, span).fetchall())
        conn.execute(_TODO_EVENTS, span)
        span["event0"] = _first_of(conn.execute(_EVENTS, span).fetchall())
        span["inbox0"] = _first_of(conn.execute(_INBOX, span).fetchall())
        conn.execute(_KEYS, {**span, "count": span["last"] - span["first"] + 1})


def _next_partition(conn: psycopg.Connection[Any]) -> None:
    """Each history table's ids from the next partition on (made if
    missing), as the acker's upkeep does when a period begins."""
    for table in PARTITIONED_TABLES:
        numbers = [
            int(name.rsplit("_p", 1)[1])
            for (name,) in conn.execute(partitions.PARTITIONS_OF, {"parent": table}).fetchall()
            if name != partitions.LATE_TODOS
        ]
        identity = partitions.identity_of(table)
        row = conn.execute(_LAST_ID, {"t": identity}).fetchone()
        n = (partitions.number_of(int(row[0])) if row and row[0] is not None else 0) + 1
        if n not in numbers:
            with conn.transaction():
                for statement in partitions.create(table, n):
                    conn.execute(statement)
        conn.execute(_JUMP, {"table": identity, "first": partitions.first_id(n)})


def _first_of(ids: list[tuple[Any, ...]]) -> int:
    values = [int(r[0]) for r in ids]
    if max(values) - min(values) + 1 != len(values):
        raise RuntimeError("history: ids of one chunk are not consecutive (another writer?)")
    return min(values)
