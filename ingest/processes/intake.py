"""What a message goes through on its way in, pull or push: one delivery
normalized into an inbox record (:func:`to_record`), its trace context
kept (:func:`trace_context_of`), and the adapters registered in the
``adapters`` table (:func:`register_adapters`). The pull loop
(``poll``/``ingester``) and the webhook receiver (``receiver``) both stand
on it, beside each other: neither imports the other."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, Protocol

import structlog
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine

from backhalf import db_errors, metrics, tracing
from backhalf.db import within_deadline
from backhalf.errors import DeadlineExceeded, PoisonMessage
from backhalf.records import Family, InboxRecord
from backhalf.writes import registry, stream_groups
from backhalf.writes.body_schema import BodySchema
from backhalf.writes.normalize import BodyFormat, RawForm, content_payload, raw_form, refusal
from ingest.adapters.base import Delivery, TraceCarrier
from ingest.config import Settings
from ingest.lifecycle import Retry

log = structlog.get_logger(__name__)

LOST_REASON = "lost_before_ingest"
LOST_BEFORE_INGEST = f"{LOST_REASON}: the entry was deleted or trimmed while still pending"


class Normalizing(Protocol):
    """What normalizing a body needs of its adapter's config (a pull
    adapter's, or a webhook's)."""

    @property
    def max_message_bytes(self) -> int: ...
    @property
    def format(self) -> BodyFormat: ...
    @property
    def body_schema(self) -> BodySchema | None: ...

    @property
    def name(self) -> str: ...


def to_record(delivery: Delivery, config: Normalizing) -> InboxRecord:
    """Normalize one delivery; a poison message becomes a rejected record."""
    limit = config.max_message_bytes
    error: str | None = None
    payload: str | None = None
    if delivery.lost:
        raw, error = RawForm(b""), LOST_BEFORE_INGEST
    elif delivery.body is None:  # an adapter's bug, kept as this message's own failure
        raw, error = RawForm(b""), "normalize_failed: the adapter delivered no content"
    else:
        raw = raw_form(delivery.body, limit)
        error = refusal(delivery.body)  # a field map of too many fields, never decoded
    if error is None and raw.truncated:
        # Stored as a prefix, with the full size and digest beside it.
        error = f"too_large: {raw.size} bytes exceeds max_message_bytes={limit}"
    if error is None and delivery.body is not None:
        try:
            payload = content_payload(delivery.body, config.format, limit, config.body_schema)
        except PoisonMessage as exc:
            error = str(exc)
        except Exception as exc:  # noqa: BLE001 - one message's failure is its own, never its batch's
            # Whatever fails normalizing this message would fail it on every
            # delivery: a rejection, stored and acked like any poison, rather
            # than a crash of the batch that no max_deliveries would end.
            error = f"normalize_failed: {type(exc).__name__}: {str(exc)[:300]}"
    return InboxRecord(
        idempotency_key=delivery.idempotency_key,
        source_message_id=delivery.message_id,
        body=raw.body,
        payload=payload,
        error=error,
        ack_ref=delivery.ack_ref,
        ack_key=delivery.ack_key,
        ack_copies=delivery.ack_copies,
        deliveries=delivery.deliveries,
        body_size=raw.size,
        body_sha256=raw.sha256,
        attributes=delivery.attributes,
        trace_context=_kept_context(delivery, config),
    )


def _kept_context(delivery: Delivery, config: Normalizing) -> str | None:
    """Read only while tracing is on: otherwise no todo keeps one."""
    return None if delivery.trace is None or not tracing.on() else trace_context_of(delivery.trace, config)


def trace_context_of(trace: TraceCarrier, config: Normalizing) -> str | None:
    """The context a message's todo keeps (a webhook's: its sender's); a
    malformed one is ignored and counted, never the message's error
    (DESIGN.md section 14)."""
    try:
        return tracing.carried(*trace)
    except ValueError as exc:
        if metrics.on():
            metrics.TRACE_CONTEXTS_MALFORMED.labels(config.name).inc()
        if config.name not in _MALFORMED_SEEN:
            _MALFORMED_SEEN.add(config.name)
            log.warning("trace_context_malformed", adapter=config.name, error=str(exc),
                        detail="ignored: the message is stored without it (counted in"
                        " switchboard_trace_contexts_malformed_total; logged once per adapter)")  # fmt: skip
        return None


# Adapters whose malformed trace context was logged (once each, per process).
_MALFORMED_SEEN: set[str] = set()


class Registration(NamedTuple):
    """One adapter's row in the adapters table."""

    name: str
    family: Family
    transport: str
    mode: str
    settings: Mapping[str, Any]


async def register_adapters(
    engine: AsyncEngine,
    settings: Settings,
    stop: asyncio.Event,
    registrations: Sequence[Registration],
) -> bool:
    """Upsert every adapter of ``registrations``, retrying while the database is away.
    Return False if stop was requested first. A permanent error (the schema
    missing, the login refused, no such database) raises DatabaseUnusable:
    waiting would not fix it."""
    rows = registrations
    retry = Retry.from_settings(settings.ingest, log)
    while not stop.is_set():
        try:
            deadline_ms = settings.database.transaction_deadline_ms
            async with within_deadline(engine.begin(), deadline_ms, "registering adapters") as conn:
                for r in rows:
                    await registry.register(
                        conn,
                        name=r.name,
                        family=r.family,
                        transport=r.transport,
                        mode=r.mode,
                        settings=r.settings,
                    )
                # The stream adapters record their groups' starts there: a
                # database not migrated to this version stops us here (exit 3,
                # "run switchboard migrate"), not in every poll loop's retries.
                await stream_groups.present(conn)
        except (SQLAlchemyError, DeadlineExceeded) as exc:
            db_errors.raise_if_permanent(exc)
            await retry.back_off(stop, "register_failed", exc)
        else:
            log.info("adapters_registered", adapters=[r.name for r in rows])
            return True
    return False
