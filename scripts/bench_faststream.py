"""The FastStream peer of ``make bench`` (issue 16): what a capable user writes
with FastStream 0.7 for the same job, run as a process of its own so its CPU
is measured as Switchboard's is.

``StreamSub(batch=True, max_records=1000)`` subscribers on the bench stream's
group, one psycopg connection each; per batch one transaction writes
Switchboard's own rows with binary ``unnest``, with the same dedup semantics
(inbox first: ``ON CONFLICT DO NOTHING`` on the inbox's native-id index; a
todo and an event only for the entries the inbox did not hold yet), and XACKs
after the commit. ``--bookkeeping`` adds what Switchboard keeps besides: the
todo's 'pending' ``todo_events`` row, and the inbox rows marked acked (with
their ``acked_at``) in a second transaction after the XACK.

The bench starts it, waits for ``ready`` on its stdout (imports done,
connections open), starts its clock and writes ``go``; the subscribers start
then. It runs until its stdin closes. Not part of the product: the ``bench``
extra brings faststream.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

import psycopg
from faststream import AckPolicy
from faststream.redis import RedisBroker, StreamSub
from faststream.redis.annotations import RedisBatchStreamMessage

# The native key first (inbox_keys, as the store claims it), the inbox row
# under the id it took; todos and events only for the rows it inserted.
STORE_SQL = """
WITH u AS (
    SELECT * FROM unnest(%(keys)b::text[], %(ids)b::text[], %(bodies)b::bytea[], %(payloads)b::text[])
        WITH ORDINALITY AS u(k, m, b, p, n)
), keyed AS (
    INSERT INTO inbox_keys (adapter, idempotency_key, inbox_id)
    SELECT 'bench', u.k, nextval(pg_get_serial_sequence('inbox', 'id')) FROM u ORDER BY u.n
    ON CONFLICT (adapter, idempotency_key) DO NOTHING
    RETURNING idempotency_key, inbox_id
), ins AS (
    INSERT INTO inbox (id, adapter, idempotency_key, source_message_id, consumer, body, ack_kind, ack_key,
                       ack_group, ack_entry_id, ack_state, status)
    SELECT keyed.inbox_id, 'bench', u.k, u.m, %(consumer)s, u.b, 'xack', %(stream)s, %(group)s, u.m,
           'pending', 'stored'
    FROM u JOIN keyed ON keyed.idempotency_key = u.k ORDER BY u.n
    RETURNING id, idempotency_key
), t AS (
    INSERT INTO todos (queue, idempotency_key, payload)
    SELECT 'bench', u.k, u.p::jsonb FROM u JOIN ins ON ins.idempotency_key = u.k ORDER BY u.n
    ON CONFLICT (queue, idempotency_key) WHERE status IN ('pending', 'dispatched', 'running') DO NOTHING
    RETURNING id, idempotency_key
){logged}, ev AS (
INSERT INTO events (family, adapter, trust_mode, verified, verify_detail, idempotency_key,
                    source_message_id, payload, todo_id)
SELECT 'queue', 'bench', 'queue', false, 'redis acl: default', u.k, u.m, u.p::jsonb, t.id
FROM u JOIN t ON t.idempotency_key = u.k
)
SELECT array_agg(id) FROM ins
"""
LOGGED = """, logged AS (
    INSERT INTO todo_events (todo_id, from_status, to_status, detail)
    SELECT id, NULL, 'pending', 'created by the peer' FROM t
)"""
MARK_SQL = "UPDATE inbox SET ack_state = 'acked', acked_at = now() WHERE id = ANY(%(ids)b::int8[])"


async def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--database", required=True, help="libpq URL")
    parser.add_argument("--redis", required=True)
    parser.add_argument("--stream", required=True)
    parser.add_argument("--group", required=True)
    parser.add_argument("--subscribers", type=int, default=1)
    parser.add_argument("--max-records", type=int, default=1000)
    parser.add_argument("--bookkeeping", action="store_true")
    args = parser.parse_args(argv)
    store_sql = STORE_SQL.format(logged=LOGGED if args.bookkeeping else "")

    broker = RedisBroker(args.redis, log_level=30)
    connections = [await psycopg.AsyncConnection.connect(args.database) for _ in range(args.subscribers)]
    for i, conn in enumerate(connections):
        consumer = f"peer-{i}"
        sub = StreamSub(
            args.stream, group=args.group, consumer=consumer, batch=True, max_records=args.max_records
        )

        def handler(conn: psycopg.AsyncConnection[Any], consumer: str) -> Any:
            async def handle(msg: RedisBatchStreamMessage) -> None:
                ids = [m.decode() for m in msg.raw_message["message_ids"]]
                bodies = [fields[b"body"] for fields in msg.raw_message["data"]]
                keys = [f"redis:{args.stream}:{m}" for m in ids]
                params = {
                    "keys": keys,
                    "ids": ids,
                    "bodies": bodies,
                    "payloads": [b.decode() for b in bodies],
                    "consumer": consumer,
                    "stream": args.stream,
                    "group": args.group,
                }
                async with conn.transaction():
                    cur = await conn.execute(store_sql, params)
                    row = await cur.fetchone()
                await msg.ack()  # XACK, after the commit
                if args.bookkeeping and row and row[0]:
                    async with conn.transaction():
                        await conn.execute(MARK_SQL, {"ids": row[0]})

            return handle

        broker.subscriber(stream=sub, ack_policy=AckPolicy.MANUAL)(handler(conn, consumer))

    print("ready", flush=True)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.readline)  # go
    await broker.start()
    await loop.run_in_executor(None, sys.stdin.readline)  # EOF: stop
    await broker.stop()
    for conn in connections:
        await conn.close()
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
