"""What needs attention, for the overview (issue 44; DESIGN.md section 13):
one :class:`Attention` per problem standing now, each with its count and a
link to its rows, and the overview's verdict, ``ok`` only while none stands
and no adapter is ``UNHEALTHY``.

The problems (``data-kind``):

* ``failed-todos``: todos whose last attempt failed (retry them, or leave
  them to retention's ``retain_failed_days``).
* ``long-running``: todos running longer than their queue's time limit
  (``[queues.NAME] time_limit_ms`` of the console's config; a queue it does
  not name: ``QueueConfig``'s default, 10 minutes). dramatiq's TimeLimit
  should have stopped such a run: its handler ignores the stop, or hangs.
* ``waiting-no-worker``: claimable todos of a queue no live worker serves
  (a worker's heartbeat names its queues, ``detail.queues``, as ``status``
  reads it), once the oldest has been due for ``WAITING_GRACE_S`` (a
  worker's restart is not a problem).
* ``rejected-inbox``: rejected inbox rows (replay them once the rule is
  fixed, or leave them to retention).
* ``process-failing``: processes ``dead``, ``stuck`` or ``failing``, as
  ``status`` says (``ingest.observe.status.FAILING``).

Counts that could grow with history are read up to
``backhalf.reads.attention_views.COUNT_LIMIT`` ("1000+"): see that module for the
index behind each read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from urllib.parse import urlencode

from sqlalchemy.ext.asyncio import AsyncConnection

from backhalf.housekeeping.heartbeats import HEARTBEAT_TTL_S, ProcessRow
from backhalf.lifecycle.queues import QueueConfig
from backhalf.reads import attention_views
from backhalf.reads.attention_views import Bounded, FailedTodos, RunningTodo
from ingest.config import Settings
from ingest.observe import status
from ingest.web.formats import age
from schema.tables import CLAIMABLE_TODO_STATUSES

KINDS = ("failed-todos", "long-running", "waiting-no-worker", "rejected-inbox", "process-failing")
# A queue's todos wait this long with no live worker before it is a problem:
# as long as a process's silence takes to make it dead.
WAITING_GRACE_S = HEARTBEAT_TTL_S
# The time limit of a queue the console's config does not name: [queues]'s default.
DEFAULT_TIME_LIMIT_MS = QueueConfig("default", "unused").time_limit_ms
OK = "ok"
NOT_OK = "attention"


@dataclass(frozen=True, slots=True)
class Attention:
    """One standing problem: ``count`` rows (at least, when ``more``), shown
    at ``href``; an ``example`` (the newest or oldest one, at
    ``example_href``), a ``detail`` line, and ``links`` to parts of the rows."""

    kind: str
    count: int
    more: bool
    what: str
    href: str
    example: str | None = None
    example_href: str | None = None
    detail: str | None = None
    links: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class Readings:
    """What the problems are judged on. ``waiting``: per queue that has
    claimable todos and no live worker, their count and how long the oldest
    has been due (seconds)."""

    failed: FailedTodos
    running: Sequence[RunningTodo]
    waiting: Mapping[str, tuple[int, float]]
    rejected: Bounded
    processes: Sequence[ProcessRow]


def serves(p: ProcessRow, queue: str) -> bool:
    """A live worker of ``queue``: ``status``'s rule (an alive worker whose heartbeat names it)."""
    return p.role == "worker" and p.state == "alive" and queue in p.detail.get("queues", ())


async def read(
    conn: AsyncConnection, procs: Sequence[ProcessRow], active: Mapping[tuple[str, str], int]
) -> Readings:
    """The readings, on the overview's connection; ``active``: the active
    todos per (queue, status) it read already."""
    claimable: dict[str, int] = {}
    for (queue, todo_status), n in active.items():
        if todo_status in CLAIMABLE_TODO_STATUSES and n:
            claimable[queue] = claimable.get(queue, 0) + n
    unserved = sorted(q for q in claimable if not any(serves(p, q) for p in procs))
    due = await attention_views.oldest_claimable(conn, unserved)
    return Readings(
        failed=await attention_views.failed_todos(conn),
        running=await attention_views.running_todos(conn),
        waiting={q: (claimable[q], due[q]) for q in unserved if q in due},
        rejected=await attention_views.rejected_rows(conn),
        processes=procs,
    )


