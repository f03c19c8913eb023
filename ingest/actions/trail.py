"""Find a message's trail: one search for every front end (``switchboard
trace`` and the console's search box take the same words and say the same
when nothing matches).

A search is one of:

* ``inbox:ID``: that inbox row;
* ``todo:ID``: the inbox rows whose message made (or was deduplicated to)
  that todo;
* a bare number: the inbox row and the todo of that id, both;
* a bare message id some transport lets an operator give alone (a stream
  entry id): that message in each adapter that could hold it;
* anything else: an idempotency key, in any adapter.

Reads only, on one connection; the queries are :mod:`backhalf.reads.trace`'s.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from backhalf.reads import trace
from ingest.actions.todos import why_waiting
from ingest.observe.trail import is_bare_id

MAX_ID = 2**63 - 1  # bigint: a larger id names no row (and is no database error)
_DIGITS = re.compile(r"[0-9]{1,19}")


def as_id(text: str) -> int | None:
    """A row id, or None when the text is not one any row can have."""
    if _DIGITS.fullmatch(text) is None:  # not str.isdigit: "²" is a digit int() refuses
        return None
    value = int(text)
    return value if value <= MAX_ID else None


@dataclass(frozen=True, slots=True)
class Found:
    """The trails a search found, in inbox id order, each with why its todo
    still waits (None: it does not, or it has none); ``missing``: what to
    say when there are none."""

    trails: tuple[trace.Trail, ...]
    waiting: tuple[str | None, ...]
    missing: str


async def find(engine: AsyncEngine, query: str) -> Found:
    """The trails ``query`` names (see the module's docstring)."""
    async with engine.connect() as conn:
        ids, missing = await _inbox_ids(conn, query.strip())
        found = await trace.trails(conn, ids) if ids else []
        waiting = await why_waiting(conn, [t.todo for t in found])
    return Found(tuple(found), waiting, missing)


async def _inbox_ids(conn: AsyncConnection, query: str) -> tuple[list[int], str]:
    kind, _, rest = query.partition(":")
    if kind in ("todo", "inbox") and rest.isascii() and rest.isdigit():
        number = as_id(rest)  # None past a bigint: no row has that id
        if kind == "todo":
            ids = [] if number is None else await trace.inbox_ids_by_todo(conn, number)
            return ids, f"no inbox row holds todo {rest}"
        return ([] if number is None else [number]), f"inbox row {rest} does not exist"
    if (number := as_id(query)) is not None:
        ids = sorted({number, *await trace.inbox_ids_by_todo(conn, number)})
        return ids, f"no inbox row {query}, and no todo {query} with an inbox row"
    if is_bare_id(query):
        ids = await trace.inbox_ids_by_entry_id(conn, query)
        return ids, f"no stream adapter's inbox holds entry id {query!r}"
    return await trace.inbox_ids_by_key(conn, query), f"no inbox row has the idempotency key {query!r}"
