"""The end-of-test oracle: what must be true in PostgreSQL and Redis after any
run, whatever was killed along the way."""

from __future__ import annotations

import hashlib

import redis

from ingest.embedded.processes import SwitchboardProcess, wait_for
from tests.support.db import acked, query, unacked
from tests.support.processes import stop_settled
from tests.support.streams import xpending


def assert_exactly_once(
    db_url: str,
    redis_url: str,
    *,
    stream: str,
    group: str,
    produced_ids: list[str],
    queue: str | None = None,
    prefix: str = "redis",
) -> None:
    queue = queue or stream
    assert_stored_once(db_url, [f"{prefix}:{stream}:{i}" for i in produced_ids], queue=queue)
    with redis.Redis.from_url(redis_url, socket_timeout=10) as r:
        pending = r.xpending(stream, group)["pending"]
    assert pending == 0, f"{pending} entries still pending in the PEL"


def assert_stored_once(db_url: str, keys: list[str], *, queue: str) -> None:
    """What PostgreSQL must hold after any run, whatever the broker: exactly
    one todo, one inbox row and one event per message key, and every inbox
    ack intent discharged."""
    expected = sorted(keys)
    found = [
        k for (k,) in query(db_url, "SELECT idempotency_key FROM todos WHERE queue = %(q)s", {"q": queue})
    ]
    assert len(found) == len(set(found)), f"{len(found) - len(set(found))} duplicate todos"
    missing = sorted(set(expected) - set(found))
    extra = sorted(set(found) - set(expected))
    assert not missing, f"{len(missing)} messages lost, e.g. {missing[:3]}"
    assert not extra, f"{len(extra)} unexpected todos, e.g. {extra[:3]}"
    inbox_keys = [k for (k,) in query(db_url, "SELECT idempotency_key FROM inbox")]
    assert sorted(inbox_keys) == expected, "inbox rows must be exactly one per produced message"
    owed = unacked(db_url)
    assert owed == 0, f"{owed} inbox ack intents not discharged"
    events = query(db_url, "SELECT count(*), count(DISTINCT idempotency_key) FROM events")[0]
    assert events == (len(expected), len(expected)), f"events {events}, expected one per message"


def assert_list_exactly_once(db_url: str, redis_url: str, *, source: str, bodies: list[bytes]) -> None:
    """Every pushed (distinct) body is one todo; nothing is left on the source
    or on any processing list; every ack intent is discharged."""
    expected = sorted({f"redis:{source}:{hashlib.sha256(b).hexdigest()}" for b in bodies})
    keys = [k for (k,) in query(db_url, "SELECT idempotency_key FROM todos")]
    assert len(keys) == len(set(keys)), f"{len(keys) - len(set(keys))} duplicate todos"
    assert sorted(keys) == expected, f"todos {len(keys)}, expected {len(expected)}"
    owed = unacked(db_url)
    assert owed == 0, f"{owed} ack intents not discharged"
    with redis.Redis.from_url(redis_url, socket_timeout=10) as r:
        assert r.llen(source) == 0, "items left on the source list"
        # The glob also matches the acker's removal markers (strings), which it deletes after its commit.
        leftovers = {
            k.decode(): r.llen(k) for k in r.scan_iter(match=f"{source}:processing:*") if r.type(k) == b"list"
        }
    assert all(n == 0 for n in leftovers.values()), f"items left on processing lists: {leftovers}"


def wait_all_acked(
    db_url: str, redis_url: str, expected: int, *, timeout_s: float, what: str, stream: str = "orders"
) -> None:
    """Until ``expected`` inbox rows are acked and the stream's PEL is empty."""
    wait_for(
        lambda: acked(db_url) == expected and xpending(redis_url, stream) == 0, timeout_s=timeout_s, what=what
    )


def assert_clean_end(db_url: str, redis_url: str, ids: list[str], *running: SwitchboardProcess) -> None:
    """SIGTERM each process (it must exit 0, clean; the ingesters first, the
    others once every ack intent is discharged: ``stop_settled``), then the
    exactly-once oracle over the ``orders`` stream for the produced entry ids."""
    stop_settled(
        running,
        lambda: unacked(db_url) == 0 and xpending(redis_url, "orders") == 0,
        what="every ack discharged",
    )
    assert_exactly_once(db_url, redis_url, stream="orders", group="switchboard", produced_ids=ids)
