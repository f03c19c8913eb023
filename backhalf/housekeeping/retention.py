"""Retention: the pruner's statements (issue 14). Each function is one
bounded batch, run by the caller in its own short transaction; the loop that
walks a table batch by batch is ``ingest.processes.ack.prune``.

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
* **Held rows come back by id.** A row a batch had to keep (an ack pending,
  a todo active, a row locked) is returned in ``held_ids``; the walk moves
  past it and re-checks it later with the same statement over ``= ANY(ids)``
  (``ids`` instead of ``cursor``), index probes by primary key, so one
  long-held row never makes a walk re-read what follows it.
* **One read for adapters of one retention.** An acked walk takes a list
  of adapters (``adapter = ANY(adapters)``) and counts its deletions by
  adapter, so adapters with the same ``retain_acked_days`` share one read of
  the inbox; with no index by adapter, each distinct retention is a read of
  its own.
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
* **Never a row younger than its floor** (issue 43), whatever ``age`` the
  caller passes: the cutoff is ``now()`` minus the greater of the two. An
  inbox row's dedup is what stops a redelivery, or a webhook sender's retry,
  from making a second todo, so a mis-set retention (or a caller that skips
  the config's checks) must not delete a row its broker may still deliver
  again: :data:`PULL_FLOOR` (the config's one-hour minimum,
  ``ingest.config.adapter.RETENTION_FLOOR_MS``) for a walk of queue
  adapters, :data:`PUSH_FLOOR` (the senders' three-day retry span,
  ``ingest.config.webhook.SENDER_RETRY_DAYS``) as soon as one of its
  adapters is registered as anything else. Each delete carries its own
  floor: an event goes only with its inbox row and only once it is as old
  (an inbox row whose event is younger, a replay's, is kept until it is
  not, so no event is left behind), a todo only with its whole history
  past :data:`TODO_FLOOR`, a delivery attempt only past
  :data:`ATTEMPTS_FLOOR`. ``ops/roles.sql``'s row policies hold the acker's
  role to the same floors, against a caller that sends SQL of its own.

Every value is a bound parameter; cutoffs are the database's ``now()``
minus an interval, so no host's clock matters.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.ext.asyncio import AsyncConnection

from backhalf.db import wrap_driver_errors
from backhalf.errors import PruneError
from schema import ACTIVE_TODO_STATUSES, adapters, delivery_attempts, events, inbox, todo_events, todos
from schema.tables import ack_queue, inbox_keys

# Inbox rows whose broker ack is done: acked, or never owed one (pub/sub).
ACK_DONE_STATES = ("acked", "none")
# What each todo walk deletes. Cancelled todos go with done ones: neither
# is an outcome an operator replays, and both are terminal.
DONE_STATUSES = ("done", "cancelled")
FAILED_STATUSES = ("failed",)
# The floors (issue 43; the module docstring says why): no row younger is
# deleted, whatever the configured retention.
PULL_FLOOR = timedelta(hours=1)  # ingest.config.adapter.RETENTION_FLOOR_MS
PUSH_FLOOR = timedelta(days=3)  # ingest.config.webhook.SENDER_RETRY_DAYS
TODO_FLOOR = timedelta(hours=1)
ATTEMPTS_FLOOR = PULL_FLOOR  # a stale attempt is judged on the acked rows' horizon
_FLOORS = {
    "pull_floor": PULL_FLOOR,
    "push_floor": PUSH_FLOOR,
    "todo_floor": TODO_FLOOR,
    "attempts_floor": ATTEMPTS_FLOOR,
}
_QUEUE_FAMILY = "queue"

InboxStatus = Literal["stored", "rejected"]

# The adapters walking together: those with the same retention share one
# read of the inbox (``ingest.processes.ack.prune`` groups them), counted apart.
_ADAPTERS = sa.any_(sa.bindparam("adapters", type_=postgresql.ARRAY(sa.Text)))


@dataclass(frozen=True, slots=True, kw_only=True)
class Window:
    """Which rows one batch of a walk examines: the ``limit`` after
    ``cursor``, or, given ``ids``, those rows (a re-check of held ones);
    prunable when older than ``age``. A dry run counts them."""

    age: timedelta
    limit: int
    cursor: int = 0
    ids: Sequence[int] | None = None
    dry_run: bool = False

    def params(self) -> dict[str, Any]:
        """The batch statement's parameters the window sets."""
        where = {"cursor": self.cursor} if self.ids is None else {"ids": list(self.ids)}
        return {"age": self.age, "limit": self.limit, **_FLOORS, **where}

    def statement_key(self) -> tuple[bool, bool]:
        """Which of a walk's compiled statements runs: (dry run, by ids)."""
        return self.dry_run, self.ids is not None


