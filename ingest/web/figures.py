"""What the overview shows, read cheaply and shared by every browser.

The verdicts are ``switchboard status``'s own (``ingest.observe.status``),
fed with figures that stay cheap on a big inbox: the last hour's per minute
(``backhalf.reads.console_views``: the window's rows only), the acks owed
(``backhalf.reads.backlog``: ``ack_queue`` and the cursors' rows), the active
todos (their partial indexes). ``status`` counts the whole tables instead.
What needs attention (failed, long-running and waiting todos, rejected rows,
failing processes) is judged on bounded reads too (``ingest.web.attention``).

One reading serves every request for ``TTL_S``: ten open tabs polling every
two seconds ask the database and the brokers once, not ten times.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from backhalf.db import within_deadline
from backhalf.errors import DeadlineExceeded
from backhalf.housekeeping import heartbeats
from backhalf.housekeeping.heartbeats import ProcessRow
from backhalf.reads import audit, backlog, console_views
from backhalf.reads.console_views import MinuteFigures
from backhalf.writes import registry
from ingest.config import Settings
from ingest.observe import status
from ingest.web import attention
from ingest.web.attention import Attention

TTL_S = 1.5


@dataclass(frozen=True, slots=True)
class Overview:
    """One reading: the status report (one dict per adapter, as ``status
    --json`` gives it, its counts those of the last hour), the minutes
    behind its charts, the processes, what needs attention and the verdict."""

    report: Sequence[Mapping[str, Any]]
    minutes: Mapping[str, Sequence[MinuteFigures]]
    processes: Sequence[ProcessRow]
    attention: Sequence[Attention]
    verdict: str


async def read_overview(engine: AsyncEngine, settings: Settings) -> Overview:
    deadline_ms = settings.database.transaction_deadline_ms
    async with within_deadline(engine.connect(), deadline_ms, "reading the overview") as conn:
        rows = {r.name: r for r in await registry.list_adapters(conn)}
        minutes = await console_views.recent_minutes(conn, detail=False)
        owed = await backlog.ack_backlog(
            conn, [cfg.name for cfg in settings.adapters if status.acked_by_ingester(cfg)]
        )
        active = await backlog.active_todos(conn)
        holder = await audit.ack_horizon_holder(conn)
        procs = await heartbeats.list_processes(conn)
        readings = await attention.read(conn, procs, active)
    by_adapter = console_views.by_adapter(minutes)
    counts = {name: _counts(row, by_adapter.get(name, []), owed.get(name)) for name, row in rows.items()}
    todos: dict[str, dict[str, int]] = {}
    for (queue, todo_status), n in active.items():
        todos.setdefault(queue, {})[todo_status] = n
    figures = status.Figures(rows, counts, todos, holder)
    report = await status.collect(settings, procs, None, db=figures)
    standing = attention.judge(readings, settings)
    return Overview(report, by_adapter, procs, standing, attention.verdict(standing, report))


def _counts(
    row: registry.AdapterRow, minutes: Sequence[MinuteFigures], owed: backlog.AckBacklog | None
) -> audit.AdapterCounts:
    consumed = sum(m.consumed for m in minutes)
    rejected = sum(m.rejected for m in minutes)
    return audit.AdapterCounts(
        adapter=row.name,
        enabled=row.enabled,
        stored=consumed - rejected,
        rejected=rejected,
        pending_acks=owed.pending if owed else 0,
        acked=sum(m.acked for m in minutes),
        oldest_unacked_age=timedelta(seconds=owed.oldest_age_s) if owed else None,
    )


class OverviewCache:
    """The last reading, for ``TTL_S``; one reading at a time."""

    def __init__(self, engine: AsyncEngine, settings: Settings) -> None:
        self._engine = engine
        self._settings = settings
        self._lock = asyncio.Lock()
        self._value: Overview | None = None
        self._at = 0.0

    async def get(self) -> Overview:
        """The last reading if fresh, else a new one; a request waits for
        the reading in progress (one at a time), all under one deadline."""
        deadline_s = self._settings.database.transaction_deadline_ms / 1000
        try:
            async with asyncio.timeout(deadline_s * 2):
                async with self._lock:
                    if self._value is None or time.monotonic() - self._at > TTL_S:
                        self._value = await read_overview(self._engine, self._settings)
                        self._at = time.monotonic()
                    return self._value
        except TimeoutError as exc:
            raise DeadlineExceeded(f"reading the overview: no answer within {deadline_s * 2:g} s") from exc

    def forget(self) -> None:
        """After an action: the next request reads afresh."""
        self._value = None
