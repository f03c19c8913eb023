"""What the workers refuse of a dramatiq message, and which options they
drop (issue 32): dramatiq decodes a message body without checking a type."""

from __future__ import annotations

from typing import Any

import dramatiq
import pytest

from backhalf.queues import QueueConfig
from ingest.processes.worker_messages import ignored_options, message_refusal, well_formed

QUEUE = QueueConfig(name="orders", handler="m:f", max_attempts=5)


def message(**fields: Any) -> dramatiq.Message[Any]:
    base: dict[str, Any] = {
        "queue_name": "orders", "actor_name": "switchboard:orders", "args": (7,), "kwargs": {}, "options": {},
    }  # fmt: skip
    return dramatiq.Message(**{**base, **fields})


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({}, None),
        ({"queue_name": "orders.DQ"}, None),  # a retry's delayed copy
        ({"kwargs": None}, "bad_arguments"),
        ({"kwargs": 5}, "bad_arguments"),
        ({"kwargs": {"_queue": "refunds"}}, "bad_arguments"),
        ({"options": []}, "bad_arguments"),
        ({"args": ("abc",)}, "bad_arguments"),
        ({"args": (True,)}, "bad_arguments"),
        ({"args": (0,)}, "bad_arguments"),
        ({"args": (2**63,)}, "bad_arguments"),
        ({"args": (7, 8)}, "bad_arguments"),
        ({"queue_name": "refunds"}, "other_queue"),
        ({"queue_name": 7}, "other_queue"),
    ],
)
def test_only_the_relays_shape_is_run(fields: dict[str, Any], reason: str | None) -> None:
    assert message_refusal(message(**fields), QUEUE, {"orders"}) == reason


def test_a_queue_this_worker_does_not_consume_is_refused() -> None:
    assert message_refusal(message(), QUEUE, {"refunds"}) == "other_queue"


@pytest.mark.parametrize(
    ("options", "dropped"),
    [
        ({"retries": 2, "traceback": "...", "redis_message_id": "x", "eta": 1.5}, []),
        ({"time_limit": 50, "max_retries": 0}, ["time_limit", "max_retries"]),
        ({"retries": -(10**18)}, ["retries"]),  # would zero dramatiq's backoff
        ({"retries": "1"}, ["retries"]),
        ({"retries": 60}, []),  # past max_attempts: dramatiq's own, in a database outage
    ],
)
def test_overriding_and_forged_bookkeeping_options_are_dropped(
    options: dict[str, Any], dropped: list[str]
) -> None:
    assert sorted(ignored_options(options, QUEUE)) == sorted(dropped)


def test_well_formed_is_the_types_dramatiq_assumes() -> None:
    assert well_formed(message())
    assert not well_formed(message(kwargs=None))
    assert not well_formed(message(options=None))
    assert not well_formed(message(queue_name=7))


def test_a_worker_behind_dramatiqs_option_readers_does_not_start() -> None:
    """Their before_process_message would read a forged time limit before
    Switchboard's drops it: the worker refuses to boot (a MiddlewareError is
    the one failure dramatiq's emit_before lets through)."""
    from dramatiq.brokers.stub import StubBroker

    from ingest.config import from_mapping
    from ingest.processes.worker import SwitchboardMiddleware
    from ingest.processes.worker_messages import MiddlewareOrderError

    settings = from_mapping(
        {
            "database": {"url": "postgresql://sb@127.0.0.1/sb"},
            "queues": {"orders": {"handler": "json:loads"}},
        },
        {},
    )
    behind = StubBroker()
    behind.add_middleware(SwitchboardMiddleware(settings))
    with pytest.raises(MiddlewareOrderError, match="must come before dramatiq's AgeLimit, TimeLimit"):
        behind.emit_before("worker_boot", None)
    first = StubBroker()
    first.add_middleware(SwitchboardMiddleware(settings), before=type(first.middleware[0]))
    first.emit_before("worker_boot", None)  # no error
