"""Replay rejected inbox rows once their cause is fixed (``switchboard inbox
replay``): one by id, or the rows a filter selects, or a dry run of those;
and the inbox rows as every front end reads them (``inbox list / show``,
the console's inbox pages).

Each row is its own transaction (:func:`backhalf.writes.replay.replay`), so one
that is refused leaves the others replayed. A dry run asks each row the very
checks a replay makes (:func:`backhalf.writes.replay.check`) and writes nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy.ext.asyncio import AsyncEngine

from backhalf.reads import inbox_views
from backhalf.records import Family
from backhalf.writes import replay
from backhalf.writes.normalize import body_payload
from ingest.actions.outcomes import Refused
from ingest.adapters.base import FAMILY, TRUST_MODE
from ingest.adapters.webhook import PUSH
from ingest.adapters.webhook.verify import HMAC_SHA256
from ingest.config import AdapterConfig, Settings, WebhookConfig
from ingest.errors import ConfigError

DEFAULT_REPLAY_LIMIT = 100


@dataclass(frozen=True, slots=True)
class Replayed:
    """The row is ``stored`` now, and ``todo_id`` is its todo (created, or
    the active one it deduplicated to)."""

    inbox_id: int
    todo_id: int


@dataclass(frozen=True, slots=True)
class WouldReplay:
    """Dry run: the row passes every check a replay makes."""


@dataclass(frozen=True, slots=True)
class WouldRefuse:
    """Dry run: a replay would refuse the row, for ``reason``."""

    reason: str


@dataclass(frozen=True, slots=True)
class Gone:
    """Dry run: the row was deleted (pruned) after it was selected."""


ReplayOutcome = Replayed | Refused
DryRunOutcome = WouldReplay | WouldRefuse | Gone


@dataclass(frozen=True, slots=True)
class Selection:
    """The rejected rows a filter selects, oldest first, at most ``limit``;
    ``more``: further rows match (the next page starts after the last)."""

    rows: tuple[inbox_views.InboxRow, ...]
    limit: int
    more: bool


@dataclass(frozen=True, slots=True)
class RowOutcome:
    """One selected row (as selected) and what became of it."""

    row: inbox_views.InboxRow
    outcome: ReplayOutcome | DryRunOutcome


@dataclass(frozen=True, slots=True)
class BulkReplay:
    """A replay (or dry run) of a selection: each row's outcome, in order."""

    selection: Selection
    dry_run: bool
    rows: tuple[RowOutcome, ...]

    @property
    def matched(self) -> int:
        return len(self.rows)

    @property
    def stored(self) -> int:
        """Rows stored; in a dry run, rows that would be."""
        return sum(isinstance(r.outcome, Replayed | WouldReplay) for r in self.rows)

    @property
    def failed(self) -> int:
        """Rows refused; in a dry run, rows that would be, or are gone."""
        return self.matched - self.stored


def _normalizer(settings: Settings, adapter: str) -> replay.Normalizer:
    cfg = settings.any_adapter(adapter)
    # The adapter's current rules, schema included: a replay after the schema
    # was fixed checks against the fixed one.
    return lambda body: body_payload(body, cfg.format, cfg.max_message_bytes, cfg.body_schema)


def _trust(cfg: AdapterConfig | WebhookConfig) -> tuple[Family, str]:
    """A replayed row's event: of its adapter's family, trusted as it would be."""
    if isinstance(cfg, WebhookConfig):
        return PUSH, HMAC_SHA256
    return FAMILY, TRUST_MODE


async def replay_one(engine: AsyncEngine, settings: Settings, inbox_id: int) -> ReplayOutcome:
    """Replay one rejected row in its own transaction."""
    try:
        async with engine.begin() as conn:
            todo_id = await replay.replay(
                conn,
                inbox_id,
                queue_for=lambda name: settings.any_adapter(name).queue,
                normalize_for=lambda name: _normalizer(settings, name),
                trust_for=lambda name: _trust(settings.any_adapter(name)),
            )
    except replay.ReplayError as exc:  # its message names the row
        return Refused(str(exc))
    except ConfigError as exc:  # the row's adapter is not configured (any more)
        return Refused(f"inbox row {inbox_id}: {exc}")
    return Replayed(inbox_id, todo_id)


async def select_rejected(
    engine: AsyncEngine, where: inbox_views.ReplayFilter, *, limit: int = DEFAULT_REPLAY_LIMIT
) -> Selection:
    """The rejected rows ``where`` matches, oldest first, at most ``limit``."""
    async with engine.begin() as conn:
        # One more than the limit: to say that more rows match.
        rows = await inbox_views.replay_candidates(conn, where, limit=limit + 1)
    return Selection(tuple(rows[:limit]), limit, more=len(rows) > limit)


async def check_one(engine: AsyncEngine, settings: Settings, inbox_id: int) -> DryRunOutcome:
    """What a replay of the row would do, under its adapter's current rules;
    read-only."""
    async with engine.begin() as conn:
        detail = await inbox_views.get_row(conn, inbox_id)
    if detail is None:
        return Gone()
    try:
        normalize = _normalizer(settings, detail.adapter)
        replay.check(detail.id, detail.status, detail.body, detail.body_size, detail.error, normalize)
    except (replay.ReplayError, ConfigError) as exc:
        return WouldRefuse(str(exc))
    return WouldReplay()


async def replay_selection(
    engine: AsyncEngine,
    settings: Settings,
    selection: Selection,
    *,
    dry_run: bool = False,
    on_row: Callable[[RowOutcome], object] | None = None,
) -> BulkReplay:
    """Replay (or with ``dry_run``, check) each selected row in turn, each in
    its own transaction; ``on_row`` hears of each as it is done."""
    done: list[RowOutcome] = []
    for row in selection.rows:
        outcome: ReplayOutcome | DryRunOutcome
        if dry_run:
            outcome = await check_one(engine, settings, row.id)
        else:
            outcome = await replay_one(engine, settings, row.id)
        done.append(RowOutcome(row, outcome))
        if on_row is not None:
            on_row(done[-1])
    return BulkReplay(selection, dry_run, tuple(done))


async def replay_matching(
    engine: AsyncEngine,
    settings: Settings,
    where: inbox_views.ReplayFilter,
    *,
    limit: int = DEFAULT_REPLAY_LIMIT,
    dry_run: bool = False,
) -> BulkReplay:
    """Select the rejected rows ``where`` matches and replay (or check) them."""
    selection = await select_rejected(engine, where, limit=limit)
    return await replay_selection(engine, settings, selection, dry_run=dry_run)


# -- reads ------------------------------------------------------------------------


async def listed(engine: AsyncEngine, wanted: inbox_views.InboxQuery) -> list[inbox_views.InboxRow]:
    """Inbox rows, newest first, at most ``wanted.limit``."""
    async with engine.connect() as conn:
        return await inbox_views.list_rows(conn, wanted)


async def show(engine: AsyncEngine, inbox_id: int) -> inbox_views.InboxDetail | None:
    """One row whole, with its body; None if it does not exist."""
    async with engine.connect() as conn:
        return await inbox_views.get_row(conn, inbox_id)
