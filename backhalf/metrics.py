"""The Prometheus metrics of every Switchboard process, defined once.

Names follow Prometheus conventions: a ``switchboard_`` prefix, ``_total``
on counters, base units in the name (``_seconds``). Labels are bounded sets:
adapter and queue names come from the config, ``reason`` and ``error`` from
:func:`reason_of` and :func:`error_class`, never from message content.

Each process exports what it does: ``ingest`` the consume/store counters and
the broker's backlog, ``ack`` the acks, the rescuer and the database's
backlog (pending acks, active todos), ``worker`` the todos claimed and finished. The
objects live in prometheus_client's default registry. A process whose
``[metrics] port`` is 0 counts nothing on its hot paths (:func:`switch_on`
is never called; each such call site asks :func:`on` first, one global read
per batch), so "metrics off" in ``make bench`` is the code path without
them. Errors are counted either way: they are rare, and exported by none.

The dramatiq worker processes run in prometheus_client's multiprocess mode
(``PROMETHEUS_MULTIPROC_DIR``, set by ``switchboard worker`` before dramatiq
starts them): the values live in files one exporter process sums.
"""

from __future__ import annotations

import re
from collections import Counter as Tally

from prometheus_client import Counter, Gauge, Histogram

from backhalf.records import StoreResult

# A batch's store and an ack drain take milliseconds to seconds.
_LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_BATCH_BUCKETS = (1, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10_000)
# A handler's run: milliseconds to minutes.
_RUN_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)

# ingest
CONSUMED = Counter("switchboard_messages_consumed_total", "Messages read from the broker.", ["adapter"])
STORED = Counter(
    "switchboard_messages_stored_total",
    "Messages stored for the first time (new inbox rows, rejected ones included).",
    ["adapter"],
)
DEDUPLICATED = Counter(
    "switchboard_messages_deduplicated_total",
    "Deliveries that created nothing new: layer=inbox (the message was stored before),"
    " layer=todo (an active todo with its key already existed).",
    ["adapter", "layer"],
)
REJECTED = Counter(
    "switchboard_messages_rejected_total", "Poison messages stored as rejected.", ["adapter", "reason"]
)
LOST = Counter(
    "switchboard_messages_lost_before_ingest_total",
    "Stream entries deleted or trimmed while pending, recorded as lost.",
    ["adapter"],
)
TODOS_CREATED = Counter("switchboard_todos_created_total", "Todos created by the store.", ["adapter"])
# Traces (backhalf.tracing): a message's traceparent that was no W3C trace
# context, ignored. Counted only while tracing is on (it is not read otherwise).
TRACE_CONTEXTS_MALFORMED = Counter(
    "switchboard_trace_contexts_malformed_total",
    "Messages whose traceparent was malformed: ignored, the message stored without it (tracing on only).",
    ["adapter"],
)
# The push family (switchboard receive). Unknown adapters count as "-": a
# path's text never becomes a label.
WEBHOOK_RESPONSES = Counter(
    "switchboard_webhook_responses_total",
    "Webhook deliveries answered, by HTTP status (200: stored, a duplicate, or stored as rejected).",
    ["adapter", "status"],
)
WEBHOOK_REFUSED = Counter(
    "switchboard_webhook_refused_total",
    "Webhook deliveries refused before anything was stored, by reason (bad_signature, stale_timestamp,"
    " too_large, ...).",
    ["adapter", "reason"],
)
STORE_SECONDS = Histogram(
    "switchboard_store_duration_seconds",
    "One batch's store, from its first statement to its commit.",
    ["adapter"],
    buckets=_LATENCY_BUCKETS_S,
)
STORE_BATCH = Histogram(
    "switchboard_store_batch_size", "Messages per stored batch.", ["adapter"], buckets=_BATCH_BUCKETS
)
ADAPTER_ENABLED = Gauge("switchboard_adapter_enabled", "1 if the adapter's runtime flag is on.", ["adapter"])
# The source's neutral figures (ingest.config.transport.Figure), each
# transport's own mapped onto them by its definition; the names are the
# operators' (dashboards, alerts) and stay as they were first published.
SOURCE_HELD = Gauge(
    "switchboard_broker_stream_length", "Messages the source holds, delivered or not.", ["adapter"]
)
SOURCE_BACKLOG = Gauge(
    "switchboard_broker_stream_lag", "Messages at the source not yet delivered to a consumer.", ["adapter"]
)
SOURCE_IN_FLIGHT = Gauge(
    "switchboard_broker_pending_entries", "Messages delivered and not yet acknowledged.", ["adapter"]
)
# A consumer delivers nothing more once its unacked deliveries
# (switchboard_broker_pending_entries) reach this: alert on the ratio.
IN_FLIGHT_LIMIT = Gauge(
    "switchboard_broker_ack_pending_limit",
    "The consumer's limit of unacknowledged deliveries: at this many the broker stops delivering.",
    ["adapter"],
)
LIST_BACKLOG = Gauge("switchboard_broker_list_length", "Items waiting on the source list.", ["adapter"])
# Messages the broker moved to the source's dead-letter queue: never stored
# by Switchboard. Alert on > 0.
DEAD_LETTERED = Gauge(
    "switchboard_broker_dead_letter_messages",
    "Messages in the source's dead-letter queue: never stored, or not acknowledged in time.",
    ["adapter"],
)
PROCESSING = Gauge(
    "switchboard_broker_processing_length",
    "Items on the adapter's processing lists (consumed, not yet removed).",
    ["adapter"],
)