def time_limit_s(settings: Settings, queue: str) -> float:
    cfg = settings.queues.get(queue)
    return (cfg.time_limit_ms if cfg is not None else DEFAULT_TIME_LIMIT_MS) / 1000


def judge(readings: Readings, settings: Settings) -> list[Attention]:
    """The problems standing, in ``KINDS``' order."""
    found = [
        _failed(readings.failed),
        _long_running(readings.running, settings),
        _waiting(readings.waiting),
        _rejected(readings.rejected),
        _failing(readings.processes),
    ]
    return [a for a in found if a is not None]


def verdict(attention: Sequence[Attention], report: Sequence[Mapping[str, object]]) -> str:
    return NOT_OK if attention or status.unhealthy(report) else OK


def todos_href(**query: str) -> str:
    return "/todos?" + urlencode(query)


def _failed(failed: FailedTodos) -> Attention | None:
    if not failed.count:
        return None
    links = tuple(
        (f"{q}: {n}", todos_href(status="failed", queue=q)) for q, n in sorted(failed.by_queue.items())
    )
    found = Attention(
        kind="failed-todos",
        count=failed.count,
        more=failed.more,
        what="failed todos",
        href=todos_href(status="failed"),
        links=links if len(links) > 1 else (),
    )
    newest = failed.newest
    if newest is None:  # retried meanwhile
        return found
    return dataclasses.replace(
        found,
        example=f"{'newest' if failed.newest_exact else 'a recent one'}: todo {newest.id}"
        f" ({newest.queue}), failed {age(newest.failed_s)} ago",
        example_href=f"/todos/{newest.id}",
        detail=newest.last_error,
    )


def _long_running(running: Sequence[RunningTodo], settings: Settings) -> Attention | None:
    over = [t for t in running if t.running_s > time_limit_s(settings, t.queue)]
    if not over:
        return None
    oldest = max(over, key=lambda t: t.running_s)
    queues = sorted({t.queue for t in over})
    return Attention(
        kind="long-running",
        count=len(over),
        more=False,
        what="todos running past their time limit",
        href=todos_href(status="running", **({"queue": queues[0]} if len(queues) == 1 else {})),
        example=(
            f"oldest: todo {oldest.id} ({oldest.queue}), running for {age(oldest.running_s)};"
            f" its limit {age(time_limit_s(settings, oldest.queue))}"
        ),
        example_href=f"/todos/{oldest.id}",
    )


def _waiting(waiting: Mapping[str, tuple[int, float]]) -> Attention | None:
    stuck = {q: (n, due_s) for q, (n, due_s) in waiting.items() if due_s >= WAITING_GRACE_S}
    if not stuck:
        return None
    oldest = max(stuck, key=lambda q: stuck[q][1])
    return Attention(
        kind="waiting-no-worker",
        count=sum(n for n, _ in stuck.values()),
        more=False,
        what="todos waiting: no live worker serves their queue",
        href=todos_href(status="pending", queue=oldest),
        example=f"oldest due {age(stuck[oldest][1])} ago, in queue {oldest}",
        detail=f"no live worker serves {', '.join(sorted(stuck))} (start `switchboard worker`)",
        links=tuple((f"{q}: {stuck[q][0]}", todos_href(status="pending", queue=q)) for q in sorted(stuck))
        if len(stuck) > 1
        else (),
    )


def _rejected(rejected: Bounded) -> Attention | None:
    if not rejected.count:
        return None
    return Attention(
        kind="rejected-inbox",
        count=rejected.count,
        more=rejected.more,
        what="rejected inbox rows",
        href="/inbox?status=rejected",
    )


def _failing(procs: Sequence[ProcessRow]) -> Attention | None:
    failing = status.dead(procs)
    if not failing:
        return None
    return Attention(
        kind="process-failing",
        count=len(failing),
        more=False,
        what="processes dead, stuck or failing",
        href="/processes",
        # A failing one names its server and error (redacted), as status does.
        detail="; ".join(
            f"{p.role} {p.host}:{p.pid} {p.state}, seen {age(p.silent_s)} ago"
            + (f" ({status.why(p)})" if p.state == "failing" else "")
            for p in failing
        ),
    )
