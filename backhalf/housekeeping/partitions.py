"""The history tables' partitions (issue 45,
docs/decisions/0005-history-flat-then-partitioned.md, and for finished
todos 0007-finished-todos-in-partitions.md).

``inbox``, ``events``, ``todo_events`` and ``todos_done`` (the finished
todos) are partitioned by ranges of their ids: partition ``n`` of a table,
``{table}_p{n:06d}``, holds the ids ``[n * PERIOD_IDS, (n + 1) *
PERIOD_IDS)`` (partition 0 from the lowest id: every row written before the
tables were partitioned). Ids are handed out in order by each table's
identity (``todos_done``'s rows by ``todos``'s), so a partition holds one
span of time, and a lookup by id reaches one partition. A todo finishes
long after it was made: one whose partition was dropped meanwhile lands in
``todos_done_late``, the default partition, deleted row by row.

A new partition is made as a plain table with a ``CHECK`` of its bounds and
then attached: PostgreSQL then neither scans it nor blocks the writers of
the parent, which a ``CREATE TABLE ... PARTITION OF`` would. Its indexes,
constraints and foreign key come from the parent on attach.

The statements are DDL, which takes no bound parameters: the names are
built from :data:`schema.tables.PARTITIONED_TABLES` and the bounds are
integers computed here, never a runtime value from outside.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import psycopg
from psycopg import sql

from schema.tables import IDENTITY_OF, INBOX_FILLFACTOR, PARTITIONED_TABLES, todos

PERIOD_IDS = 1 << 40  # ids a partition holds: 1.1e12, past any period's rows
# The storage parameters each partition of a table is made with (a
# partitioned table holds none itself).
_STORAGE = {"inbox": {"fillfactor": INBOX_FILLFACTOR}}


def partition_name(table: str, n: int) -> str:
    if table not in PARTITIONED_TABLES or n < 0:
        raise ValueError(f"no partition {n} of {table!r}")
    return f"{table}_p{n:06d}"


def first_id(n: int) -> int:
    """The lowest id partition ``n`` holds (partition 0: from the lowest of all)."""
    return n * PERIOD_IDS


def number_of(row_id: int) -> int:
    """The partition an id belongs to."""
    return max(0, row_id // PERIOD_IDS)


def id_bounds(ids: list[int]) -> dict[str, int | None]:
    """The lowest and highest of ``ids``: bound parameters that let PostgreSQL
    read only the partitions between them (an ``= ANY(array)`` alone is
    looked up in every partition; decision 0005)."""
    return {"low_id": min(ids, default=None), "high_id": max(ids, default=None)}


def _bound(n: int) -> sql.Composable:
    return sql.SQL("MINVALUE") if n == 0 else sql.Literal(first_id(n))


def create(table: str, n: int) -> list[sql.Composed]:
    """The statements that make partition ``n`` of ``table`` and attach it."""
    name = sql.Identifier(partition_name(table, n))
    parent = sql.Identifier(table)
    storage = _STORAGE.get(table, {})
    with_ = (
        sql.SQL(" WITH ({})").format(
            sql.SQL(", ").join(
                sql.SQL("{} = {}").format(sql.SQL(k), sql.Literal(v)) for k, v in storage.items()
            )
        )
        if storage
        else sql.SQL("")
    )
    low = sql.SQL("") if n == 0 else sql.SQL("id >= {} AND ").format(sql.Literal(first_id(n)))
    check = sql.Identifier(f"{partition_name(table, n)}_bounds")
    return [
        sql.SQL("CREATE TABLE {} (LIKE {} INCLUDING DEFAULTS INCLUDING CONSTRAINTS){}").format(
            name, parent, with_
        ),
        sql.SQL("ALTER TABLE {} ADD CONSTRAINT {} CHECK ({}id < {})").format(
            name, check, low, sql.Literal(first_id(n + 1))
        ),
        sql.SQL("ALTER TABLE {} ATTACH PARTITION {} FOR VALUES FROM ({}) TO ({})").format(
            parent, name, _bound(n), sql.Literal(first_id(n + 1))
        ),
        # Redundant once attached (the partition's bound says the same).
        sql.SQL("ALTER TABLE {} DROP CONSTRAINT {}").format(name, check),
    ]


def attach_existing(table: str, old: str) -> list[sql.Composed]:
    """Attach ``old`` (a plain table with ``table``'s columns, every id below
    partition 1's first) as partition 0 of ``table``."""
    # The attach reads every row once, to check its bound.
    return [
        sql.SQL("ALTER TABLE {} ATTACH PARTITION {} FOR VALUES FROM (MINVALUE) TO ({})").format(
            sql.Identifier(table), sql.Identifier(old), sql.Literal(first_id(1))
        )
    ]


# --- Upkeep: partitions ahead, a new period begun, old ones retired ----------------------------

# Each table's moment column: when its row was written (a todo: made; the
# identity's table is read, which holds the todos not finished too).
_WRITTEN_AT = {
    "inbox": "stored_at",
    "events": "received_at",
    "todo_events": "created_at",
    "todos_done": "created_at",
}
LATE_TODOS = "todos_done_late"  # the finished todos whose partition was dropped
AHEAD = 2  # empty partitions kept ready past the current one
UPKEEP_LOCK = (
    0x5B_0045  # the session advisory lock one pass holds (backhalf.housekeeping.migrate's is another)
)
UPKEEP_STATEMENT_TIMEOUT = "10min"
# A partition past its retention that still holds something owed (an ack
# pending) is looked at again only this often: each look reads it whole.
OWED_RECHECK_S = 3600.0


@dataclass(frozen=True, slots=True)
class Upkeep:
    """What one pass did, per table: partitions made, the period begun
    (the new current partition), partitions dropped; and what it could not
    do for want of the tables' ownership (a process role that does not own
    them: ``switchboard migrate``'s role must)."""

    made: dict[str, list[int]] = field(default_factory=dict)
    begun: dict[str, int] = field(default_factory=dict)
    dropped: dict[str, list[int]] = field(default_factory=dict)
    refused: list[str] = field(default_factory=list)
    late_deleted: int = 0  # finished todos deleted from LATE_TODOS


# The partitions of a table (``%(parent)s``), by name: the bench's history
# fill reads them too (ingest.embedded.history).
PARTITIONS_OF = (
    "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid"
    " WHERE i.inhparent = %(parent)s::regclass"
)


def _id_range(n: int) -> dict[str, int]:
    """The ids partition ``n`` holds, ``lo <= id < hi`` (partition 0: from the lowest)."""
    return {"lo": first_id(n) if n else -(2**63), "hi": first_id(n + 1)}


async def _numbers(cur: psycopg.AsyncCursor[Any], table: str) -> list[int]:
    await cur.execute(PARTITIONS_OF, {"parent": table})
    prefix = f"{table}_p"
    return sorted(int(name[len(prefix) :]) for (name,) in await cur.fetchall() if name.startswith(prefix))


def identity_of(table: str) -> str:
    """The table whose identity hands out ``table``'s ids."""
    return IDENTITY_OF.get(table, table)


async def _sequence_at(cur: psycopg.AsyncCursor[Any], table: str) -> int:
    """Where the table's identity stands: its ``last_value``, read from the
    sequence itself (``pg_sequence_last_value`` answers NULL right after a
    ``setval(..., false)``, which is how a period begins)."""
    await cur.execute(
        "SELECT n.nspname, c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
        " WHERE c.oid = pg_get_serial_sequence(%(table)s, 'id')::regclass",
        {"table": identity_of(table)},
    )
    row = await cur.fetchone()
    if row is None:
        raise ValueError(f"{table} has no identity")
    await cur.execute(sql.SQL("SELECT last_value FROM {}").format(sql.Identifier(str(row[0]), str(row[1]))))
    value = await cur.fetchone()
    return int(value[0]) if value else 0


async def _first_row_at(
    cur: psycopg.AsyncCursor[Any], table: str, n: int, *, newest: bool
) -> datetime | None:
    """When partition ``n``'s first (or newest) row was written, by its id:
    one probe (of each partition of ``todos`` for the todos' ids)."""
    order = sql.SQL("DESC" if newest else "ASC")
    await cur.execute(
        sql.SQL("SELECT {} FROM {} WHERE id >= %(lo)s AND id < %(hi)s ORDER BY id {} LIMIT 1").format(
            sql.Identifier(_WRITTEN_AT[table]), sql.Identifier(identity_of(table)), order
        ),
        _id_range(n),
    )
    row = await cur.fetchone()
    return None if row is None else row[0]


async def _owed(cur: psycopg.AsyncCursor[Any], n: int) -> bool:
    """Does inbox partition ``n`` hold a row whose ack is still owed?"""
    params = _id_range(n)
    await cur.execute(
        "SELECT EXISTS (SELECT FROM ack_queue WHERE inbox_id >= %(lo)s AND inbox_id < %(hi)s)"
        " OR EXISTS (SELECT FROM inbox WHERE id >= %(lo)s AND id < %(hi)s AND ack_state = 'pending')",
        params,
    )
    row = await cur.fetchone()
    return bool(row and row[0])


async def upkeep(
    pg: psycopg.AsyncConnection[Any],
    *,
    period: timedelta,
    keep: timedelta | None,
    keep_done: timedelta | None = None,
    owed_seen: dict[tuple[str, int], float] | None = None,
) -> Upkeep:
    """One pass over the history tables, on an autocommit connection: the
    partitions ahead made; with ``keep``, a new period begun where the
    current one's first row is ``period`` old, and every partition before
    the current one whose newest row is older than ``keep`` dropped, unless
    an ack in it is still owed. ``keep_done`` is the finished todos' own
    (``todos_done``): a partition goes once every todo in it finished that
    long ago and no ack waits for one. Without a keep no period begins: the
    partitions would only multiply the probes of lookups not by id.
    ``owed_seen``: when each such partition was last found owing (kept by
    the caller between passes), so it is read again only every
    :data:`OWED_RECHECK_S`. One pass at a time (two ackers, a migrate):
    under a session advisory lock, or none at all."""
    done = Upkeep()
    seen = owed_seen if owed_seen is not None else {}
    async with pg.cursor() as cur:
        await cur.execute("SELECT pg_try_advisory_lock(%(key)s)", {"key": UPKEEP_LOCK})
        row = await cur.fetchone()
        if not (row and row[0]):
            return done
        try:
            # Bounded, but longer than a request's: a partition's owed check
            # reads it whole, and a detach waits (a lock wait) for the
            # transactions before it.
            await cur.execute(
                "SELECT set_config('statement_timeout', %(t)s, false),"
                " set_config('lock_timeout', %(t)s, false)",
                {"t": UPKEEP_STATEMENT_TIMEOUT},
            )
            owner = await _owns_history(cur)
            for table in PARTITIONED_TABLES:
                kept = keep_done if table == "todos_done" else keep
                await _upkeep_table(cur, pg, table, period, kept, done, seen, owner=owner)
            if keep_done is not None and owner:
                done = dataclasses.replace(done, late_deleted=await _delete_late(cur, keep_done))
        finally:
            await cur.execute("RESET statement_timeout")
            await cur.execute("RESET lock_timeout")
            await cur.execute("SELECT pg_advisory_unlock(%(key)s)", {"key": UPKEEP_LOCK})
    return done


async def _owns_history(cur: psycopg.AsyncCursor[Any]) -> bool:
    """May this session make and drop the history's partitions (is it, or
    is it a member of, the tables' owner)?"""
    await cur.execute(
        "SELECT bool_and(pg_has_role(current_user, c.relowner, 'USAGE')) FROM pg_class c"
        " WHERE c.oid IN ('inbox'::regclass, 'events'::regclass, 'todo_events'::regclass,"
        " 'todos'::regclass, 'todos_done'::regclass)"
    )
    row = await cur.fetchone()
    return bool(row and row[0])


async def _upkeep_table(
    cur: psycopg.AsyncCursor[Any],
    pg: psycopg.AsyncConnection[Any],
    table: str,
    period: timedelta,
    keep: timedelta | None,
    done: Upkeep,
    owed_seen: dict[tuple[str, int], float],
    *,
    owner: bool,
) -> None:
    if not owner:
        done.refused.append(table)
    else:
        await _finish_interrupted(cur, table)
    numbers = await _numbers(cur, table)
    current = number_of(await _sequence_at(cur, table))
    for n in range(current + 1, current + 1 + AHEAD):
        if n not in numbers and owner:
            if not await _make(cur, pg, table, n):
                break  # the next pass: a partition ahead is to spare
            done.made.setdefault(table, []).append(n)
            numbers.append(n)
    if keep is None:
        # Nothing is ever dropped: one partition holds it all, and lookups
        # not by id (a todo's history, a key) probe one partition, not one
        # per period since the start.
        return
    # Only partitions that were behind the current one before this pass go:
    # one this pass moved the ids away from may still get rows from ids
    # drawn before the move (a store in flight).
    behind = current
    began = await _first_row_at(cur, table, current, newest=False)
    if began is not None and current + 1 in numbers and await _older_than(cur, began, period):
        # The identity moves to the next partition's first id: every id
        # handed out from now on lands there (ids already drawn finish in
        # the partition they belong to). Only forward, under the lock.
        if await _sequence_at(cur, table) < first_id(current + 1):
            await cur.execute(
                "SELECT setval(pg_get_serial_sequence(%(table)s, 'id'), %(next)s, false)",
                {"table": identity_of(table), "next": first_id(current + 1)},
            )
            done.begun[table] = current + 1
        current += 1
    if owner:
        await _retire_past(cur, pg, table, [m for m in numbers if m < behind], keep, done, owed_seen)


async def _make(cur: psycopg.AsyncCursor[Any], pg: psycopg.AsyncConnection[Any], table: str, n: int) -> bool:
    """Make partition ``n`` of ``table``, all of it or nothing. Beside
    ``todos_done``'s default partition the attach locks that partition (and
    reads it, to check none of its rows belongs to the new one), which
    every end that finishes a todo may need: it waits at most
    :data:`RETIRE_LOCK_TIMEOUT` (False: not made now)."""
    try:
        async with pg.transaction():
            if table == "todos_done":
                await cur.execute(_LOCAL_LOCK_TIMEOUT, {"t": RETIRE_LOCK_TIMEOUT})
            for statement in create(table, n):
                await cur.execute(statement)
    except psycopg.errors.LockNotAvailable:
        return False
    return True


async def _retire_past(
    cur: psycopg.AsyncCursor[Any],
    pg: psycopg.AsyncConnection[Any],
    table: str,
    behind: list[int],
    keep: timedelta,
    done: Upkeep,
    owed_seen: dict[tuple[str, int], float],
) -> None:
    """Drop each partition of ``behind`` (oldest first) whose newest row is
    older than ``keep`` and in which nothing is owed."""
    for n in behind:
        newest = await _first_row_at(cur, table, n, newest=True)
        if newest is not None and not await _older_than(cur, newest, keep):
            break  # the later ones are newer still
        if not await _nothing_owed(cur, pg, table, n, keep, owed_seen):
            continue
        if await _retire(cur, pg, table, n, keep):
            done.dropped.setdefault(table, []).append(n)


async def _nothing_owed(
    cur: psycopg.AsyncCursor[Any],
    pg: psycopg.AsyncConnection[Any],
    table: str,
    n: int,
    keep: timedelta,
    owed_seen: dict[tuple[str, int], float],
) -> bool:
    """May partition ``n``, past its retention, go? An inbox partition's
    keys are released here (none of its acks owed); a finished todos'
    partition waits for its last todo to be as old."""
    if table == "inbox":
        return await _release_keys(cur, pg, n, owed_seen)
    if table == "todos_done":
        return await _all_finished_before(cur, n, keep, owed_seen)
    return True


async def _finish_interrupted(cur: psycopg.AsyncCursor[Any], table: str) -> None:
    """A pass cut off mid-way: a detach left pending is finished, and an
    empty table of a partition's name that is not attached is dropped. One
    with rows is left alone (an operator's archive and a failed restore
    look the same as a retirement cut off between its detach and its drop:
    that one is dropped by hand, docs/operating.md)."""
    await cur.execute(
        "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid"
        " WHERE i.inhparent = %(t)s::regclass AND i.inhdetachpending",
        {"t": table},
    )
    for (name,) in await cur.fetchall():
        await cur.execute(
            sql.SQL("ALTER TABLE {} DETACH PARTITION {} FINALIZE").format(
                sql.Identifier(table), sql.Identifier(str(name))
            )
        )
    await cur.execute(
        "SELECT c.relname FROM pg_class c WHERE c.relkind = 'r' AND c.relnamespace = 'public'::regnamespace"
        " AND c.relname ~ ('^' || %(t)s || '_p[0-9]{6}$') AND NOT c.relispartition",
        {"t": table},
    )
    for (name,) in await cur.fetchall():
        stray = sql.Identifier(str(name))
        await cur.execute(sql.SQL("SELECT EXISTS (SELECT FROM {})").format(stray))
        row = await cur.fetchone()
        if row and row[0]:
            continue  # rows in it: not ours to judge (an operator's archive, a failed restore)
        await cur.execute(sql.SQL("DROP TABLE {}").format(stray))


async def _release_keys(
    cur: psycopg.AsyncCursor[Any],
    pg: psycopg.AsyncConnection[Any],
    n: int,
    owed_seen: dict[tuple[str, int], float],
) -> bool:
    """Delete inbox partition ``n``'s native keys, unless an ack in it is
    owed. In one transaction with a check after the delete: a store holding
    one of the keys (a late redelivery) is waited for, and a row it made
    pending again is then seen, and the keys stay. With the keys gone no
    store reaches the partition's rows. False: kept."""
    seen = owed_seen.get(("inbox", n))
    if seen is not None and time.monotonic() - seen < OWED_RECHECK_S:
        return False
    if await _owed(cur, n):  # read-only first: no delete of every key to undo
        owed_seen[("inbox", n)] = time.monotonic()
        return False
    owing: list[bool] = []  # set inside: the transaction block swallows its Rollback
    async with pg.transaction():
        await cur.execute(
            "DELETE FROM inbox_keys WHERE inbox_id >= %(lo)s AND inbox_id < %(hi)s", _id_range(n)
        )
        if await _owed(cur, n):
            owing.append(True)
            raise psycopg.Rollback  # the keys stay
    if owing:
        owed_seen[("inbox", n)] = time.monotonic()
        return False
    owed_seen.pop(("inbox", n), None)
    return True


async def _all_finished_before(
    cur: psycopg.AsyncCursor[Any], n: int, keep: timedelta, owed_seen: dict[tuple[str, int], float]
) -> bool:
    """Did every todo of ``todos_done`` partition ``n`` finish more than
    ``keep`` ago (and no ack waits for one)? Todos finish in any order, so
    this reads the partition whole (no index on ``updated_at``: every
    finish would pay for it): once per partition, and again only every
    :data:`OWED_RECHECK_S` while one finished too lately."""
    seen = owed_seen.get(("todos_done", n))
    if seen is not None and time.monotonic() - seen < OWED_RECHECK_S:
        return False
    await cur.execute(
        sql.SQL(
            "SELECT EXISTS (SELECT FROM {} WHERE updated_at >= now() - %(keep)s)"
            " OR EXISTS (SELECT FROM ack_queue WHERE waiting_for >= %(lo)s AND waiting_for < %(hi)s)"
        ).format(sql.Identifier(partition_name("todos_done", n))),
        {"keep": keep, **_id_range(n)},
    )
    row = await cur.fetchone()
    if row and row[0]:
        owed_seen[("todos_done", n)] = time.monotonic()
        return False
    owed_seen.pop(("todos_done", n), None)
    return True


async def _delete_late(cur: psycopg.AsyncCursor[Any], keep: timedelta) -> int:
    """Delete the late finished todos (:data:`LATE_TODOS`, few: a todo that
    finished after its period's partition was dropped) once they finished
    ``keep`` ago, with no ack waiting for one: a scan of that one table, by
    the tables' owner, as the drops are."""
    await cur.execute(
        sql.SQL(
            "DELETE FROM {} t WHERE t.updated_at < now() - %(keep)s"
            " AND NOT EXISTS (SELECT FROM ack_queue q WHERE q.waiting_for = t.id)"
        ).format(sql.Identifier(LATE_TODOS)),
        {"keep": keep},
    )
    return cur.rowcount


# How long a finished todos' partition's retirement waits for its lock:
# meanwhile the ends that finish todos wait behind it.
RETIRE_LOCK_TIMEOUT = "1s"
_LOCAL_LOCK_TIMEOUT = "SELECT set_config('lock_timeout', %(t)s, true)"
# By name: partition 0 (the table as it was before migration 0017) has its
# columns in the order they were added.
_TODO_COLUMNS = sql.SQL(", ").join(sql.Identifier(c.name) for c in todos.columns)


async def _retire(
    cur: psycopg.AsyncCursor[Any], pg: psycopg.AsyncConnection[Any], table: str, n: int, keep: timedelta
) -> bool:
    """Detach partition ``n`` without blocking the table's writers, then drop
    it. False: not now (the next pass tries again)."""
    name = sql.Identifier(partition_name(table, n))
    parent = sql.Identifier(table)
    if table != "todos_done":
        await cur.execute(sql.SQL("ALTER TABLE {} DETACH PARTITION {} CONCURRENTLY").format(parent, name))
        await cur.execute(sql.SQL("DROP TABLE {}").format(name))
        return True
    # todos_done has a default partition, beside which PostgreSQL detaches
    # only with a lock of todos_done (not of the live todos): held for the
    # detach alone, waiting at most RETIRE_LOCK_TIMEOUT.
    try:
        async with pg.transaction():
            await cur.execute(_LOCAL_LOCK_TIMEOUT, {"t": RETIRE_LOCK_TIMEOUT})
            await cur.execute(sql.SQL("ALTER TABLE {} DETACH PARTITION {}").format(parent, name))
    except psycopg.errors.LockNotAvailable:
        return False
    # Detached, nothing enters it. A todo of its period that finished since
    # the check read it (a commit's width) is not dropped with the rest: it
    # moves to the late partition (its range is gone), which keeps it until
    # it is as old.
    async with pg.transaction():
        await cur.execute(
            sql.SQL(
                "WITH raced AS (DELETE FROM {} WHERE updated_at >= now() - %(keep)s RETURNING {})"
                " INSERT INTO todos ({}) SELECT {} FROM raced"
            ).format(name, _TODO_COLUMNS, _TODO_COLUMNS, _TODO_COLUMNS),
            {"keep": keep},
        )
        await cur.execute(sql.SQL("DROP TABLE {}").format(name))
    return True


async def _older_than(cur: psycopg.AsyncCursor[Any], moment: datetime, age: timedelta) -> bool:
    """By the database's clock, as every cutoff of ours."""
    await cur.execute("SELECT %(moment)s < now() - %(age)s", {"moment": moment, "age": age})
    row = await cur.fetchone()
    return bool(row and row[0])
