"""The embedded RabbitMQ (ingest/embedded/rabbitmq_server.py), started for
real from the system's rabbitmq-server package: it logs in only the users
its definitions give, with their permissions; persistent messages survive a
restart and a SIGKILL; no process of it outlives ``stop``; two run side by
side; its consumer_timeout closes a channel within seconds; and its
password reaches no repr, file, command line or exception.

Every test is skipped, and counted in the session's summary, where the
package is not installed (tests.support.amqp)."""

from __future__ import annotations

import asyncio
import secrets
import subprocess
from collections.abc import Iterator
from pathlib import Path

import aio_pika
import aiormq.exceptions
import pytest

from ingest.embedded.rabbitmq_server import AmqpQueue, AmqpUser, RabbitMqServer
from ingest.embedded.servers import temp_base
from tests.support.amqp import amqp_client, owned_rabbitmq, publish, queue_counts, require_rabbitmq
from tests.support.processes import SECRET

READER_PASSWORD = f"reader-{secrets.token_hex(8)}"
# The least-privilege user: consumes from "allowed" and nothing else.
READER = AmqpUser("reader", READER_PASSWORD, configure="", write="", read="^allowed$")
QUEUES = [AmqpQueue("allowed"), AmqpQueue("forbidden")]
CONSUMER_TIMEOUT_MS = 1000


@pytest.fixture(scope="module")
def broker() -> Iterator[RabbitMqServer]:
    with owned_rabbitmq(users=[READER], queues=QUEUES, consumer_timeout_ms=CONSUMER_TIMEOUT_MS) as server:
        yield server


def _processes_of(server: RabbitMqServer) -> set[int]:
    """The broker, its epmd and every process below the broker (``ps``)."""
    ps = subprocess.run(
        ["ps", "-eo", "pid=,ppid=,stat="], capture_output=True, text=True, check=True, timeout=10
    )
    rows = [line.split() for line in ps.stdout.splitlines()]
    live = {int(pid): int(ppid) for pid, ppid, stat in rows if not stat.startswith("Z")}
    found = {pid for pid in (server.pid, server.epmd_pid) if pid is not None}
    while more := {pid for pid, ppid in live.items() if ppid in found} - found:
        found |= more
    return found


def _alive(pids: set[int]) -> set[int]:
    ps = subprocess.run(
        ["ps", "-eo", "pid=,stat=,args="], capture_output=True, text=True, check=True, timeout=10
    )
    return {int(f[0]) for f in (line.split(None, 2) for line in ps.stdout.splitlines())
            if int(f[0]) in pids and not f[1].startswith("Z")}  # fmt: skip


def _mentioning(text: str) -> list[str]:
    """``ps`` lines naming ``text`` (a node name, a base directory)."""
    ps = subprocess.run(
        ["ps", "-eo", "pid=,stat=,args="], capture_output=True, text=True, check=True, timeout=10
    )
    return [line for line in ps.stdout.splitlines() if text in line and not line.split()[1].startswith("Z")]


async def test_it_logs_in_its_users_and_no_guest(broker: RabbitMqServer) -> None:
    async with amqp_client(broker.url) as client:
        await client.declare_queue("logged-in")
        await client.delete_queue("logged-in")
    for url in (broker.url_as("guest", "guest"), broker.url_as("switchboard", "not-the-password")):
        with pytest.raises(aiormq.exceptions.ProbableAuthenticationError):
            await aio_pika.connect(url, timeout=10)


async def test_a_user_reads_only_what_its_permissions_allow(broker: RabbitMqServer) -> None:
    """Refused by the broker itself: ACCESS_REFUSED closes the channel."""
    publish(broker.url, "allowed", [b"yours"])
    publish(broker.url, "forbidden", [b"not yours"])
    connection = await aio_pika.connect(broker.url_as(READER.name, READER_PASSWORD), timeout=10)
    try:
        channel = await connection.channel()
        allowed = await channel.get_queue("allowed", ensure=False)
        message = await allowed.get(timeout=10)
        assert message.body == b"yours"
        await message.ack()
        forbidden = await channel.get_queue("forbidden", ensure=False)
        with pytest.raises(aiormq.exceptions.ChannelAccessRefused, match="ACCESS_REFUSED"):
            await forbidden.get(timeout=10)
        channel = await connection.channel()
        with pytest.raises(aiormq.exceptions.ChannelAccessRefused, match="ACCESS_REFUSED"):
            await channel.declare_queue("its-own", durable=True)
    finally:
        await connection.close()
    assert queue_counts(broker.url, "forbidden") == (1, 0, 0)