# ack (and its rescuer)
ACKED = Counter("switchboard_acks_total", "Broker acks sent for committed intents.", ["adapter"])
ACK_SECONDS = Histogram(
    "switchboard_ack_duration_seconds",
    "One ack drain: claim, broker ack, commit.",
    ["adapter"],
    buckets=_LATENCY_BUCKETS_S,
)
ACK_BATCH = Histogram(
    "switchboard_ack_batch_size", "Intents acked per drain.", ["adapter"], buckets=_BATCH_BUCKETS
)
RESCUED = Counter(
    "switchboard_todos_rescued_total",
    "Claims whose lease lapsed, moved by the rescuer: to_status=pending (again) or failed (no attempt left).",
    ["queue", "to_status"],
)
PENDING_ACKS = Gauge("switchboard_pending_acks", "Committed ack intents not yet acked.", ["adapter"])
OLDEST_UNACKED = Gauge(
    "switchboard_oldest_unacked_age_seconds", "Age of the oldest pending ack intent (0: none).", ["adapter"]
)
TODOS = Gauge(
    "switchboard_todos", "Todos in an active status (pending, dispatched, running).", ["queue", "status"]
)

# worker
FINISHED = Counter(
    "switchboard_todos_finished_total",
    "Todos that reached a terminal status: done or failed by a worker, failed by the rescuer"
    " (exported by the process that ended them; operators' cancels are in todo_events only).",
    ["queue", "status"],
)
CLAIMED = Counter(
    "switchboard_todos_claimed_total", "Todos a worker claimed (each claim counts an attempt).", ["queue"]
)
ATTEMPTS_FAILED = Counter(
    "switchboard_todo_attempts_failed_total", "Handler runs that raised (retried or final).", ["queue"]
)
RUN_SECONDS = Histogram(
    "switchboard_todo_run_duration_seconds", "A handler's run.", ["queue"], buckets=_RUN_BUCKETS_S
)

# every process
ERRORS = Counter(
    "switchboard_errors_total",
    "Broker and database errors, by where (broker or database) and the error's class.",
    ["process", "kind", "error"],
)

_REASON = re.compile(r"[a-z][a-z_]{0,39}")
_switched_on = False


def switch_on() -> None:
    """Count from now on: called once at start by a process that exports."""
    global _switched_on
    _switched_on = True


def on() -> bool:
    return _switched_on


def reason_of(error: str) -> str:
    """A rejection's reason: the stable token its error text starts with
    (``too_large: ...``, ``invalid_json: ...``), else ``other``."""
    head = error.partition(":")[0]
    return head if _REASON.fullmatch(head) else "other"


def error_class(exc: BaseException) -> str:
    """The class of the error that caused ``exc`` (the driver's or the
    broker's, under Switchboard's wrapping), a bounded label."""
    cause: BaseException = exc
    while cause.__cause__ is not None:
        cause = cause.__cause__
    return type(cause).__name__


def count_store(adapter: str, result: StoreResult, store_s: float, lost_reason: str) -> None:
    """One committed store transaction's metrics: a handful of additions per
    transaction, none per message. ``lost_reason``: the rejection reason
    that also counts in ``LOST``."""
    if not on():
        return
    STORED.labels(adapter).inc(result.new)
    TODOS_CREATED.labels(adapter).inc(result.todos_created)
    if result.redelivered:
        DEDUPLICATED.labels(adapter, "inbox").inc(result.redelivered)
    if result.todos_deduped:
        DEDUPLICATED.labels(adapter, "todo").inc(result.todos_deduped)
    STORE_SECONDS.labels(adapter).observe(store_s)
    for reason, n in Tally(reason_of(e) for e in result.rejected_errors).items():
        REJECTED.labels(adapter, reason).inc(n)
        if reason == lost_reason:
            LOST.labels(adapter).inc(n)
