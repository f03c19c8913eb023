"""A field map is refused by its count before it is decoded (issue 32.8),
against a real Redis and PostgreSQL: a 1 MiB stream entry of 262,144 fields
is rejected ``too_many_fields``, stored and acked like any rejection, and
neither made a map nor decoded on the way; read fresh, re-read from the
PEL and claimed from a dead consumer alike."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any, cast

import pytest
import redis

from backhalf.writes import normalize
from backhalf.writes.normalize import MAX_FIELDS, REJECTED_PREFIX_BYTES, FieldMap, RefusedFieldMap
from ingest.adapters.redis import streams
from ingest.adapters.redis.streams import StreamAdapter
from ingest.config import AdapterConfig, from_mapping
from tests.support.db import query, scalar
from tests.support.in_process import pipeline, settings, wait_until
from tests.support.streams import xpending

STREAM = "wide"
FIELDS = 262_144  # one-byte keys would collide: keys of up to 5 digits, values of one byte


def wide_entry(r: redis.Redis, n: int = FIELDS, **extra: bytes) -> str:
    fields: dict[bytes, bytes] = {str(i).encode(): b"v" for i in range(n)}
    fields.update({k.encode(): v for k, v in extra.items()})
    return cast(bytes, r.xadd(STREAM, fields)).decode()  # type: ignore[arg-type]


class Watch:
    """Every call of the decoding functions, with the size of what it got."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[str, int]] = []
        self._wrap(monkeypatch, streams, "_field_map", lambda flat: 0 if flat is None else len(flat) // 2)
        for name in ("_decode_utf8", "_decoded_fields", "raw_fields", "raw_field_map", "fields_payload"):
            self._wrap(monkeypatch, normalize, name, lambda first: len(first))

    def _wrap(
        self, monkeypatch: pytest.MonkeyPatch, module: Any, name: str, size: Callable[[Any], int]
    ) -> None:
        real = getattr(module, name)

        def counted(*args: Any, **kw: Any) -> Any:
            self.calls.append((name, size(args[0])))
            return real(*args, **kw)

        monkeypatch.setattr(module, name, counted)

    def largest(self) -> int:
        return max((n for _, n in self.calls), default=0)


async def test_an_entry_of_262k_fields_is_rejected_by_its_count_stored_and_acked_undecoded(
    db_url: str, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def produce() -> tuple[str, str, str]:
        with redis.Redis.from_url(redis_url, socket_timeout=30) as r:
            small = cast(bytes, r.xadd(STREAM, {"a": "1", "b": "2"})).decode()
            # A body field among too many others: the body is the message, as ever.
            return small, wide_entry(r), wide_entry(r, 2 * MAX_FIELDS, body=b'{"n": 1}')

    small, wide, bodied = await asyncio.to_thread(produce)  # not on the loop: it is slow to build
    entry_bytes = sum(len(str(i)) + 1 for i in range(FIELDS))
    assert entry_bytes > 1_000_000
    watch = Watch(monkeypatch)
    adapter = {"name": STREAM, "source": STREAM, "consumer": "c1", "block_ms": 100, "batch_size": 10}
    async with pipeline(settings(db_url, redis_url, adapter)):
        await wait_until(
            lambda: (
                scalar(db_url, "SELECT count(*) FROM inbox WHERE ack_state = 'acked'") == 3
                and xpending(redis_url, STREAM) == 0
            ),
            timeout_s=60,
        )
    rows = {
        m: (status, error, size, digest is not None, bytes(body))
        for m, status, error, size, digest, body in query(
            db_url, "SELECT source_message_id, status, error, body_size, body_sha256, body FROM inbox"
        )
    }
    status, error, size, has_digest, body = rows[wide]
    assert (status, error) == (
        "rejected",
        f"too_many_fields: {FIELDS} fields exceeds the limit of {MAX_FIELDS}",
    )
    assert (size, has_digest) == (entry_bytes, True)
    assert len(body) == REJECTED_PREFIX_BYTES
    assert body.startswith(b'{"0":"v","1":"v",')
    assert rows[small][:2] == ("stored", None)
    assert rows[bodied][:2] == ("stored", None)
    payloads = dict(query(db_url, "SELECT idempotency_key, payload FROM todos"))
    assert payloads == {f"redis:{STREAM}:{small}": {"a": "1", "b": "2"}, f"redis:{STREAM}:{bodied}": {"n": 1}}
    # Never made a map, never decoded: what they saw was the small entry (two
    # fields) and the body of the other; nothing of the wide one.
    assert watch.calls
    assert watch.largest() < 100


@pytest.fixture
def cfg(redis_url: str) -> Callable[..., AdapterConfig]:
    def make(**kw: object) -> AdapterConfig:
        raw = {"name": STREAM, "source": STREAM, "consumer": "c1", "block_ms": 50, **kw}
        return from_mapping(
            {"database": {"url": "postgresql://x@y/z"}, "adapters": [raw]},
            {"SWITCHBOARD_REDIS_URL": redis_url},
        ).adapters[0]

    return make


async def test_the_count_is_checked_on_every_read_path(
    cfg: Callable[..., AdapterConfig], redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """New entries, the own PEL re-read after a restart, and the claim sweep
    (XCLAIM's reply, read raw as XREADGROUP's) all refuse by the count."""
    with redis.Redis.from_url(redis_url, socket_timeout=30) as r:
        wide = wide_entry(r, MAX_FIELDS + 1)
        at_limit = wide_entry(r, MAX_FIELDS)
    watch = Watch(monkeypatch)
    made: list[StreamAdapter] = []

    async def read(adapter: StreamAdapter) -> dict[str | None, Any]:
        made.append(adapter)
        return {d.message_id: d.body for d in await adapter.read(10)}

    def kinds(bodies: dict[str | None, Any]) -> dict[str | None, type]:
        return {m: type(b) for m, b in bodies.items()}

    try:
        expected = {wide: RefusedFieldMap, at_limit: FieldMap}
        fresh = await read(StreamAdapter(cfg()))
        assert kinds(fresh) == expected
        assert cast(RefusedFieldMap, fresh[wide]).fields == MAX_FIELDS + 1
        assert kinds(await read(StreamAdapter(cfg()))) == expected  # c1's PEL, re-read
        assert kinds(await read(StreamAdapter(cfg(consumer="c2", claim_idle_ms=1)))) == expected  # claimed
    finally:
        for adapter in made:
            await adapter.close()
    maps: Sequence[int] = [n for name, n in watch.calls if name == "_field_map"]
    assert maps == [MAX_FIELDS] * 3  # the entry at the limit, each time; the one past it never