@dataclass(frozen=True, slots=True)
class Batch:
    """What one batch of a walk saw and did.

    ``last_id``: the highest id examined (None: nothing was left to read);
    ``edge_id``: the first row examined that is newer than the cutoff (the
    walk ends there); ``held_ids``: the rows of this walk kept for a reason
    that passes (an ack pending, a todo still active or not yet old enough,
    a row locked by someone else), in id order, at most ``limit`` of them:
    the walk re-checks them by id later. ``deleted`` (or, in a dry run, what
    would be) by table."""

    scanned: int
    last_id: int | None
    edge_id: int | None
    held_ids: tuple[int, ...] = ()
    deleted: dict[str, int] = field(default_factory=dict)
    by_owner: dict[str, dict[str, int]] = field(default_factory=dict)


def _floored(floor: Any) -> Any:
    """``now()`` minus the walk's ``age``, or minus ``floor`` where that is longer."""
    return sa.func.now() - sa.func.greatest(sa.bindparam("age", type_=sa.Interval), floor)


def _inbox_cutoff() -> Any:
    """The inbox walk's cutoff: its adapters' floor is the push floor if one
    of them is registered as other than a queue adapter (one computed once
    per statement: ``adapters`` is a handful of rows; an adapter not
    registered has no inbox rows, its foreign key says so)."""
    pushed = (
        sa.select(sa.func.bool_or(adapters.c.family != _QUEUE_FAMILY))
        .where(adapters.c.name == _ADAPTERS)
        .scalar_subquery()
    )
    floor = sa.case(
        (sa.func.coalesce(pushed, sa.false()), sa.bindparam("push_floor", type_=sa.Interval)),
        else_=sa.bindparam("pull_floor", type_=sa.Interval),
    )
    return _floored(floor)


def _todo_cutoff() -> Any:
    return _floored(sa.bindparam("todo_floor", type_=sa.Interval))


def _attempts_cutoff() -> Any:
    return _floored(sa.bindparam("attempts_floor", type_=sa.Interval))


def _array_of(select: sa.Select[Any]) -> Any:
    """``ARRAY(subquery)``, compared with ``= ANY``: index probes, whatever
    the statistics say."""
    return sa.any_(sa.func.array(select.scalar_subquery()))


def _count(cte: Any, *where: Any) -> Any:
    return sa.select(sa.func.count()).select_from(cte).where(*where).scalar_subquery()


def _mine(scan: Any, edge: Any, columns: list[Any], *where: Any) -> Any:
    """The scanned rows this batch may take (``where``), up to the first
    one newer than its cutoff (``edge``), each with whether it is done."""
    return sa.select(*columns).where(*where, sa.or_(edge.is_(None), scan.c.id < edge)).cte("mine")


def _summary(scan: Any, edge: Any) -> list[Any]:
    """What every batch reports of its scan: rows read, the last id, where
    the walk met rows newer than its cutoff."""
    return [
        _count(scan).label("scanned"),
        sa.select(sa.func.max(scan.c.id)).scalar_subquery().label("last_id"),
        edge.label("edge_id"),
    ]


def _batch(row: Any, deleted: dict[str, int]) -> Batch:
    return Batch(
        scanned=row.scanned,
        last_id=row.last_id,
        edge_id=row.edge_id,
        held_ids=tuple(sorted(row.held_ids or ())),
        deleted=deleted,
    )


