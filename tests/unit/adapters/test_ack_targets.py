"""An acknowledger acts only on the targets its adapter's config names
(issue 43): the shapes each transport accepts, and the one error line for
the claims it leaves out. The brokers' side is in the integration tests
(``test_redis_streams``, ``test_redis_lists``, ``test_nats_jetstream``,
``test_sqs_queue``)."""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from backhalf.records import AckClaim
from ingest.adapters.base import REFUSED_TARGET_CHARS, REFUSED_TARGETS_NAMED, own_targets
from ingest.adapters.redis.lists import is_processing_key, processing_key, removed_marker
from ingest.adapters.redis.streams import is_entry_id


@pytest.mark.parametrize(
    ("ref", "well_formed"),
    [
        ("1796221376233-0", True),
        ("0-1", True),
        (f"{2**64 - 1}-{2**64 - 1}", True),
        (f"{2**64}-0", False),  # past 64 bits: XACK would refuse the whole call
        ("1796221376233", False),  # XACK reads it as <ms>-0; no intent holds it so
        ("1-0 2-0", False),
        ("1-0\n", False),
        ("-", False),
        ("+", False),
        ("1-*", False),
        ("\u0661-\u0660", False),  # digits, but not ASCII ones
        ("", False),
    ],
)
def test_a_stream_intents_ref_must_be_an_entry_id(ref: str, well_formed: bool) -> None:
    assert is_entry_id(ref) is well_formed


@pytest.mark.parametrize("cluster", [False, True])
@pytest.mark.parametrize("consumer", ["c1", "host-1.example", "a:b", "processing", "{x}"])
def test_every_consumers_processing_list_of_the_source_is_the_adapters(consumer: str, cluster: bool) -> None:
    """Any consumer's list: the acker's own config names no ingester's."""
    assert is_processing_key(processing_key("jobs", consumer, cluster=cluster), "jobs", cluster=cluster)


@pytest.mark.parametrize(
    ("key", "cluster"),
    [
        ("jobs", False),  # the source list itself
        ("other", False),  # another application's list
        ("jobs:processing:", False),  # no consumer
        ("jobs:processing", False),
        ("jobs:consumers", False),
        ("jobs:heartbeat:c1", False),
        ("jobs2:processing:c1", False),  # another source's
        ("xjobs:processing:c1", False),
        ("{jobs}:processing:c1", False),  # the Cluster form, on an adapter without cluster
        ("jobs:processing:c1", True),  # the plain form, on a Cluster adapter
        ("{jobs2}:processing:c1", True),
        ("{jobs}x:processing:c1", True),
        (removed_marker(processing_key("jobs", "c1"), 7), False),  # a marker, not a list
        (removed_marker(processing_key("jobs", "c1", cluster=True), 7), True),
        ("JOBS:processing:c1", False),
    ],
)
def test_no_other_key_is_a_processing_list_of_the_source(key: str, cluster: bool) -> None:
    assert not is_processing_key(key, "jobs", cluster=cluster)


def test_a_source_that_itself_looks_derived_keeps_its_own_lists_only() -> None:
    """``a:processing:b``'s lists are its own, never another source's."""
    assert is_processing_key("a:processing:b:processing:c", "a:processing:b")
    assert not is_processing_key("a:processing:c", "a:processing:b")


