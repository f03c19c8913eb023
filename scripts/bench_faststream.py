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
then. It runs until its stdin closes, or ends at once with status 3 when a
batch fails (its error on stderr, the run's log). Not part of the product: the ``bench``
extra brings faststream.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from typing import Any

import psycopg
from bench_peer_sql import LOGGED, MARK_SQL, STORE_SQL
from faststream import AckPolicy
from faststream.redis import RedisBroker, StreamSub
from faststream.redis.annotations import RedisBatchStreamMessage

# The exit status of a peer whose batch failed (its log says why).
EXIT_BATCH_FAILED = 3


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

    # FastStream logs to stdout by default, where the bench reads only the
    # first line: its warnings and errors go to stderr (the run's log).
    log = logging.getLogger("bench_faststream")
    log.addHandler(logging.StreamHandler(sys.stderr))
    log.setLevel(logging.WARNING)
    broker = RedisBroker(args.redis, logger=log)
    connections = [await psycopg.AsyncConnection.connect(args.database) for _ in range(args.subscribers)]
    for i, conn in enumerate(connections):
        consumer = f"peer-{i}"
        sub = StreamSub(
            args.stream, group=args.group, consumer=consumer, batch=True, max_records=args.max_records
        )

        def handler(conn: psycopg.AsyncConnection[Any], consumer: str) -> Any:
            async def stored(msg: RedisBatchStreamMessage) -> None:
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

            async def handle(msg: RedisBatchStreamMessage) -> None:
                try:
                    await stored(msg)
                except Exception:
                    # A peer that cannot store measures nothing: it ends at
                    # once (the bench then fails naming its log), rather
                    # than leave its batch pending for the bench's timeout.
                    log.exception("the peer's batch failed")
                    os._exit(EXIT_BATCH_FAILED)

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