def _rows(id_column: Any, *, by_ids: bool) -> Any:
    """Which rows a batch examines: those after ``cursor`` (the walk), or
    those in ``ids`` (a re-check of held rows), by primary key either way."""
    if by_ids:
        return id_column == sa.any_(sa.bindparam("ids", type_=postgresql.ARRAY(sa.BigInteger)))
    return id_column > sa.bindparam("cursor", type_=sa.BigInteger)


def _held(mine: Any, condition: Any) -> Any:
    return sa.select(sa.func.array_agg(mine.c.id)).where(condition).scalar_subquery().label("held_ids")


def _by_adapter(cte: Any, *where: Any) -> Any:
    """``{adapter: rows}`` of ``cte`` (None: no rows)."""
    counted = (
        sa.select(cte.c.adapter, sa.func.count().label("n")).where(*where).group_by(cte.c.adapter).subquery()
    )
    return sa.select(sa.func.json_object_agg(counted.c.adapter, counted.c.n)).scalar_subquery()


def _younger_event(event_id: Any) -> Any:
    """The row's event is newer than the cutoff (an inbox replay's, written
    long after its row): the row waits for it, so its event never outlives
    it. A primary-key probe."""
    return sa.exists().where(events.c.id == event_id, events.c.received_at >= _inbox_cutoff())


def _inbox_done(scan: Any, *, dry_run: bool) -> Any:
    """A scanned row is prunable as far as the scan can tell: its ack done,
    none queued. A dry run also asks what the delete asks of each row it
    takes (its event as old); a real run leaves that to the delete, which
    holds back a row it refuses."""
    queued = sa.exists().where(ack_queue.c.inbox_id == scan.c.id)
    younger = [~_younger_event(scan.c.event_id)] if dry_run else []
    return sa.and_(scan.c.ack_state.in_(ACK_DONE_STATES), ~queued, *younger)


def _locked(table: sa.Table, mine: sa.CTE, still_prunable: tuple[sa.ColumnElement[bool], ...]) -> sa.CTE:
    """The ids of the walk's done rows, each locked where it is still
    prunable; a row another transaction holds is skipped (the next walk
    takes it)."""
    return (
        sa.select(table.c.id)
        .where(table.c.id == _array_of(sa.select(mine.c.id).where(mine.c.done)), *still_prunable)
        .with_for_update(skip_locked=True)
        .cte("locked")
    )


def _deleted(
    table: sa.Table, mine: sa.CTE, still_prunable: tuple[sa.ColumnElement[bool], ...], *also: Any
) -> sa.Delete:
    """The delete of the walk's done rows this batch locked (:func:`_locked`),
    each still prunable and ``also``; the caller names what it returns."""
    locked = _locked(table, mine, still_prunable)
    return sa.delete(table).where(table.c.id == _array_of(sa.select(locked.c.id)), *still_prunable, *also)


