"""dramatiq's ack of a message held until its todo's end is settled
(ingest.processes.worker_acks), in both orders, and an ack that fails on
the broker tried again."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from dramatiq.errors import BrokerConnectionError

from ingest.processes import worker_acks
from ingest.processes.worker_acks import DeferredAcks


class Message:
    message_id = "m-1"


@pytest.fixture
def acks() -> Any:
    deferred = DeferredAcks()
    yield deferred
    deferred.close()


def recorder() -> tuple[list[Any], threading.Event, Any]:
    made: list[Any] = []
    event = threading.Event()

    def ack(message: Any) -> None:
        made.append(message)
        event.set()

    return made, event, ack


def test_an_ack_asked_for_before_the_end_is_settled_waits_for_it(acks: DeferredAcks) -> None:
    message = Message()
    made, event, ack = recorder()
    release = acks.hold(message)
    acks.ack(message, ack)
    assert not event.wait(0.2)  # held: the end is not committed yet
    assert acks.waiting == 1
    release()
    assert event.wait(5)
    assert made == [message]


def test_an_end_settled_before_the_ack_is_asked_for_lets_it_through_at_once(acks: DeferredAcks) -> None:
    message = Message()
    made, _, ack = recorder()
    acks.hold(message)()
    acks.ack(message, ack)  # made in the caller's thread
    assert made == [message]
    assert acks.waiting == 0


def test_a_message_not_held_is_acked_at_once(acks: DeferredAcks) -> None:
    made, _, ack = recorder()
    message = Message()
    acks.ack(message, ack)
    assert made == [message]


def test_an_ack_the_broker_refuses_is_tried_again(
    acks: DeferredAcks, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(worker_acks, "ACK_RETRY_DELAYS_S", (0.01, 0.01))
    message = Message()
    calls: list[Any] = []
    event = threading.Event()

    def flaky(m: Any) -> None:
        calls.append(m)
        if len(calls) < 3:
            raise BrokerConnectionError("connection refused")  # type: ignore[no-untyped-call]
        event.set()

    release = acks.hold(message)
    acks.ack(message, flaky)
    release()
    assert event.wait(5)
    assert len(calls) == 3
