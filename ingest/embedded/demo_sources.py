"""Where ``switchboard demo`` produces its orders: a Redis stream (the
default), a NATS JetStream stream (``--transport nats``), an SQS queue on
the SQS emulator (``--transport sqs``) or a RabbitMQ queue (``--transport
amqp``). Each source says what its adapter
table is, how to publish a chunk of bodies, the broker's own count of what
is still unacked, in that broker's words, and what the demo's processes need
in their environment to reach it."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import threading
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import redis

if TYPE_CHECKING:
    from ingest.embedded.rabbitmq_server import RabbitMqServer
    from ingest.embedded.sqs_server import SqsServer

STREAM = "orders"
NATS_STREAM = "ORDERS"
NATS_SUBJECT = "ORDERS.new"
GROUP = "switchboard"
SQS_QUEUE = "orders"
AMQP_QUEUE = "orders"
TRANSPORTS = ("redis", "nats", "sqs", "amqp")

_T = TypeVar("_T")


class DemoSource(Protocol):
    transport: str
    source_word: str  # what the orders go to: a stream, a queue
    ack_word: str  # what the acker sends, for the report
    unacked_label: str
    restart_note: str
    process_env: dict[str, str]  # added to the ingester's, acker's and worker's environment

    def adapter(self) -> dict[str, Any]: ...

    def produce(self, bodies: list[bytes], traceparent: str | None = None) -> None:
        """Send ``bodies``, each with ``traceparent`` where this broker carries one (``--trace``)."""
        ...

    def unacked(self) -> int: ...


def _common_adapter() -> dict[str, Any]:
    return {"name": "orders", "queue": "orders", "ack_after": "store", "batch_size": 200, "block_ms": 200}


class RedisStreamSource:
    transport = "redis"
    source_word = "stream"
    ack_word = "XACK"
    unacked_label = "pending in Redis (PEL)"
    restart_note = "same consumer name: it re-reads its own PEL"

    def __init__(self, client: redis.Redis) -> None:
        self._r = client
        self.process_env: dict[str, str] = {}

    def adapter(self) -> dict[str, Any]:
        return {**_common_adapter(), "transport": "redis", "mode": "stream", "source": STREAM, "group": GROUP}

    def produce(self, bodies: list[bytes], traceparent: str | None = None) -> None:
        pipe = self._r.pipeline(transaction=False)
        for body in bodies:
            fields: dict[str | bytes, str | bytes] = {"body": body}
            if traceparent:
                fields["traceparent"] = traceparent
            pipe.xadd(STREAM, fields)  # type: ignore[arg-type]
        pipe.execute()

    def unacked(self) -> int:
        return int(self._r.xpending(STREAM, GROUP)["pending"])


class NatsSource:
    """A JetStream stream on the demo's own nats-server, through nats-py
    (asyncio only) on an event loop of its own thread (``_LoopThread``: a
    stop signal must not land inside the loop's callbacks, where nats-py
    would log it as a connection error and time out), kept for the demo's
    length."""

    transport = "nats"
    source_word = "stream"
    ack_word = "+ACK"
    unacked_label = "unacked in JetStream"
    # The demo's ack_wait: what the killed ingester held comes back this soon.
    ACK_WAIT_MS = 3000
    restart_note = f"what it held and never stored comes back after ack_wait ({ACK_WAIT_MS} ms)"
    CALL_TIMEOUT_S = 10.0
    # A chunk's publishes, each acked by the stream, with room to spare.
    PRODUCE_TIMEOUT_S = 60.0

    def __init__(self, url: str) -> None:
        import nats  # the nats extra, which the embedded kit installs
        from nats.aio.client import Client
        from nats.js import JetStreamContext

        self._url = url
        self.process_env: dict[str, str] = {}
        self._client: Client | None = None
        self._loop = _LoopThread("demo-nats")

        async def open_stream() -> JetStreamContext:
            self._client = await nats.connect(url, allow_reconnect=False, connect_timeout=5)
            js = self._client.jetstream(timeout=self.CALL_TIMEOUT_S)
            await js.add_stream(name=NATS_STREAM, subjects=[f"{NATS_STREAM}.>"])
            return js

        try:
            self._js = self._loop.call(open_stream, self.CALL_TIMEOUT_S * 3)
        except BaseException:
            self.close()
            raise

    def adapter(self) -> dict[str, Any]:
        return {
            **_common_adapter(),
            "transport": "nats",
            "mode": "jetstream",
            "source": NATS_STREAM,
            "group": GROUP,
            "url": self._url,
            "ack_wait_ms": self.ACK_WAIT_MS,
        }

    def produce(self, bodies: list[bytes], traceparent: str | None = None) -> None:
        headers = {"traceparent": traceparent} if traceparent else None

        async def publish() -> None:
            acks = [
                await self._js.publish(NATS_SUBJECT, body, timeout=self.CALL_TIMEOUT_S, headers=headers)
                for body in bodies
            ]
            assert len(acks) == len(bodies)

        self._loop.call(publish, self.PRODUCE_TIMEOUT_S)

    def unacked(self) -> int:
        async def figures() -> int:
            info = await self._js.consumer_info(NATS_STREAM, GROUP)
            return int(info.num_ack_pending or 0) + int(info.num_pending or 0)

        return self._loop.call(figures, self.CALL_TIMEOUT_S)

    def close(self) -> None:
        async def close_client() -> None:
            if self._client is not None:
                await self._client.close()

        try:
            self._loop.call(close_client, self.CALL_TIMEOUT_S)
        finally:
            self._loop.close(self.CALL_TIMEOUT_S)


class SqsSource:
    """A standard queue on the demo's own SQS emulator, through boto3's
    blocking client (moto's dependency, so the embedded kit has it). The
    demo's processes find the emulator's dummy credentials and region in
    their environment, as they would find AWS's."""

    transport = "sqs"
    source_word = "queue"
    ack_word = "DeleteMessageBatch"
    unacked_label = "left in the SQS queue"
    # The demo's ack_wait_ms, the queue's visibility timeout: what the killed
    # ingester held comes back this soon.
    ACK_WAIT_MS = 3000
    restart_note = f"what it held and never stored comes back after its visibility timeout ({ACK_WAIT_MS} ms)"
    SEND_BATCH = 10  # SendMessageBatch's most entries
    _COUNTS = ("ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible",
               "ApproximateNumberOfMessagesDelayed")  # fmt: skip

    def __init__(self, server: SqsServer) -> None:
        import boto3  # moto's dependency, which the embedded kit installs
        from botocore.config import Config

        from ingest.embedded.sqs_server import ACCESS_KEY_ID, SECRET_ACCESS_KEY

        self._endpoint, self._region = server.url, server.region
        self.process_env = server.client_env()
        session = boto3.session.Session(
            aws_access_key_id=ACCESS_KEY_ID,
            aws_secret_access_key=SECRET_ACCESS_KEY,
            region_name=server.region,
        )
        config = Config(
            connect_timeout=5, read_timeout=10, retries={"mode": "standard", "total_max_attempts": 3}
        )
        self._sqs = session.client("sqs", endpoint_url=server.url, config=config)
        attributes = {"VisibilityTimeout": str(self.ACK_WAIT_MS // 1000)}
        self._url: str = self._sqs.create_queue(QueueName=SQS_QUEUE, Attributes=attributes)["QueueUrl"]

    def adapter(self) -> dict[str, Any]:
        return {
            **_common_adapter(),
            "transport": "sqs",
            "mode": "queue",
            "source": SQS_QUEUE,
            "url": self._endpoint,
            "region": self._region,
            "ack_wait_ms": self.ACK_WAIT_MS,
        }

    def produce(self, bodies: list[bytes], traceparent: str | None = None) -> None:
        traced = {"traceparent": {"DataType": "String", "StringValue": traceparent}} if traceparent else {}
        for start in range(0, len(bodies), self.SEND_BATCH):
            chunk = bodies[start : start + self.SEND_BATCH]
            entries = [
                {"Id": str(i), "MessageBody": body.decode(), "MessageAttributes": traced}
                for i, body in enumerate(chunk)
            ]
            reply = self._sqs.send_message_batch(QueueUrl=self._url, Entries=entries)
            if reply.get("Failed"):
                raise RuntimeError(
                    f"SQS refused {len(reply['Failed'])} of the demo's messages: {reply['Failed'][0]}"
                )

    def unacked(self) -> int:
        """Visible, in flight and delayed: every message not yet deleted."""
        reply = self._sqs.get_queue_attributes(QueueUrl=self._url, AttributeNames=list(self._COUNTS))
        return sum(int(reply["Attributes"][name]) for name in self._COUNTS)

    def close(self) -> None:
        self._sqs.close()


class _LoopThread:
    """An event loop on a thread of its own, for a client the main thread
    calls and waits on. The demo's stop signals raise ``Stopped`` in the main
    thread wherever it is: inside an event loop's callback there (a socket's
    read), asyncio would catch it, log it as a fatal transport error and go
    on. Here the main thread only ever waits on a future, where ``Stopped``
    is raised cleanly, and makes no coroutine itself (none is left never
    awaited when a signal lands between making one and handing it over)."""

    def __init__(self, name: str) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def call(self, make: Callable[[], Awaitable[_T]], timeout_s: float) -> _T:
        """Run ``make()`` on the loop; its result, or its exception. A stop
        signal raises here while it runs on: ``close`` ends it."""
        done: concurrent.futures.Future[_T] = concurrent.futures.Future()

        def handover(task: asyncio.Future[_T]) -> None:
            if task.cancelled():
                done.cancel()
            elif (exc := task.exception()) is not None:
                done.set_exception(exc)
            else:
                done.set_result(task.result())

        def begin() -> None:
            asyncio.ensure_future(make()).add_done_callback(handover)

        self._loop.call_soon_threadsafe(begin)
        return done.result(timeout_s)

    def close(self, timeout_s: float) -> None:
        """Cancel what still runs on the loop, stop it and close it."""

        async def cancel_the_rest() -> None:
            rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in rest:
                task.cancel()
            await asyncio.gather(*rest, return_exceptions=True)

        try:
            self.call(cancel_the_rest, timeout_s)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout_s)
            if not self._thread.is_alive():
                self._loop.close()


class AmqpSource:
    """A durable classic queue on the demo's own RabbitMQ, through aio-pika
    (the amqp extra, which the embedded kit installs) on an event loop of its
    own thread (``_LoopThread``), kept for the demo's length. Each order is
    published persistent and confirmed by the broker; its ``message_id`` is
    its body's digest, the key the adapter would derive itself from a
    message without one (aio-pika would otherwise stamp a random id on each)."""

    transport = "amqp"
    source_word = "queue"
    ack_word = "basic.ack"
    unacked_label = "left in the RabbitMQ queue"
    restart_note = "the broker put back in the queue what its channel held unacked, as its connection ended"
    CALL_TIMEOUT_S = 10.0
    # A chunk's publishes and their confirms, with room to spare.
    PRODUCE_TIMEOUT_S = 60.0

    def __init__(self, server: RabbitMqServer) -> None:
        import aio_pika  # the amqp extra, which the embedded kit installs
        from aio_pika.abc import AbstractChannel, AbstractConnection

        self._server = server
        self.process_env: dict[str, str] = {}
        self._connection: AbstractConnection | None = None
        self._loop = _LoopThread("demo-amqp")

        async def open_channel() -> AbstractChannel:
            self._connection = await aio_pika.connect(server.url, timeout=self.CALL_TIMEOUT_S)
            channel = await self._connection.channel(publisher_confirms=True)
            await channel.declare_queue(AMQP_QUEUE, durable=True, timeout=self.CALL_TIMEOUT_S)
            return channel

        try:
            self._channel = self._loop.call(open_channel, self.CALL_TIMEOUT_S * 3)
        except BaseException:
            self.close()
            raise

    def adapter(self) -> dict[str, Any]:
        return {**_common_adapter(), "transport": "amqp", "mode": "queue", "source": AMQP_QUEUE,
                "url": self._server.url}  # fmt: skip

    def produce(self, bodies: list[bytes], traceparent: str | None = None) -> None:
        """Publish the chunk's messages at once, then wait for every confirm
        (three times the rate of one confirm at a time)."""
        headers: dict[str, Any] | None = {"traceparent": traceparent} if traceparent else None
        import aio_pika
        from pamqp.commands import Basic

        async def publish() -> None:
            exchange = self._channel.default_exchange
            confirms = await asyncio.gather(*(
                exchange.publish(
                    aio_pika.Message(body, delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                                     message_id=hashlib.sha256(body).hexdigest(), headers=headers),
                    routing_key=AMQP_QUEUE, mandatory=True, timeout=self.CALL_TIMEOUT_S,
                )
                for body in bodies
            ))  # fmt: skip
            refused = [c for c in confirms if not isinstance(c, Basic.Ack)]
            if refused:
                raise RuntimeError(f"RabbitMQ refused {len(refused)} of the demo's messages: {refused[0]!r}")

        self._loop.call(publish, self.PRODUCE_TIMEOUT_S)

    def unacked(self) -> int:
        """Ready and delivered-but-unacked: every message not yet acked, the
        broker's own figures (AMQP tells no unacked count)."""
        ready, unacked, _consumers = self._server.queue_counts(AMQP_QUEUE)
        return ready + unacked

    def close(self) -> None:
        async def close_connection() -> None:
            if self._connection is not None:
                await self._connection.close()

        try:
            self._loop.call(close_connection, self.CALL_TIMEOUT_S)
        finally:
            self._loop.close(self.CALL_TIMEOUT_S)


@contextlib.contextmanager
def demo_source(
    transport: str, base: Path, redis_client: redis.Redis | None
) -> Iterator[tuple[DemoSource, str]]:
    """The source for ``transport``, and a line saying where its server runs
    (a nats-server, an SQS emulator or a RabbitMQ of its own in ``base`` for
    NATS, SQS and AMQP; Redis is the demo's)."""
    if transport == "redis":
        assert redis_client is not None, "the Redis demo runs on the demo's Redis"
        yield RedisStreamSource(redis_client), ""
        return
    if transport == "sqs":
        from ingest.embedded.sqs_server import sqs_server

        with sqs_server(base / "sqs") as server:
            queue = SqsSource(server)
            try:
                yield queue, f"SQS (moto's emulator) on 127.0.0.1:{server.port} (pid {server.pid})"
            finally:
                queue.close()
        return
    if transport == "amqp":
        from ingest.embedded.rabbitmq_server import rabbitmq_server

        with rabbitmq_server(base / "rabbitmq") as rabbit:
            amqp = AmqpSource(rabbit)
            try:
                yield amqp, f"RabbitMQ on 127.0.0.1:{rabbit.port} (pid {rabbit.pid}, node {rabbit.node})"
            finally:
                amqp.close()
        return
    if transport != "nats":
        raise ValueError(f"the demo has no source on transport {transport!r}")
    from ingest.embedded.nats_server import nats_server

    with nats_server(base / "nats") as server:
        source = NatsSource(server.url)
        try:
            yield source, f"NATS (JetStream) on 127.0.0.1:{server.port} (pid {server.pid})"
        finally:
            source.close()