def _inbox_statement(status: InboxStatus, *, dry_run: bool, by_ids: bool = False) -> sa.Select[Any]:
    scan_query = sa.select(
        inbox.c.id, inbox.c.adapter, inbox.c.status, inbox.c.ack_state, inbox.c.stored_at, inbox.c.event_id
    ).where(_rows(inbox.c.id, by_ids=by_ids))
    if status == "rejected":
        # ix_inbox_rejected (adapter, id) WHERE status = 'rejected': only this
        # adapter's rejected rows, in id order. The predicate is written as
        # the index's, so the planner matches it.
        scan_query = scan_query.where(
            inbox.c.adapter == sa.bindparam("adapter"), inbox.c.status == "rejected"
        )
    scan = scan_query.order_by(inbox.c.id).limit(sa.bindparam("limit", type_=sa.Integer)).cte("scan")
    edge = sa.select(sa.func.min(scan.c.id)).where(scan.c.stored_at >= _inbox_cutoff()).scalar_subquery()
    mine = _mine(
        scan,
        edge,
        [scan.c.id, scan.c.adapter, scan.c.event_id, _inbox_done(scan, dry_run=dry_run).label("done")],
        scan.c.adapter == _ADAPTERS,
        scan.c.status == sa.bindparam("status"),
    )
    summary = _summary(scan, edge)
    if dry_run:
        return sa.select(
            *summary,
            _held(mine, ~mine.c.done),
            _by_adapter(mine, mine.c.done).label("inbox"),
            _by_adapter(mine, mine.c.done, mine.c.event_id.isnot(None)).label("events"),
        )
    # Checked on the row itself, in the lock and in the delete (see the module docstring).
    still_prunable = (
        inbox.c.adapter == _ADAPTERS,
        inbox.c.status == sa.bindparam("status"),
        inbox.c.ack_state.in_(ACK_DONE_STATES),
        inbox.c.stored_at < _inbox_cutoff(),
        ~sa.exists().where(ack_queue.c.inbox_id == inbox.c.id),
    )
    # Its event's age is read once the row is locked: an event never changes.
    gone = (
        _deleted(inbox, mine, still_prunable, ~_younger_event(inbox.c.event_id))
        .returning(inbox.c.id, inbox.c.adapter, inbox.c.event_id)
        .cte("gone")
    )
    # Only the events of the rows deleted here, and only as old as they are.
    gone_events = (
        sa.delete(events)
        .where(
            events.c.id == _array_of(sa.select(gone.c.event_id).where(gone.c.event_id.isnot(None))),
            events.c.adapter == _ADAPTERS,
            events.c.received_at < _inbox_cutoff(),
        )
        .returning(events.c.id, events.c.adapter)
        .cte("gone_events")
    )
    gone_keys = _gone_keys(gone)
    return sa.select(
        *summary,
        _held(mine, sa.or_(~mine.c.done, mine.c.id.not_in(sa.select(gone.c.id)))),
        _by_adapter(gone).label("inbox"),
        _by_adapter(gone_events).label("events"),
        _count(gone_keys).label("keys"),
    )


def _gone_keys(gone: Any) -> Any:
    """The native keys of the rows deleted here: a redelivery after this is
    a new message, as it was when the key lived in the inbox's own index."""
    return (
        sa.delete(inbox_keys)
        .where(inbox_keys.c.inbox_id == _array_of(sa.select(gone.c.id)))
        .returning(inbox_keys.c.inbox_id)
        .cte("gone_keys")
    )


_INBOX = {
    (status, dry_run, by_ids): _inbox_statement(status, dry_run=dry_run, by_ids=by_ids)
    for status in ("stored", "rejected")
    for dry_run in (False, True)
    for by_ids in (False, True)
}


async def prune_inbox(
    conn: AsyncConnection, *, adapters: Sequence[str], status: InboxStatus, window: Window
) -> Batch:
    """One batch of an inbox walk of ``adapters`` (one, for 'rejected': its
    index is per adapter): rows of ``status`` ('stored' or 'rejected') with
    their ack done, stored more than ``window.age`` ago, and their events,
    among the rows the ``window`` examines. ``by_owner``: the counts by
    adapter."""
    if status == "rejected" and len(adapters) != 1:
        raise ValueError(f"a rejected walk is one adapter's, not {list(adapters)}")
    params = {"adapter": adapters[0], "adapters": list(adapters), "status": status, **window.params()}
    names = ", ".join(adapters)
    with wrap_driver_errors(PruneError, f"adapter {names}: pruning {status} inbox rows"):
        row = (await conn.execute(_INBOX[(status, *window.statement_key())], params)).one()
    inbox_by, events_by = row.inbox or {}, row.events or {}
    by_owner = {a: {"inbox": int(inbox_by.get(a, 0)), "events": int(events_by.get(a, 0))} for a in adapters}
    totals = {t: sum(counts[t] for counts in by_owner.values()) for t in ("inbox", "events")}
    return dataclasses.replace(_batch(row, totals), by_owner=by_owner)


