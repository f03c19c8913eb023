"""The webhook receiver's group commit (ingest.processes.push.push_store) against
real PostgreSQL: deliveries handed in together commit in one transaction;
two bodies under one delivery id are one delivery where the sender signs
the id, and two messages where it does not (GitHub's, issue 43), even when
they share that transaction."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
from collections.abc import Awaitable

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from backhalf.records import InboxRecord, Provenance
from backhalf.writes import registry
from backhalf.writes.keys import reused_key
from ingest.processes.push.push_store import PushStore
from tests.support.db import query, scalar

PROVENANCE = Provenance("push", "hmac-sha256", True, "github secret: GH_SECRET")
KEY = "webhook:gh:72d3162e-cc78-11e3-81ab-4c9367dc0958"


def record(after: str) -> InboxRecord:
    body = json.dumps({"ref": "refs/heads/main", "after": after}).encode()
    return InboxRecord(KEY, KEY.rsplit(":", 1)[1], body, body.decode())


@pytest.fixture
async def push(engine: AsyncEngine) -> PushStore:
    async with engine.begin() as conn:
        await registry.register(
            conn, name="gh", family="push", transport="webhook", mode="github", settings={}
        )
    return PushStore(engine, deadline_ms=10_000)


async def together(push: PushStore, *handed: Awaitable[None]) -> None:
    """Every delivery handed in before a committer runs, so the first
    committer takes them all into one transaction."""
    waiting = [asyncio.ensure_future(h) for h in handed]
    await asyncio.sleep(0)  # each is queued, waiting for its commit
    committers = asyncio.create_task(push.run(asyncio.Event()))
    try:
        async with asyncio.timeout(30):
            await asyncio.gather(*waiting)
    finally:
        committers.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await committers


async def test_two_bodies_under_one_unsigned_id_in_one_commit_are_two_messages(
    push: PushStore, db_url: str
) -> None:
    first, second = record("1111111"), record("2222222")
    await together(
        push,
        push.store("gh", "gh", PROVENANCE, first, id_names_message=False),
        push.store("gh", "gh", PROVENANCE, second, id_names_message=False),
    )
    assert scalar(db_url, "SELECT count(DISTINCT xmin::text) FROM inbox") == 1  # one transaction
    rows = query(
        db_url,
        "SELECT i.idempotency_key, i.body, i.deliveries, t.payload"
        " FROM inbox i JOIN todos t ON t.id = i.todo_id ORDER BY i.id",
    )
    assert rows == [
        (KEY, first.body, 1, json.loads(first.body)),
        (reused_key(KEY, hashlib.sha256(second.body).digest()), second.body, 1, json.loads(second.body)),
    ]
    assert scalar(db_url, "SELECT count(*) FROM events") == 2


async def test_two_bodies_under_one_signed_id_are_one_delivery_the_first_kept(
    push: PushStore, db_url: str
) -> None:
    first, again = record("1111111"), record("1111111 serialized anew")
    await together(
        push,
        push.store("gh", "gh", PROVENANCE, first, id_names_message=True),
        push.store("gh", "gh", PROVENANCE, again, id_names_message=True),
    )
    rows = query(db_url, "SELECT i.idempotency_key, i.body, i.deliveries FROM inbox i")
    assert rows == [(KEY, first.body, 2)]
    assert scalar(db_url, "SELECT count(*) FROM todos") == 1
