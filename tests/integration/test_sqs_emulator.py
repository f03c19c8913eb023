"""The embedded SQS emulator (ingest/embedded/sqs_server.py): its FIFO
redelivery order, with moto's fault told apart from ours.

A FIFO group whose messages were received and never deleted comes back,
once their visibility timeout runs out, from its first message, as on AWS:
on the emulator (moto with ingest/embedded/moto_sqs.py's FIFO fix), whether the
next receive comes after the timeout or is a long poll already waiting
while it runs out. Plain moto 5.2.5 returns m2 first: the test on it says
when a moto upgrade makes the fix unneeded. And a restart keeps the port
but, moto holding everything in memory, not the queues.
"""

from __future__ import annotations

import importlib.metadata
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from botocore.exceptions import ClientError

from ingest.embedded.processes import wait_for
from ingest.embedded.sqs_server import SqsServer
from tests.support.sqs import client, counts, create_queue, owned_sqs, receive, send

BODIES = ["m0", "m1", "m2", "m3"]
GROUP = "g"
VISIBILITY_TIMEOUT_S = 1  # SQS's smallest above 0: the tests wait it out
TIMEOUT_WAIT_S = 10.0  # bound on waiting for it to run out, on a loaded machine


@pytest.fixture(scope="module")
def emulator() -> Iterator[SqsServer]:
    with owned_sqs() as server:
        yield server


@pytest.fixture(scope="module")
def plain_moto() -> Iterator[SqsServer]:
    """moto's own server, without the fixes."""
    with owned_sqs(module="moto.server") as server:
        yield server


def _fifo_with_three_in_flight(sqs: Any) -> str:
    """A FIFO queue holding m0..m3 in one group, m0..m2 received and not
    deleted (in flight for VISIBILITY_TIMEOUT_S); its URL."""
    url = create_queue(
        sqs, f"q-{uuid.uuid4().hex[:12]}.fifo", fifo=True, visibility_timeout_s=VISIBILITY_TIMEOUT_S
    )
    send(sqs, url, BODIES, group=GROUP)
    first = receive(sqs, url, 3)
    assert [m["Body"] for m in first] == BODIES[:3]
    return url


def _redelivered_after_the_timeout(sqs: Any, url: str) -> list[str]:
    """The bodies of one receive made once nothing is in flight any more."""
    wait_for(
        lambda: counts(sqs, url)[1] == 0, timeout_s=TIMEOUT_WAIT_S, what="the visibility timeout to run out"
    )
    return [m["Body"] for m in receive(sqs, url, 10)]


def _assert_in_order_from_m0(bodies: list[str]) -> None:
    assert bodies, "nothing redelivered"
    assert bodies == BODIES[: len(bodies)], f"redelivered out of order: {bodies}"


def test_a_fifo_group_comes_back_from_its_first_message(emulator: SqsServer) -> None:
    sqs = client(emulator.url)
    url = _fifo_with_three_in_flight(sqs)
    _assert_in_order_from_m0(_redelivered_after_the_timeout(sqs, url))


def test_a_long_poll_waiting_while_the_timeout_runs_out_gets_the_group_from_m0(emulator: SqsServer) -> None:
    """The receive starts while m0..m2 are in flight (m3 is visible but its
    group blocked): it waits, and returns once their timeout has run out."""
    sqs = client(emulator.url)
    url = _fifo_with_three_in_flight(sqs)
    bodies = [m["Body"] for m in receive(sqs, url, 10, wait_time_s=VISIBILITY_TIMEOUT_S + 5)]
    _assert_in_order_from_m0(bodies)


def test_plain_moto_still_redelivers_out_of_order(plain_moto: SqsServer) -> None:
    """What the FIFO fix is for. When this fails, moto has changed: if it
    now answers m0 first, that fix can go (the version guard then needs a
    look too)."""
    sqs = client(plain_moto.url)
    url = _fifo_with_three_in_flight(sqs)
    bodies = _redelivered_after_the_timeout(sqs, url)
    version = importlib.metadata.version("moto")
    assert bodies[:1] != ["m0"], (
        f"plain moto {version} redelivered {bodies}: m0 first, as AWS does. The FIFO redelivery patch in"
        " ingest/embedded/moto_sqs.py (_in_order, _release_timed_out) may be dropped, with this test"
    )
    assert bodies == ["m2", "m3"], (
        f"plain moto {version} redelivered {bodies}, neither AWS's order nor moto 5.2.5's [m2, m3]:"
        " check ingest/embedded/moto_sqs.py's patch against this moto"
    )


def test_a_restart_keeps_the_port_and_loses_the_queues() -> None:
    with owned_sqs() as server:
        sqs = client(server.url)
        url = create_queue(sqs, "kept-in-memory")
        send(sqs, url, ["lost"])
        port, pid = server.port, server.pid
        server.restart()
        assert (server.port, server.running) == (port, True)
        assert server.pid != pid
        with pytest.raises(ClientError) as gone:
            counts(sqs, url)
        assert "NonExistentQueue" in str(gone.value.response["Error"]["Code"])
