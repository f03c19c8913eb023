"""The adapter contract, written once (the idea of Watermill's universal
Pub/Sub tests): every transport and mode runs these tests against its real
broker by subclassing :class:`AdapterContract` in a ``test_contract_*``
module and saying how to publish to it and how to read the broker's own
record of what is still unacknowledged; ``broker`` is the module's fixture
of that name (a Redis client, a JetStream client).

What a mode cannot do is a feature flag, and the tests assert the declared
behaviour either way (pub/sub redelivers nothing: the test proves a message
read but never stored is gone, as the README warns), never a skip.

The pipeline runs in the test's event loop through the processes' own
entry points (``run_ingester``, ``run_acker``), and the adapter is built
through the factory, as the ingester builds it: the interface, not a class.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import replace
from typing import Any, ClassVar
from urllib.parse import urlsplit

from sqlalchemy.ext.asyncio import AsyncEngine

from ingest.adapters.base import Delivery, PullAdapter
from ingest.adapters.factory import make_adapter
from ingest.config import AdapterConfig, Settings
from ingest.processes.pull.poll import ledger_for
from tests.support.db import query, scalar
from tests.support.in_process import pipeline, settings, wait_until

NAME = "contract"
SOURCE = "contract-src"
QUEUE = "contract-q"


def bodies(n: int, start: int = 0) -> list[bytes]:
    return [json.dumps({"n": i}).encode() for i in range(start, start + n)]


class AdapterContract:
    """Subclass per transport and mode; set the flags, implement the hooks."""

    # Does the broker give back a message read but never acknowledged, after
    # the consumer that read it is gone?
    redelivers: ClassVar[bool] = True
    # Does every consumer of the source get every message (pub/sub), rather
    # than each message going to one of them?
    fans_out: ClassVar[bool] = False
    # Does the broker hold an ack to wait for (False: nothing to acknowledge)?
    acks: ClassVar[bool] = True
    # Does the message carry a native id (the key's last part, source_message_id)?
    native_ids: ClassVar[bool] = True
    # Who acks (ModeImplementation.acked_by): the acker, or the ingester
    # itself after its commit (AMQP: acks are bound to the receiving channel).
    acked_by_ingester: ClassVar[bool] = False
    # The figure ``describe`` gives for the broker's backlog, and its value
    # once seven messages were published and none read.
    backlog_figure: ClassVar[tuple[str, int]]

    # -- hooks ---------------------------------------------------------------

    def adapter_table(self) -> dict[str, Any]:
        """The ``[[adapters]]`` table of the adapter under test (name NAME, source SOURCE)."""
        raise NotImplementedError

    async def produce(self, broker: Any, messages: list[bytes], adapter: PullAdapter | None) -> None:
        """Publish ``messages`` in order; ``adapter`` is the running one where
        a test holds it (a subscriber must be listening first)."""
        raise NotImplementedError

    async def unacked(self, broker: Any) -> int:
        """The broker's own count of messages delivered and not yet acknowledged."""
        raise NotImplementedError

    async def unacked_is(self, broker: Any, count: int) -> bool:
        return await self.unacked(broker) == count

    # -- plumbing ------------------------------------------------------------

    def settings(self, db_url: str, redis_url: str, **keys: Any) -> Settings:
        table = {
            "name": NAME,
            "source": SOURCE,
            "queue": QUEUE,
            "block_ms": 100,
            **self.adapter_table(),
            **keys,
        }
        return settings(db_url, redis_url, table)

    def one_by_one(self, db_url: str, redis_url: str) -> Settings:
        """One message a batch, one commit at a time: the inbox ids then show
        the read order. Inside a batch the store writes rows in key order,
        its lock order (backhalf/queries.sql), and overlapping commits (a
        stream's commits_in_flight) take their ids in commit order."""
        s = self.settings(db_url, redis_url, batch_size=1)
        return replace(s, ingest=replace(s.ingest, commits_in_flight=1))

    def config(self, db_url: str, redis_url: str) -> AdapterConfig:
        (cfg,) = self.settings(db_url, redis_url).adapters
        return cfg

    async def started(self, db_url: str, redis_url: str) -> PullAdapter:
        adapter = make_adapter(self.config(db_url, redis_url), ledger=None)
        await adapter.start()
        return adapter

    async def run_until_stored(self, s: Settings, broker: Any, messages: list[bytes], *, acker: bool) -> None:
        db_url = s.database.url
        async with pipeline(s, acker=acker):
            await wait_until(lambda: scalar(db_url, "SELECT count(*) FROM adapters") == 1)
            await self.wait_listening(broker)
            await self.produce(broker, messages, None)
            await wait_until(lambda: scalar(db_url, "SELECT count(*) FROM inbox") >= len(messages))
            if acker and self.acks:
                await wait_until(lambda: self.unacked_is(broker, 0))

    async def after_a_lost_consumer(self, s: Settings, broker: Any, rest: list[bytes]) -> list[bytes]:
        """The pipeline, started after a consumer that held 5 messages went:
        ``rest`` published, then every body stored once it settles (the 5
        again too where the broker redelivers) and nothing is left unacked."""
        db_url = s.database.url
        async with pipeline(s):
            await self.wait_listening(broker)
            await self.produce(broker, rest, None)
            expected = len(rest) + (5 if self.redelivers else 0)
            await wait_until(lambda: scalar(db_url, "SELECT count(*) FROM inbox") >= expected)
            if self.acks:
                await wait_until(lambda: self.unacked_is(broker, 0))
        return [bytes(b) for (b,) in query(db_url, "SELECT body FROM inbox ORDER BY id")]

    async def wait_listening(self, broker: Any) -> None:
        """Return once a message published now reaches the running adapter."""
        return

    # -- the contract --------------------------------------------------------

    async def test_messages_are_stored_once_in_order_with_their_todos(
        self, db_url: str, redis_url: str, broker: Any
    ) -> None:
        sent = bodies(30)
        await self.run_until_stored(self.one_by_one(db_url, redis_url), broker, sent, acker=True)
        rows = query(db_url, "SELECT body, status, source_message_id, idempotency_key FROM inbox ORDER BY id")
        assert [bytes(b) for b, *_ in rows] == sent
        assert {status for _, status, _, _ in rows} == {"stored"}
        assert len({key for *_, key in rows}) == len(sent)
        assert all((mid is not None) == self.native_ids for _, _, mid, _ in rows)
        todos = query(db_url, "SELECT payload, queue FROM todos ORDER BY id")
        assert todos == [(json.loads(b), QUEUE) for b in sent]
        events = query(db_url, "SELECT family, trust_mode, verified FROM events")
        assert set(events) == {("queue", "queue", False)}

    async def test_acks_come_from_the_declared_party_only_after_the_commit(
        self, db_url: str, redis_url: str, broker: Any
    ) -> None:
        sent = bodies(10)
        s = self.settings(db_url, redis_url)
        # The ingester alone: where the acker is the ack party, what it stored
        # is still the broker's to redeliver; where the ingester is, it acked
        # (after its commit: its own tests inject a crash between the two).
        await self.run_until_stored(s, broker, sent, acker=False)
        states = {state for (state,) in query(db_url, "SELECT ack_state FROM inbox")}
        if self.acks and self.acked_by_ingester:
            await wait_until(lambda: self.unacked_is(broker, 0))
            await wait_until(
                lambda: scalar(db_url, "SELECT count(*) FROM inbox WHERE ack_state = 'acked'") == len(sent)
            )
        elif self.acks:
            assert states == {"pending"}
            assert await self.unacked(broker) == len(sent)
        else:
            assert states == {"none"}
        # The acker then discharges every committed intent.
        async with pipeline(s):
            if self.acks:
                await wait_until(lambda: self.unacked_is(broker, 0))
                await wait_until(
                    lambda: (
                        scalar(db_url, "SELECT count(*) FROM inbox WHERE ack_state = 'acked'") == len(sent)
                    )
                )
        assert scalar(db_url, "SELECT count(*) FROM todos") == len(sent)

    async def test_rewind_gives_back_what_was_not_stored(
        self, db_url: str, redis_url: str, broker: Any, engine: AsyncEngine
    ) -> None:
        adapter = await self.started(db_url, redis_url)
        try:
            await self.produce(broker, bodies(5), adapter)
            first = await self.read_all(adapter, 5, engine=engine)
            adapter.rewind()
            again = await self.read_all(adapter, 5, engine=engine)
        finally:
            await adapter.close()
        # Every mode rewinds (pub/sub from its own memory, the others from
        # the broker's record), so a failed store loses nothing while the
        # process lives.
        assert len(first) == 5
        assert sorted(d.idempotency_key for d in again) == sorted(d.idempotency_key for d in first)

    async def test_a_message_read_but_never_stored_is_redelivered_once_stored(
        self, db_url: str, redis_url: str, broker: Any, engine: AsyncEngine
    ) -> None:
        """A consumer that dies after its read: what it held comes back, and
        the pipeline stores each message exactly once."""
        s = self.settings(db_url, redis_url)
        crashed = await self.started(db_url, redis_url)
        await self.produce(broker, bodies(5), crashed)
        held = await self.read_all(crashed, 5, engine=engine)
        assert len(held) == 5
        await crashed.close()  # never stored, never acked
        rest = bodies(5, start=5)
        stored = await self.after_a_lost_consumer(s, broker, rest)
        if self.redelivers:
            assert sorted(stored) == sorted(bodies(10))
        else:
            assert sorted(stored) == sorted(rest)  # at most once: the dead consumer's messages are gone
        assert scalar(db_url, "SELECT count(*) FROM todos") == len(stored)

    async def test_a_stop_during_a_read_loses_nothing(
        self, db_url: str, redis_url: str, broker: Any, engine: AsyncEngine
    ) -> None:
        """A stop cancels a read under way (the poll loop abandons it): what
        that read had taken from the broker comes back where the broker
        redelivers, and the pipeline started after stores each message once."""
        adapter = await self.started(db_url, redis_url)
        first = bodies(5)
        try:
            await self.produce(broker, first, adapter)
            reading = asyncio.create_task(adapter.read(5))
            # However far the read got (a request sent, a reply half read),
            # cancelling it is the stop's part.
            await asyncio.wait({reading}, timeout=0.01)
            reading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reading
        finally:
            await adapter.close()
        rest = bodies(5, start=5)
        s = self.settings(db_url, redis_url)
        stored = await self.after_a_lost_consumer(s, broker, rest)
        assert len(stored) == len(set(stored)), "a message stored twice"
        if self.redelivers:
            assert sorted(stored) == sorted(first + rest)
        else:
            assert set(rest) <= set(stored) <= set(first + rest)
        assert scalar(db_url, "SELECT count(*) FROM todos") == len(stored)

    async def test_two_consumers_on_one_source_store_each_message_once(
        self, db_url: str, redis_url: str, broker: Any
    ) -> None:
        """Two ingesters on one source (the way to scale one: a consumer name
        each), running at once: every message is stored once, and one todo
        each, whichever consumer read it (pub/sub delivers it to both; the
        key dedups them)."""
        one = self.settings(db_url, redis_url, consumer="c1")
        two = self.settings(db_url, redis_url, consumer="c2")
        sent = bodies(40)
        async with pipeline(one, two):
            await wait_until(
                lambda: scalar(db_url, "SELECT count(*) FROM processes WHERE role = 'ingest'") >= 2
            )
            await self.wait_listening(broker)
            await self.produce(broker, sent, None)
            await wait_until(lambda: scalar(db_url, "SELECT count(*) FROM inbox") >= len(sent))
            if self.acks:
                await wait_until(lambda: self.unacked_is(broker, 0))
        stored = [bytes(b) for (b,) in query(db_url, "SELECT body FROM inbox ORDER BY id")]
        if self.fans_out:  # each consumer's copy is on record; the key made one todo of them
            assert set(stored) == set(sent)
        else:
            assert sorted(stored) == sorted(sent)
        assert scalar(db_url, "SELECT count(*) FROM todos") == len(sent)

    async def test_poison_is_stored_rejected_and_acked(
        self, db_url: str, redis_url: str, broker: Any
    ) -> None:
        sent = [b'{"ok": 1}', b"{not json", b'{"ok": 2}']
        await self.run_until_stored(self.one_by_one(db_url, redis_url), broker, sent, acker=True)
        rows = query(db_url, "SELECT body, status, error, ack_state FROM inbox ORDER BY id")
        assert [(bytes(b), st) for b, st, _, _ in rows] == [
            (sent[0], "stored"), (sent[1], "rejected"), (sent[2], "stored")
        ]  # fmt: skip
        assert rows[1][2] is not None
        assert rows[1][2].startswith("invalid_json")
        if self.acks:
            # The poison is acked like the rest, so the broker stops redelivering it.
            await wait_until(lambda: self.unacked_is(broker, 0))
            await wait_until(
                lambda: scalar(db_url, "SELECT ack_state FROM inbox WHERE status = 'rejected'") == "acked"
            )
        assert [p for (p,) in query(db_url, "SELECT payload FROM todos ORDER BY id")] == [
            {"ok": 1},
            {"ok": 2},
        ]

    async def test_describe_gives_status_its_figures(self, db_url: str, redis_url: str, broker: Any) -> None:
        adapter = await self.started(db_url, redis_url)
        try:
            await self.produce(broker, bodies(7), adapter)
            figures = await adapter.describe()
        finally:
            await adapter.close()
        assert all(isinstance(k, str) for k in figures)
        assert json.loads(json.dumps(figures)) == figures  # plain JSON, as status --json prints it
        name, value = self.backlog_figure
        assert figures[name] == value, figures
        # The broker URL's secret (the suite's own servers' is the planted
        # one; a URL given from outside may have none) is never in them.
        secret = urlsplit(redis_url).password
        assert secret is None or secret not in json.dumps(figures)

    # -- helpers -------------------------------------------------------------

    async def read_all(self, adapter: PullAdapter, n: int, *, engine: AsyncEngine) -> list[Delivery]:
        """Read (and recover, as the poll loop does) until ``n`` messages came, bounded."""
        got: list[Delivery] = []
        async with asyncio.timeout(30):
            for _ in range(200):
                got += await adapter.recover(ledger_for(engine, adapter.name))
                got += await adapter.read(n - len(got) or 1)
                if len(got) >= n:
                    break
        return got