async def test_consumer_timeout_closes_the_channel_within_seconds(broker: RabbitMqServer) -> None:
    """RabbitMQ 3.10 checks consumer_timeout on the channel's tick (once a
    minute by default); the server ticks every second when given one."""
    async with amqp_client(broker.url) as client:
        await client.declare_queue("slow")
        await client.publish("slow", [b"held"])
        channel = await client.connection.channel()
        closed: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()

        async def on_close(_: object, exc: BaseException | None) -> None:
            if not closed.done():
                closed.set_result(exc)

        channel.close_callbacks.add(on_close)
        queue = await channel.get_queue("slow", ensure=False)
        delivered = asyncio.Event()

        async def on_message(_: aio_pika.abc.AbstractIncomingMessage) -> None:
            delivered.set()  # and never acked

        await queue.consume(on_message)
        await asyncio.wait_for(delivered.wait(), 10)
        assert queue_counts(broker.url, "slow") == (0, 1, 1)
        reason = await asyncio.wait_for(closed, 15)
        assert isinstance(reason, aiormq.exceptions.ChannelPreconditionFailed)
        assert "delivery acknowledgement" in str(reason)
        await client.delete_queue("slow")


async def test_persistent_messages_survive_a_restart_and_a_kill_and_nothing_outlives_stop(
    broker: RabbitMqServer,
) -> None:
    """A second server beside the module's (node, ports and epmd of its
    own); a classic and a quorum queue keep what was confirmed through a
    clean restart and through SIGKILL; after stop no process of it is left."""
    with owned_rabbitmq() as server:
        assert server.node != broker.node
        assert {server.port, server.dist_port, server.epmd_port}.isdisjoint(
            {broker.port, broker.dist_port, broker.epmd_port}
        )
        async with amqp_client(server.url) as client:
            await client.declare_queue("classic")
            await client.declare_queue("quorum", quorum=True)
            for queue in ("classic", "quorum"):
                await client.publish(queue, [b"m1", b"m2"], message_ids=["id-1", "id-2"])
                held = await (await client.channel.get_queue(queue, ensure=False)).get(timeout=10)
                assert held.message_id == "id-1"
                # One ready, one held unacked; a quorum queue counts the
                # channel holding a basic.get's message as a consumer (as
                # its passive declare says too).
                assert server.queue_counts(queue) == (1, 1, 0 if queue == "classic" else 1)
        server.restart()
        assert {q: server.queue_counts(q) for q in ("classic", "quorum")} == {
            "classic": (2, 0, 0),
            "quorum": (2, 0, 0),
        }
        before_kill = _processes_of(server)
        server.kill()
        assert not _alive(before_kill - {server.epmd_pid}), "the broker's processes outlived SIGKILL"
        server.restart()
        async with amqp_client(server.url) as client:
            for queue in ("classic", "quorum"):
                q = await client.channel.get_queue(queue, ensure=False)
                bodies = []
                for _ in range(2):
                    message = await q.get(timeout=10)
                    bodies.append(message.body)
                    await message.ack()
                assert sorted(bodies) == [b"m1", b"m2"], queue
        # The module's broker ran on meanwhile.
        async with amqp_client(broker.url) as client:
            await client.declare_queue("still-here")
            await client.delete_queue("still-here")
        running = _processes_of(server)
        assert len(running) >= 3  # beam.smp, erl_child_setup, epmd at least
        server.stop()
        assert not _alive(running), "a process of the broker outlived stop()"
        assert not _mentioning(server.node)
        assert not _mentioning(str(server.base_dir))


def test_the_password_reaches_no_repr_file_command_line_or_exception(broker: RabbitMqServer) -> None:
    assert broker.password == SECRET
    for text in (repr(broker), broker.display_url, str(READER), repr(READER)):
        assert SECRET not in text
        assert READER_PASSWORD not in text
    for path in broker.base_dir.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert SECRET.encode() not in data, path
            assert READER_PASSWORD.encode() not in data, path
            assert path.stat().st_mode & 0o077 == 0, f"{path} is not private"
    for pid in _processes_of(broker):
        for name in ("cmdline", "environ"):
            assert SECRET.encode() not in Path(f"/proc/{pid}/{name}").read_bytes()
    # A broker that cannot start: its error, log tails and all, names no password.
    require_rabbitmq()
    failing = RabbitMqServer.create(
        temp_base("switchboard-rabbitmq-") / "rabbitmq", password=SECRET, conf="no_such_setting = 1"
    )
    try:
        with pytest.raises(RuntimeError, match="RabbitMQ could not start") as failed:
            failing.start()
        assert SECRET not in str(failed.value)
        assert "no_such_setting" in str(failed.value)
    finally:
        failing.cleanup()
        failing.base_dir.parent.joinpath("owner.pid").unlink()
        failing.base_dir.parent.rmdir()
