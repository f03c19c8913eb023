"""Retention: the pruner's statements (issue 14). Each function is one
bounded batch, run by the caller in its own short transaction; the loop that
walks a table batch by batch is ``ingest.prune``.

Why the statements are shaped as they are:

* **A keyset walk over the primary key.** ``inbox`` has no index on
  ``stored_at`` or ``ack_state`` on purpose (every index entry costs on the
  hot insert, and the acker's update must stay HOT), nor ``todos`` on
  ``updated_at``. Ids are handed out in insertion order, so the walk reads
  the next ``limit`` rows after a cursor through the primary key (an index
  range scan whose heap pages are read in order) and stops at the *edge*:
  the first row written after the cutoff, past which no row can qualify
  (``stored_at`` and ``created_at`` follow the id up to the length of a
  transaction, well under any retention; a row just past the edge is taken
  by the next run). Each batch examines at most ``limit`` rows whatever it
  finds there, so no batch grows with the table.
* **Rejected rows walk their own index** (``ix_inbox_rejected``: the
  adapter's rejected rows in id order), with their own, usually longer,
  retention.
* **Never a row that is still owed something.** An inbox row whose ack is
  pending (``ack_state = 'pending'``, or a row in ``ack_queue``: the ack
  intent lives there, and list mode's dedup counts copies by it) and a todo
  that is not terminal, or that an ack still waits for, are kept whatever
  their age. The conditions are written on the deleted table itself, in the
  locking read and again in the ``DELETE``, so a row changed by a commit
  after the statement's snapshot (a redelivery making an acked row pending
  again, an operator's retry) is checked again on its newest version.
* **Never a wait.** Rows are locked ``FOR UPDATE SKIP LOCKED``: a row the
  store, the acker or a worker holds is left for the next run, never waited
  for, and nobody waits long for the pruner, whose batch is short.
* **Plans that do not depend on statistics.** The locked ids reach the
  ``DELETE`` as an array (``= ANY(ARRAY(...))``), so each delete is index
  probes by primary key (or ``ix_todo_events_todo_id``), never a join the
  planner could turn into a scan of a table it has not analyzed.
* A row's linked rows go in the same statement: an inbox row's ``events``
  row (``inbox.event_id``), a todo's ``todo_events``.

Every value is a bound parameter; cutoffs are the database's ``now()``
minus an interval, so no host's clock matters.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from backhalf.db import wrap_driver_errors
from backhalf.errors import PruneError
from schema import ACTIVE_TODO_STATUSES, delivery_attempts, events, inbox, todo_events, todos
from schema.tables import ack_queue

# Inbox rows whose broker ack is done: acked, or never owed one (pub/sub).
ACK_DONE_STATES = ("acked", "none")
# What each todo walk deletes. Cancelled todos go with done ones: neither
# is an outcome an operator replays, and both are terminal.
DONE_STATUSES = ("done", "cancelled")
FAILED_STATUSES = ("failed",)

InboxStatus = Literal["stored", "rejected"]


@dataclass(frozen=True, slots=True)
class Batch:
    """What one batch of a walk saw and did.

    ``last_id``: the highest id examined (None: nothing was left to read);
    ``edge_id``: the first row examined that is newer than the cutoff (the
    walk ends there); ``held_id``: the lowest id of a row of this walk kept
    for a reason that passes (an ack pending, a todo still active or not yet
    old enough, a row locked by someone else), from which the next run must
    start again. ``deleted`` (or, in a dry run, what would be) by table."""

    scanned: int
    last_id: int | None
    edge_id: int | None
    held_id: int | None
    deleted: dict[str, int] = field(default_factory=dict)


def _cutoff() -> Any:
    return sa.func.now() - sa.bindparam("age", type_=sa.Interval)


def _array_of(select: sa.Select[Any]) -> Any:
    """``ARRAY(subquery)``, compared with ``= ANY``: index probes, whatever
    the statistics say."""
    return sa.any_(sa.func.array(select.scalar_subquery()))


def _count(cte: Any, *where: Any) -> Any:
    return sa.select(sa.func.count()).select_from(cte).where(*where).scalar_subquery()


def _batch(row: Any, deleted: dict[str, int]) -> Batch:
    return Batch(
        scanned=row.scanned, last_id=row.last_id, edge_id=row.edge_id, held_id=row.held_id, deleted=deleted
    )


def _inbox_statement(status: InboxStatus, *, dry_run: bool) -> sa.Select[Any]:
    scan_query = sa.select(
        inbox.c.id, inbox.c.adapter, inbox.c.status, inbox.c.ack_state, inbox.c.stored_at, inbox.c.event_id
    ).where(inbox.c.id > sa.bindparam("cursor", type_=sa.BigInteger))
    if status == "rejected":
        # ix_inbox_rejected (adapter, id) WHERE status = 'rejected': only this
        # adapter's rejected rows, in id order. The predicate is written as
        # the index's, so the planner matches it.
        scan_query = scan_query.where(
            inbox.c.adapter == sa.bindparam("adapter"), inbox.c.status == "rejected"
        )
    scan = scan_query.order_by(inbox.c.id).limit(sa.bindparam("limit", type_=sa.Integer)).cte("scan")
    edge = sa.select(sa.func.min(scan.c.id)).where(scan.c.stored_at >= _cutoff()).scalar_subquery()
    queued = sa.exists().where(ack_queue.c.inbox_id == scan.c.id)
    mine = (
        sa.select(
            scan.c.id,
            scan.c.event_id,
            sa.and_(scan.c.ack_state.in_(ACK_DONE_STATES), ~queued).label("done"),
        )
        .where(
            scan.c.adapter == sa.bindparam("adapter"),
            scan.c.status == sa.bindparam("status"),
            sa.or_(edge.is_(None), scan.c.id < edge),
        )
        .cte("mine")
    )
    summary = [
        _count(scan).label("scanned"),
        sa.select(sa.func.max(scan.c.id)).scalar_subquery().label("last_id"),
        edge.label("edge_id"),
    ]
    if dry_run:
        return sa.select(
            *summary,
            sa.select(sa.func.min(mine.c.id)).where(~mine.c.done).scalar_subquery().label("held_id"),
            _count(mine, mine.c.done).label("inbox"),
            _count(mine, mine.c.done, mine.c.event_id.isnot(None)).label("events"),
        )
    # Checked on the row itself, in the lock and in the delete (see the module docstring).
    still_prunable = (
        inbox.c.adapter == sa.bindparam("adapter"),
        inbox.c.status == sa.bindparam("status"),
        inbox.c.ack_state.in_(ACK_DONE_STATES),
        inbox.c.stored_at < _cutoff(),
        ~sa.exists().where(ack_queue.c.inbox_id == inbox.c.id),
    )
    locked = (
        sa.select(inbox.c.id)
        .where(inbox.c.id == _array_of(sa.select(mine.c.id).where(mine.c.done)), *still_prunable)
        .with_for_update(skip_locked=True)
        .cte("locked")
    )
    gone = (
        sa.delete(inbox)
        .where(inbox.c.id == _array_of(sa.select(locked.c.id)), *still_prunable)
        .returning(inbox.c.id, inbox.c.event_id)
        .cte("gone")
    )
    gone_events = (
        sa.delete(events)
        .where(events.c.id == _array_of(sa.select(gone.c.event_id).where(gone.c.event_id.isnot(None))))
        .returning(events.c.id)
        .cte("gone_events")
    )
    held = sa.select(sa.func.min(mine.c.id)).where(
        sa.or_(~mine.c.done, mine.c.id.not_in(sa.select(gone.c.id)))
    )
    return sa.select(
        *summary,
        held.scalar_subquery().label("held_id"),
        _count(gone).label("inbox"),
        _count(gone_events).label("events"),
    )


_INBOX = {
    (status, dry_run): _inbox_statement(status, dry_run=dry_run)
    for status in ("stored", "rejected")
    for dry_run in (False, True)
}


async def prune_inbox(
    conn: AsyncConnection,
    *,
    adapter: str,
    status: InboxStatus,
    age: timedelta,
    cursor: int,
    limit: int,
    dry_run: bool = False,
) -> Batch:
    """One batch of an adapter's inbox walk: rows of ``status`` ('stored' or
    'rejected') with their ack done, stored more than ``age`` ago, and their
    events, among the ``limit`` rows after ``cursor``. A dry run counts them."""
    params = {"adapter": adapter, "status": status, "age": age, "cursor": cursor, "limit": limit}
    with wrap_driver_errors(PruneError, f"adapter {adapter}: pruning {status} inbox rows"):
        row = (await conn.execute(_INBOX[(status, dry_run)], params)).one()
    return _batch(row, {"inbox": row.inbox, "events": row.events})


def _todos_statement(*, dry_run: bool) -> sa.Select[Any]:
    statuses: Any = sa.bindparam("statuses", expanding=True)
    scan = (
        sa.select(todos.c.id, todos.c.queue, todos.c.status, todos.c.created_at, todos.c.updated_at)
        .where(todos.c.id > sa.bindparam("cursor", type_=sa.BigInteger))
        .order_by(todos.c.id)
        .limit(sa.bindparam("limit", type_=sa.Integer))
        .cte("scan")
    )
    # updated_at >= created_at: a todo created after the cutoff cannot have
    # finished before it, and created_at follows the id.
    edge = sa.select(sa.func.min(scan.c.id)).where(scan.c.created_at >= _cutoff()).scalar_subquery()
    awaited = sa.exists().where(ack_queue.c.waiting_for == scan.c.id)
    mine = (
        sa.select(
            scan.c.id,
            sa.and_(scan.c.status.in_(statuses), scan.c.updated_at < _cutoff(), ~awaited).label("done"),
        )
        .where(
            scan.c.queue == sa.bindparam("queue"),
            # An active todo may still end in this walk's statuses: it holds
            # the walk's restart point. Other terminal ones are not its own.
            sa.or_(scan.c.status.in_(statuses), scan.c.status.in_(ACTIVE_TODO_STATUSES)),
            sa.or_(edge.is_(None), scan.c.id < edge),
        )
        .cte("mine")
    )
    summary = [
        _count(scan).label("scanned"),
        sa.select(sa.func.max(scan.c.id)).scalar_subquery().label("last_id"),
        edge.label("edge_id"),
    ]
    if dry_run:
        return sa.select(
            *summary,
            sa.select(sa.func.min(mine.c.id)).where(~mine.c.done).scalar_subquery().label("held_id"),
            _count(mine, mine.c.done).label("todos"),
            sa.select(sa.func.count())
            .where(todo_events.c.todo_id == _array_of(sa.select(mine.c.id).where(mine.c.done)))
            .scalar_subquery()
            .label("todo_events"),
        )
    still_prunable = (
        todos.c.queue == sa.bindparam("queue"),
        todos.c.status.in_(statuses),
        todos.c.updated_at < _cutoff(),
        # An ack_after = "complete" ack waiting for it: released by the
        # transaction that ends the todo, so none should be left; kept if one is.
        ~sa.exists().where(ack_queue.c.waiting_for == todos.c.id),
    )
    locked = (
        sa.select(todos.c.id)
        .where(todos.c.id == _array_of(sa.select(mine.c.id).where(mine.c.done)), *still_prunable)
        .with_for_update(skip_locked=True)
        .cte("locked")
    )
    gone = (
        sa.delete(todos)
        .where(todos.c.id == _array_of(sa.select(locked.c.id)), *still_prunable)
        .returning(todos.c.id)
        .cte("gone")
    )
    gone_events = (
        sa.delete(todo_events)
        .where(todo_events.c.todo_id == _array_of(sa.select(gone.c.id)))
        .returning(todo_events.c.id)
        .cte("gone_events")
    )
    held = sa.select(sa.func.min(mine.c.id)).where(
        sa.or_(~mine.c.done, mine.c.id.not_in(sa.select(gone.c.id)))
    )
    return sa.select(
        *summary,
        held.scalar_subquery().label("held_id"),
        _count(gone).label("todos"),
        _count(gone_events).label("todo_events"),
    )


_TODOS = {dry_run: _todos_statement(dry_run=dry_run) for dry_run in (False, True)}


async def prune_todos(
    conn: AsyncConnection,
    *,
    queue: str,
    statuses: tuple[str, ...],
    age: timedelta,
    cursor: int,
    limit: int,
    dry_run: bool = False,
) -> Batch:
    """One batch of a queue's todo walk: todos in ``statuses`` (terminal
    ones: :data:`DONE_STATUSES` or :data:`FAILED_STATUSES`) last changed more
    than ``age`` ago, with their ``todo_events``, among the ``limit`` todos
    after ``cursor``. A dry run counts them."""
    if set(statuses) & set(ACTIVE_TODO_STATUSES):
        raise ValueError(f"only terminal todos are pruned, not {sorted(statuses)}")
    params = {"queue": queue, "statuses": list(statuses), "age": age, "cursor": cursor, "limit": limit}
    with wrap_driver_errors(PruneError, f"queue {queue}: pruning {'/'.join(statuses)} todos"):
        row = (await conn.execute(_TODOS[dry_run], params)).one()
    return _batch(row, {"todos": row.todos, "todo_events": row.todo_events})


# delivery_attempts holds the attempts of messages not stored yet; a stored
# message clears its row. What stays is a message that never came back after
# an attempt (deleted or trimmed from the broker while its ingester was down,
# taken by a consumer outside Switchboard). Small by construction, so its
# primary key (adapter first) is enough to find an adapter's rows.
_OLD_ATTEMPTS = (
    delivery_attempts.c.adapter == sa.bindparam("adapter"),
    delivery_attempts.c.last_attempt_at < _cutoff(),
)
_ATTEMPT_KEY = sa.tuple_(delivery_attempts.c.adapter, delivery_attempts.c.idempotency_key)
_PRUNE_ATTEMPTS = sa.delete(delivery_attempts).where(
    _ATTEMPT_KEY.in_(
        sa.select(delivery_attempts.c.adapter, delivery_attempts.c.idempotency_key)
        .where(*_OLD_ATTEMPTS)
        .limit(sa.bindparam("limit", type_=sa.Integer))
        .with_for_update(skip_locked=True)
    ),
    *_OLD_ATTEMPTS,
)
_COUNT_ATTEMPTS = sa.select(sa.func.count()).select_from(
    sa.select(delivery_attempts.c.idempotency_key)
    .where(*_OLD_ATTEMPTS)
    .limit(sa.bindparam("limit", type_=sa.Integer))
    .subquery()
)


async def prune_attempts(
    conn: AsyncConnection, *, adapter: str, age: timedelta, limit: int, dry_run: bool = False
) -> int:
    """Delete up to ``limit`` of an adapter's delivery attempts last made more
    than ``age`` ago; return how many (a dry run counts up to ``limit``). A
    message attempted since keeps its count: it is still a suspect."""
    params = {"adapter": adapter, "age": age, "limit": limit}
    with wrap_driver_errors(PruneError, f"adapter {adapter}: pruning delivery attempts"):
        if dry_run:
            return int((await conn.execute(_COUNT_ATTEMPTS, params)).scalar_one())
        return (await conn.execute(_PRUNE_ATTEMPTS, params)).rowcount