def _younger_history(todo_id: Any) -> Any:
    """A row of the todo's history is newer than the cutoff: the todo waits,
    so its history goes with it whole. A todo's every change writes its row
    in the same statement, so only a row written by hand is ever younger.
    ``ix_todo_events_todo_id`` probes."""
    return sa.exists().where(todo_events.c.todo_id == todo_id, todo_events.c.created_at >= _todo_cutoff())


def _todo_done(scan: Any, statuses: Any, *, dry_run: bool) -> Any:
    """A scanned todo is prunable as far as the scan can tell: in the walk's
    statuses, past the cutoff, no ack waiting for it. A dry run also asks
    what the delete asks of each todo it takes (its history as old)."""
    awaited = sa.exists().where(ack_queue.c.waiting_for == scan.c.id)
    younger = [~_younger_history(scan.c.id)] if dry_run else []
    return sa.and_(scan.c.status.in_(statuses), scan.c.updated_at < _todo_cutoff(), ~awaited, *younger)


def _todos_statement(*, dry_run: bool, by_ids: bool = False) -> sa.Select[Any]:
    statuses: Any = sa.bindparam("statuses", expanding=True)
    scan = (
        sa.select(todos.c.id, todos.c.queue, todos.c.status, todos.c.created_at, todos.c.updated_at)
        .where(_rows(todos.c.id, by_ids=by_ids))
        .order_by(todos.c.id)
        .limit(sa.bindparam("limit", type_=sa.Integer))
        .cte("scan")
    )
    # updated_at >= created_at: a todo created after the cutoff cannot have
    # finished before it, and created_at follows the id.
    edge = sa.select(sa.func.min(scan.c.id)).where(scan.c.created_at >= _todo_cutoff()).scalar_subquery()
    mine = _mine(
        scan,
        edge,
        [scan.c.id, _todo_done(scan, statuses, dry_run=dry_run).label("done")],
        scan.c.queue == sa.bindparam("queue"),
        # An active todo may still end in this walk's statuses: it holds
        # the walk's restart point. Other terminal ones are not its own.
        sa.or_(scan.c.status.in_(statuses), scan.c.status.in_(ACTIVE_TODO_STATUSES)),
    )
    summary = _summary(scan, edge)
    if dry_run:
        return sa.select(
            *summary,
            _held(mine, ~mine.c.done),
            _count(mine, mine.c.done).label("todos"),
            sa.select(sa.func.count())
            .where(todo_events.c.todo_id == _array_of(sa.select(mine.c.id).where(mine.c.done)))
            .scalar_subquery()
            .label("todo_events"),
        )
    still_prunable = (
        todos.c.queue == sa.bindparam("queue"),
        todos.c.status.in_(statuses),
        todos.c.updated_at < _todo_cutoff(),
        # An ack_after = "complete" ack waiting for it: released by the
        # transaction that ends the todo, so none should be left; kept if one is.
        ~sa.exists().where(ack_queue.c.waiting_for == todos.c.id),
    )
    gone = (
        _deleted(todos, mine, still_prunable, ~_younger_history(todos.c.id)).returning(todos.c.id).cte("gone")
    )
    gone_events = (
        sa.delete(todo_events)
        .where(
            todo_events.c.todo_id == _array_of(sa.select(gone.c.id)),
            todo_events.c.created_at < _todo_cutoff(),
        )
        .returning(todo_events.c.id)
        .cte("gone_events")
    )
    return sa.select(
        *summary,
        _held(mine, sa.or_(~mine.c.done, mine.c.id.not_in(sa.select(gone.c.id)))),
        _count(gone).label("todos"),
        _count(gone_events).label("todo_events"),
    )


_TODOS = {
    (dry_run, by_ids): _todos_statement(dry_run=dry_run, by_ids=by_ids)
    for dry_run in (False, True)
    for by_ids in (False, True)
}