@pytest.mark.parametrize(
    ("ref", "acks"),
    [
        ("$JS.ACK.ORDERS.switchboard.1.7.7.1796221376233174239.0", True),
        # A domain and an account hash before the stream (the v2 layout), with
        # the server's random last token, and without it (nats-py reads both).
        ("$JS.ACK.hub.ACCHASH.ORDERS.switchboard.1.7.7.1796221376233174239.0.token", True),
        ("$JS.ACK.hub.ACCHASH.ORDERS.switchboard.1.7.7.1796221376233174239.0", True),
        ("$JS.ACK._.ACCHASH.ORDERS.switchboard.1.7.7.1796221376233174239.0.token", True),
        ("$JS.ACK.OTHER.switchboard.1.7.7.1796221376233174239.0", False),  # another stream's
        ("$JS.ACK.ORDERS.other.1.7.7.1796221376233174239.0", False),  # another consumer's
        ("$JS.ACK.hub.ACCHASH.OTHER.switchboard.1.7.7.1796221376233174239.0.t", False),
        ("$JS.ACK.hub.ACCHASH.ORDERS.other.1.7.7.1796221376233174239.0.t", False),
        # The names where the other form has them: neither form's.
        ("$JS.ACK.ORDERS.switchboard.x.y.1.7.7.1796221376233174239.0", False),
        ("$JS.ACK.ORDERS.switchboard.1.7.7.1796221376233174239", False),  # 8 tokens
        ("$JS.ACK.ORDERS.switchboard.1.7.7.1796221376233174239.0.x", False),  # 10 tokens
        ("$JS.ACK.ORDERS.switchboard.*.7.7.1796221376233174239.0", False),  # a wildcard
        ("$JS.ACK.ORDERS.switchboard.>", False),
        ("$JS.ACK.hub.*.ORDERS.switchboard.1.7.7.1796221376233174239.0.t", False),
        ("$JS.ACK.hub.ACCHASH.ORDERS.switchboard.1.7.7.1796221376233174239.0.>", False),
        ("$JS.ACK.ORDERS.switchboard.one.7.7.1796221376233174239.0", False),  # not a count
        ("$JS.ACK.ORDERS.switchboard.1..7.1796221376233174239.0", False),  # an empty token
        ("$JS.ACK.ORDERS.switchboard.1.7.7.17962 21376233174239.0", False),
        ("orders.new", False),  # no ack subject at all: never published to
        ("$JS.API.STREAM.DELETE.ORDERS", False),
        ("$JS.API.CONSUMER.DELETE.ORDERS.switchboard.1.7.7", False),
        ("", False),
    ],
)
def test_the_acker_acks_only_its_consumers_ack_subjects(ref: str, acks: bool) -> None:
    """A row's ref is data: the acker publishes +ACK to nothing but an ack
    subject of the config's stream and durable consumer."""
    from ingest.adapters.nats.jetstream import is_ack_subject_of

    assert is_ack_subject_of(ref, "ORDERS", "switchboard") is acks


def _claim(inbox_id: int, key: str | None) -> AckClaim:
    return AckClaim(inbox_id, "orders", "xack", key, "switchboard", "1-0", 1, None)


def test_claims_outside_the_config_are_left_out_with_one_error_line() -> None:
    claims = [
        _claim(1, "orders"),
        _claim(2, "payments"),
        _claim(3, "orders"),
        _claim(4, "audit"),
        _claim(5, None),
    ]
    with capture_logs() as logs:
        ours = own_targets(claims, lambda c: c.key == "orders", adapter="orders", target=lambda c: f"{c.key}")
    assert [c.inbox_id for c in ours] == [1, 3]
    (line,) = logs
    assert line["event"] == "ack_target_refused"
    assert line["log_level"] == "error"
    assert (line["adapter"], line["inbox_ids"], line["refused"]) == ("orders", [2, 4, 5], 3)
    assert line["targets"] == ["None", "audit", "payments"]


def test_claims_all_inside_the_config_log_nothing() -> None:
    with capture_logs() as logs:
        ours = own_targets([_claim(1, "orders")], lambda c: True, adapter="orders", target=str)
    assert len(ours) == 1
    assert logs == []


def test_the_error_line_is_bounded_whatever_the_rows_hold() -> None:
    """A row's target may be anything a login wrote: the line names a few,
    each cut short, and counts them all."""
    claims = [_claim(i, f"{i:03d}" + "x" * 10_000) for i in range(100)]
    with capture_logs() as logs:
        assert own_targets(claims, lambda c: False, adapter="orders", target=lambda c: f"{c.key}") == []
    (line,) = logs
    assert line["refused"] == 100
    assert len(line["inbox_ids"]) == 100
    assert len(line["targets"]) == REFUSED_TARGETS_NAMED
    assert all(len(t) == REFUSED_TARGET_CHARS for t in line["targets"])
