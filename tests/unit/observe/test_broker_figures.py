"""Each transport's ``describe`` figures, mapped by its own definition onto
the neutral broker gauges (``ingest.observe.heartbeat``): the same gauge
means the same thing whatever the broker. The figures are the shapes each
adapter's ``describe`` gives (its contract test reads them from a real
broker)."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import REGISTRY

from ingest.config.transports import REGISTERED
from ingest.observe.heartbeat import _set_broker_gauges

DESCRIBED: dict[str, tuple[dict[str, Any], dict[str, float]]] = {
    "redis": (
        {"stream_length": 9, "lag": 4, "broker_pending": 2, "node": "a"},
        {"stream_length": 9, "stream_lag": 4, "pending_entries": 2},
    ),
    "nats": (
        {
            "stream_messages": 9,
            "num_pending": 4,
            "num_ack_pending": 2,
            "num_redelivered": 1,
            "max_ack_pending": 1000,
        },
        {"stream_length": 9, "stream_lag": 4, "pending_entries": 2, "ack_pending_limit": 1000},
    ),
    "sqs": (
        {"visible": 4, "in_flight": 2, "delayed": 0, "dead_letter_messages": 1},
        {"stream_lag": 4, "pending_entries": 2, "dead_letter_messages": 1},
    ),
    "amqp": (
        {"ready": 4, "held_here": 2, "consumers": 3},  # consumers: a count, no figure of ours
        {"stream_lag": 4, "pending_entries": 2},
    ),
}
GAUGES = (
    "stream_length",
    "stream_lag",
    "pending_entries",
    "ack_pending_limit",
    "list_length",
    "processing_length",
    "dead_letter_messages",
)


def gauges_of(adapter: str) -> dict[str, float]:
    values = {g: REGISTRY.get_sample_value(f"switchboard_broker_{g}", {"adapter": adapter}) for g in GAUGES}
    return {g: v for g, v in values.items() if v is not None}


def test_every_registered_transport_maps_its_figures() -> None:
    assert sorted(DESCRIBED) == sorted(REGISTERED)


@pytest.mark.parametrize("transport", sorted(DESCRIBED))
def test_a_transports_figures_set_the_neutral_gauges(transport: str) -> None:
    described, expected = DESCRIBED[transport]
    adapter = f"figures-{transport}"
    _set_broker_gauges(adapter, transport, described)
    assert gauges_of(adapter) == expected


def test_a_redis_list_reports_its_backlog_and_its_processing_lists_summed() -> None:
    consumers = {"c1": {"processing_length": 3}, "c2": {"processing_length": 4}, "c3": {"gone": True}}
    _set_broker_gauges("figures-list", "redis", {"list_length": 5, "consumers": consumers})
    assert gauges_of("figures-list") == {"list_length": 5, "processing_length": 7}


def test_a_missing_figure_or_an_unknown_transport_sets_nothing() -> None:
    # A consumer that is gone has no figures (None), and a bool is no number.
    _set_broker_gauges(
        "figures-gone", "nats", {"stream_messages": 3, "num_pending": None, "num_ack_pending": True}
    )
    assert gauges_of("figures-gone") == {"stream_length": 3}
    _set_broker_gauges("figures-unknown", "carrier-pigeon", {"stream_length": 3})
    assert gauges_of("figures-unknown") == {}