async def prune_todos(
    conn: AsyncConnection, *, queue: str, statuses: tuple[str, ...], window: Window
) -> Batch:
    """One batch of a queue's todo walk: todos in ``statuses`` (terminal
    ones: :data:`DONE_STATUSES` or :data:`FAILED_STATUSES`) last changed more
    than ``window.age`` ago, with their ``todo_events``, among the todos the
    ``window`` examines."""
    if set(statuses) & set(ACTIVE_TODO_STATUSES):
        raise ValueError(f"only terminal todos are pruned, not {sorted(statuses)}")
    params = {"queue": queue, "statuses": list(statuses), **window.params()}
    with wrap_driver_errors(PruneError, f"queue {queue}: pruning {'/'.join(statuses)} todos"):
        row = (await conn.execute(_TODOS[window.statement_key()], params)).one()
    return _batch(row, {"todos": row.todos, "todo_events": row.todo_events})


# delivery_attempts holds the attempts of messages not stored yet; a stored
# message clears its row. What stays is a message that never came back after
# an attempt (deleted or trimmed from the broker while its ingester was down,
# taken by a consumer outside Switchboard). Small by construction, so its
# primary key (adapter first) is enough to find an adapter's rows.
_OLD_ATTEMPTS = (
    delivery_attempts.c.adapter == sa.bindparam("adapter"),
    delivery_attempts.c.last_attempt_at < _attempts_cutoff(),
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
# A dry run deletes nothing, so "until a batch comes back short" would count
# the same rows for ever: it walks the primary key instead, ``limit`` keys
# after the last one it examined, and counts the old ones among them.
_ATTEMPTS_PAGE = (
    sa.select(delivery_attempts.c.idempotency_key, delivery_attempts.c.last_attempt_at)
    .where(
        delivery_attempts.c.adapter == sa.bindparam("adapter"),
        delivery_attempts.c.idempotency_key > sa.bindparam("after"),
    )
    .order_by(delivery_attempts.c.idempotency_key)
    .limit(sa.bindparam("limit", type_=sa.Integer))
    .cte("page")
)
_COUNT_ATTEMPTS = sa.select(
    sa.select(sa.func.count()).select_from(_ATTEMPTS_PAGE).scalar_subquery().label("scanned"),
    sa.select(sa.func.max(_ATTEMPTS_PAGE.c.idempotency_key)).scalar_subquery().label("last_key"),
    sa.select(sa.func.count())
    .select_from(_ATTEMPTS_PAGE)
    .where(_ATTEMPTS_PAGE.c.last_attempt_at < _attempts_cutoff())
    .scalar_subquery()
    .label("old"),
)


@dataclass(frozen=True, slots=True)
class AttemptsPage:
    """One page of a dry run's count of stale attempts: ``scanned`` keys
    examined, the last of them (None: none left), ``old`` of them stale."""

    scanned: int
    last_key: str | None
    old: int


async def count_attempts(
    conn: AsyncConnection, *, adapter: str, age: timedelta, after: str, limit: int
) -> AttemptsPage:
    """Of the ``limit`` delivery attempts of ``adapter`` after key ``after``
    (``""``: from the first), how many were last made more than ``age`` ago."""
    params = {"adapter": adapter, "age": age, "after": after, "limit": limit, **_FLOORS}
    with wrap_driver_errors(PruneError, f"adapter {adapter}: counting delivery attempts"):
        row = (await conn.execute(_COUNT_ATTEMPTS, params)).one()
    return AttemptsPage(row.scanned, row.last_key, row.old)


async def prune_attempts(conn: AsyncConnection, *, adapter: str, age: timedelta, limit: int) -> int:
    """Delete up to ``limit`` of an adapter's delivery attempts last made more
    than ``age`` ago; return how many. A message attempted since keeps its
    count: it is still a suspect. (A dry run counts with :func:`count_attempts`.)"""
    params = {"adapter": adapter, "age": age, "limit": limit, **_FLOORS}
    with wrap_driver_errors(PruneError, f"adapter {adapter}: pruning delivery attempts"):
        return (await conn.execute(_PRUNE_ATTEMPTS, params)).rowcount
