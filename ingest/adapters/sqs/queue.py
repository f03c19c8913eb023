"""SQS: a queue read with concurrent receives, its messages deleted by the acker.

Broker side (DESIGN.md section 6b)::

    {source}      the queue, standard or FIFO, by name or URL (created by its
                  owner, never by us), with its redrive policy if it has one

Reading: ``ReceiveMessage`` calls of up to 10 messages each. One long poll
(``block_ms``, whole seconds up to 20) waits for the first messages; when it
comes back full, the rest of ``batch_size`` is asked at once by concurrent
receives that do not wait (a busy queue fills the batch in one more round
trip; an idle one adds no latency). Each receive sets the visibility timeout
to ``ack_wait_ms``, and while a batch is held unstored (being stored, or
kept to be stored again after a failed commit) its visibility is extended
every third of it, so a slow commit is not redelivered to another consumer
meanwhile. A batch the process gives up at its stop is made visible again at
once (``ChangeMessageVisibility`` 0) instead of waiting out the timeout.

Each message's receipt handle is its ack intent, stored as given; the acker
deletes with it (``DeleteMessageBatch``). A message received again (its
visibility timed out before the delete) has a new handle, and its inbox row
takes it: AWS documents that a delete with an older handle may succeed
without deleting. The ingester never deletes (its IAM policy may deny it:
``ops/iam/sqs-ingester-policy.json``).

Redelivery is the queue's: a message not deleted within the visibility
timeout comes again, its ``ApproximateReceiveCount`` its delivery count, and
dedups to its inbox row. With a redrive policy, SQS moves a message to the
dead-letter queue at its ``maxReceiveCount``-th receive: the adapter
refuses to read a queue whose ``maxReceiveCount`` does not exceed
``max_deliveries``, so a poison message is stored as rejected (and deleted)
before SQS would move it away unseen.

FIFO queues keep their order per message group: SQS hands out none of a
group's messages while earlier ones are in flight, every receive's messages
are kept in their order, and a batch is stored in that order.

Idempotency key ``{key_prefix}:{queue name}:{MessageId}``; a MessageId is
never reused, so there is no reused-id case.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Mapping, Sequence
from contextlib import AsyncExitStack
from typing import Any

import structlog

from backhalf.records import AckClaim, AckTarget
from backhalf.tracing import TRACEPARENT, TRACESTATE
from backhalf.writes.keys import key_id, native_key, storable_id
from ingest.adapters.base import (
    ConsumerLedger,
    Delivery,
    PullAdapterBase,
    Replayed,
    TraceCarrier,
    own_targets,
    trace_of,
)
from ingest.adapters.sqs.common import (
    MAX_CONCURRENT_CALLS,
    MAX_PER_CALL,
    MAX_WAIT_S,
    REQUEST_TIMEOUT_S,
    Client,
    caller_arn,
    describe_error,
    endpoint_label,
    is_missing_queue,
    open_client,
    queue_url,
    sqs_errors,
)
from ingest.adapters.sqs.settings import options
from ingest.adapters.sqs.settings import queue_name as sqs_queue_name
from ingest.config import AdapterConfig
from ingest.errors import AckError, BrokerError

# This mode's ack kind, registered in ingest.adapters.sqs.MODES.
ACK_KIND = "sqsdel"
# A delete's refusal that names the handle, not the call; and the queue gone.
INVALID_HANDLE = "ReceiptHandleIsInvalid"
MISSING_QUEUE = "QueueDoesNotExist"
# Visibility timeouts a handle may stay refused as invalid before its delete
# is given up (SqsDeleter._still_owed).
GIVE_UP_AFTER_TIMEOUTS = 3
# A FIFO message's place, kept on its inbox row for audit (source_attributes).
_AUDITED = ("MessageGroupId", "SequenceNumber")
# The figures status and the gauges read, by queue attribute.
_COUNTS = {
    "visible": "ApproximateNumberOfMessages",
    "in_flight": "ApproximateNumberOfMessagesNotVisible",
    "delayed": "ApproximateNumberOfMessagesDelayed",
}

log = structlog.get_logger(__name__)


def visibility_s(config: AdapterConfig) -> int:
    """The visibility timeout each receive sets: ``ack_wait_ms`` in whole seconds."""
    return max(1, math.ceil(options(config).ack_wait_ms / 1000))


def _chunks(items: Sequence[Any], size: int = MAX_PER_CALL) -> list[Sequence[Any]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


async def _bounded(calls: Sequence[Any], *, return_exceptions: bool = False) -> list[Any]:
    """The awaitables in ``calls``, at most MAX_CONCURRENT_CALLS at once, in order."""
    results: list[Any] = []
    for start in range(0, len(calls), MAX_CONCURRENT_CALLS):
        chunk = calls[start : start + MAX_CONCURRENT_CALLS]
        results += await asyncio.gather(*chunk, return_exceptions=return_exceptions)
    return results


class SqsQueueAdapter(PullAdapterBase):
    """A :class:`ingest.adapters.base.PullAdapter` over one SQS queue."""

    # Redelivery rests on the queue's own record (the visibility timeout).
    overlapping_commits = True

    def __init__(self, config: AdapterConfig, *, ledger: ConsumerLedger | None = None) -> None:
        # ``ledger`` is unused: the queue itself is the consumer's position.
        self.name = config.name
        self._cfg = config
        self._queue = sqs_queue_name(config.source)
        self.ordered = self._queue.endswith(".fifo")
        self._visibility_s = visibility_s(config)
        # At least a second: an SQS receive that waits 0 returns at once, and
        # an idle queue would be polled without a pause. A long poll returns
        # as soon as a message arrives, so it adds no latency.
        self._wait_s = min(MAX_WAIT_S, max(1, round(config.block_ms / 1000)))
        self._stack: AsyncExitStack | None = None
        self._client: Client | None = None
        self._url: str | None = None
        self.identity = "aws arn: (not connected)"
        self.broker = endpoint_label(self._cfg)  # for log fields: never a credential
        self._connecting = asyncio.Lock()
        # Batches returned and not yet confirmed (their handles are extended
        # and, at the stop, released), and those given back by a rewind, to
        # read again from memory: received again, each would count a
        # delivery towards max_deliveries and the redrive's maxReceiveCount.
        self._batches = Replayed()
        # Receives a stop cancelled, and what such a read had received: their
        # messages are released at close().
        self._orphan_calls: set[asyncio.Task[list[dict[str, Any]]]] = set()
        self._orphans: list[dict[str, Any]] = []

    @property
    def ack_target(self) -> AckTarget:
        return AckTarget(ACK_KIND, self._queue, None, by_cursor=True)

    async def start(self) -> None:
        await self._connection()

    async def _connection(self) -> tuple[Client, str]:
        # The poll loop's read, the extension and the gauges' describe all come here: one connects.
        async with self._connecting:
            if self._client is None or self._url is None:
                stack = AsyncExitStack()
                try:
                    calls = math.ceil(self._cfg.batch_size / MAX_PER_CALL)
                    client = await open_client(
                        self._cfg, stack, calls=min(calls, MAX_CONCURRENT_CALLS) + 1, wait_s=self._wait_s
                    )
                    url = await queue_url(client, self._cfg)
                    await self._check_redrive(client, url)
                    self.identity = f"aws arn: {await caller_arn(self._cfg, stack)}"
                except BaseException:
                    await stack.aclose()
                    raise
                self._stack, self._client, self._url = stack, client, url
            return self._client, self._url

    async def _check_redrive(self, client: Client, url: str) -> None:
        """Refuse a queue that would move a message to its dead-letter queue
        before Switchboard stored or rejected it: ``maxReceiveCount`` must
        exceed ``max_deliveries`` (a message is rejected as poison at its
        ``max_deliveries``-th delivery, and a crash then leaves it one more)."""
        policy = (await self._attributes(client, url, ["RedrivePolicy"])).get("RedrivePolicy")
        if not policy:
            return
        limit = int(_redrive(policy).get("maxReceiveCount", 0))
        if limit <= self._cfg.max_deliveries:
            raise BrokerError(
                f"adapter {self.name}: SQS moves a message of queue {self._queue} to its dead-letter queue"
                f" at its receive {limit} (the redrive policy's maxReceiveCount), before Switchboard's"
                f" max_deliveries ({self._cfg.max_deliveries}) stores it as rejected: raise maxReceiveCount"
                f" to at least {self._cfg.max_deliveries + 5}, or lower max_deliveries; nothing is read"
                " until then (retrying)"
            )

    async def _attributes(self, client: Client, url: str, names: list[str]) -> dict[str, str]:
        with sqs_errors(self.name, f"reading the attributes of queue {self._queue}"):
            reply = await client.get_queue_attributes(QueueUrl=url, AttributeNames=names)
        return dict(reply.get("Attributes", {}))

    async def run_background(self, stop: asyncio.Event) -> None:
        """Extend the visibility of every message held unstored, every third
        of the visibility timeout, until ``stop``."""
        interval_s = self._visibility_s / 3
        while not stop.is_set():
            try:
                async with asyncio.timeout(interval_s):
                    await stop.wait()
            except TimeoutError:
                await self._extend()

    async def _extend(self) -> None:
        held = self._batches.held()
        if not held:
            return
        try:
            # Connects again if a failed read dropped the connection: a batch
            # replayed from memory is being stored again meanwhile.
            client, url = await self._connection()
            await self._change_visibility(client, url, held, self._visibility_s)
        except BrokerError as exc:
            # Not fatal: a message whose visibility lapses is received again
            # and dedups to its inbox row once stored.
            log.warning("visibility_extension_failed", adapter=self.name, held=len(held), error=str(exc))

    async def _change_visibility(
        self, client: Client, url: str, held: Sequence[Delivery], seconds: int
    ) -> None:
        """ChangeMessageVisibilityBatch for ``held``; entries the queue refused
        (a handle already expired) are logged, not raised."""
        refused: dict[str, int] = {}

        async def change(chunk: Sequence[Delivery]) -> None:
            entries = [
                {"Id": str(i), "ReceiptHandle": d.ack_ref, "VisibilityTimeout": seconds}
                for i, d in enumerate(chunk)
            ]
            with sqs_errors(self.name, f"changing the visibility of {len(chunk)} messages to {seconds} s"):
                reply = await client.change_message_visibility_batch(QueueUrl=url, Entries=entries)
            for failed in reply.get("Failed", []):
                code = str(failed.get("Code", "error"))
                refused[code] = refused.get(code, 0) + 1

        await _bounded([change(chunk) for chunk in _chunks(held)])
        if refused:
            log.info("visibility_not_changed", adapter=self.name, seconds=seconds, refused=refused)

    async def read(self, max_count: int) -> list[Delivery]:
        if again := self._batches.take(max_count):
            return again
        messages: list[dict[str, Any]] = []
        try:
            client, url = await self._connection()
            messages += await self._receive(client, url, min(MAX_PER_CALL, max_count), self._wait_s)
            if len(messages) == MAX_PER_CALL and max_count > MAX_PER_CALL:
                messages += await self._fill(client, url, max_count - MAX_PER_CALL)
        except asyncio.CancelledError:
            # A stop while the batch was being filled: what came is released at close().
            self._orphans += messages
            raise
        except BrokerError:
            await self._forget_connection()
            raise
        batch = [self._delivery(m) for m in messages]
        self._batches.returned(batch)
        return batch

    async def _fill(self, client: Client, url: str, count: int) -> list[dict[str, Any]]:
        """A busy queue: the rest of the batch at once, by receives that do
        not wait. What came is kept even if one of them failed (a message
        received and dropped would stay invisible for the visibility
        timeout); the failure is raised only when nothing came."""
        calls = [self._receive(client, url, len(chunk), 0) for chunk in _chunks(range(count))]
        results = await _bounded(calls, return_exceptions=True)
        got = [m for r in results if isinstance(r, list) for m in r]
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed and not got:
            raise failed[0]
        if failed:
            log.warning(
                "receives_failed", adapter=self.name, failed=len(failed), kept=len(got), error=str(failed[0])
            )
        return got

    async def _receive(self, client: Client, url: str, count: int, wait_s: int) -> list[dict[str, Any]]:
        """One receive, shielded from a stop's cancellation: cancelled, the
        request would still be answered, its messages made invisible for
        the visibility timeout with nobody to store them. Its answer is
        waited for at close() instead, and released."""
        call = asyncio.create_task(self._receive_call(client, url, count, wait_s))
        try:
            return await asyncio.shield(call)
        except asyncio.CancelledError:
            self._orphan_calls.add(call)
            raise

    async def _receive_call(self, client: Client, url: str, count: int, wait_s: int) -> list[dict[str, Any]]:
        with sqs_errors(self.name, f"receiving from queue {self._queue}"):
            try:
                reply = await client.receive_message(
                    QueueUrl=url,
                    MaxNumberOfMessages=count,
                    WaitTimeSeconds=wait_s,
                    VisibilityTimeout=self._visibility_s,
                    MessageSystemAttributeNames=["ApproximateReceiveCount", *_AUDITED],
                    # The producer's trace context (DESIGN.md section 14).
                    MessageAttributeNames=[TRACEPARENT, TRACESTATE],
                )
            except Exception as exc:
                if is_missing_queue(exc):
                    raise BrokerError(
                        f"adapter {self.name}: the SQS queue {self._queue!r} is gone from {self.broker}:"
                        " create it again (Switchboard never creates queues); retrying"
                    ) from exc
                raise
        return list(reply.get("Messages", []))

    def _delivery(self, message: Mapping[str, Any]) -> Delivery:
        # AWS's own id (a UUID), but an SQS-compatible server's is whatever it
        # says: taken into the key as any id from outside is (keys.key_id).
        raw_id = str(message["MessageId"])
        message_id = storable_id(raw_id)
        attributes = message.get("Attributes", {})
        key = native_key(self._cfg.key_prefix, self._queue, key_id(raw_id))
        # A FIFO queue's group id is the producer's too: made storable (jsonb
        # holds no NUL), or its row could never be written, not even rejected.
        audited = {name: storable_id(str(attributes[name])) for name in _AUDITED if name in attributes}
        return Delivery(
            key,
            message_id,
            # A lone surrogate (a server's "\ud800") kept as the bytes it
            # stood for: the body then fails its format and is rejected, as
            # any body that is not UTF-8, instead of failing the read.
            body=str(message.get("Body", "")).encode("utf-8", "surrogatepass"),
            ack_ref=str(message["ReceiptHandle"]),
            deliveries=int(attributes.get("ApproximateReceiveCount", 1)),
            attributes=json.dumps(audited) if audited else None,
            trace=_trace(message.get("MessageAttributes")),
        )

    def stored(self) -> None:
        self._batches.stored()

    def rewind(self) -> None:
        self._batches.rewind()

    async def describe(self) -> Mapping[str, object]:
        client, url = await self._connection()
        names = [*_COUNTS.values(), "RedrivePolicy", "FifoQueue", "VisibilityTimeout"]
        attributes = await self._attributes(client, url, names)
        figures: dict[str, object] = {
            figure: int(attributes.get(name, 0)) for figure, name in _COUNTS.items()
        }
        figures["fifo"] = attributes.get("FifoQueue") == "true"
        policy = attributes.get("RedrivePolicy")
        if policy:
            redrive = _redrive(policy)
            figures["max_receive_count"] = int(redrive.get("maxReceiveCount", 0))
            figures["dead_letter_messages"] = await self._dead_letter_depth(
                client, str(redrive.get("deadLetterTargetArn", ""))
            )
        return figures

    async def _dead_letter_depth(self, client: Client, arn: str) -> int | None:
        """The dead-letter queue's visible messages: those Switchboard never
        stored (None where it cannot be read)."""
        parts = arn.split(":")  # arn:aws:sqs:REGION:ACCOUNT:NAME
        if len(parts) != 6:
            return None
        account, name = parts[4], parts[5]
        try:
            with sqs_errors(self.name, f"reading the dead-letter queue {name}"):
                reply = await client.get_queue_url(QueueName=name, QueueOwnerAWSAccountId=account)
                attributes = await self._attributes(client, reply["QueueUrl"], [_COUNTS["visible"]])
        except BrokerError as exc:
            log.info("dead_letter_queue_unreadable", adapter=self.name, error=str(exc))
            return None
        return int(attributes.get(_COUNTS["visible"], 0))

    async def _orphaned(self) -> list[dict[str, Any]]:
        """The messages of the receives a stop cancelled, once they are
        answered (each within its long poll and the request timeout)."""
        calls, self._orphan_calls = self._orphan_calls, set()
        orphans, self._orphans = self._orphans, []
        if calls:
            done, pending = await asyncio.wait(calls, timeout=self._wait_s + REQUEST_TIMEOUT_S)
            for call in pending:
                call.cancel()
            for call in done:
                if not call.cancelled() and call.exception() is None:
                    orphans += call.result()
        return orphans

    async def _forget_connection(self) -> None:
        """After a failure, the next read connects afresh (and looks the queue up again)."""
        stack, self._stack, self._client, self._url = self._stack, None, None, None
        if stack is not None:
            await stack.aclose()

    async def close(self) -> None:
        """Release what is held unstored at once (visibility 0), so another
        consumer need not wait out the visibility timeout, and what the
        receives a stop cancelled brought; then disconnect."""
        held = self._batches.held() + [self._delivery(m) for m in await self._orphaned()]
        if held and self._client is not None and self._url is not None:
            try:
                await self._change_visibility(self._client, self._url, held, 0)
                log.info("messages_released", adapter=self.name, messages=len(held))
            except BrokerError as exc:
                log.warning("messages_not_released", adapter=self.name, messages=len(held), error=str(exc))
        self._batches.clear()
        await self._forget_connection()


def _redrive(policy: str) -> dict[str, Any]:
    """A queue's RedrivePolicy attribute (JSON), {} where it is unreadable."""
    try:
        value = json.loads(policy)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _sqsdel_target(claim: AckClaim) -> str:
    """An intent's target for the log: the queue it names (not its receipt
    handle, an opaque token as long as a message)."""
    return f"{claim.kind} {claim.key}"


class SqsDeleter:
    """``DeleteMessageBatch`` with each committed intent's receipt handle,
    10 a call; an entry the queue refused is left owed, never counted done.
    Only intents that name the adapter's own queue (by name, as the adapter
    stores them) are deleted (``own_targets``)."""

    def __init__(self, config: AdapterConfig) -> None:
        self._cfg = config
        self._name = config.name
        self._queue = sqs_queue_name(config.source)
        self._stack: AsyncExitStack | None = None
        self._client: Client | None = None
        self._url: str | None = None
        # When the queue first refused each (inbox row, handle) as invalid.
        self._invalid_since: dict[tuple[int, str], float] = {}
        self._give_up_after_s = GIVE_UP_AFTER_TIMEOUTS * visibility_s(config)

    async def _connection(self) -> tuple[Client, str]:
        if self._client is None or self._url is None:
            stack = AsyncExitStack()
            try:
                client = await open_client(self._cfg, stack, calls=MAX_CONCURRENT_CALLS)
                url = await queue_url(client, self._cfg)
            except BrokerError as exc:  # an acknowledger raises AckError (its protocol)
                await stack.aclose()
                raise AckError(str(exc)) from exc
            self._stack, self._client, self._url = stack, client, url
        return self._client, self._url

    def _ours(self, claim: AckClaim) -> bool:
        return claim.kind == ACK_KIND and claim.key == self._queue and bool(claim.ref)

    async def ack(self, claims: Sequence[AckClaim]) -> list[AckClaim]:
        # Deletes go to this adapter's queue URL whatever a row says; an
        # intent naming another queue is not this adapter's to delete.
        ours = own_targets(claims, self._ours, adapter=self._name, target=_sqsdel_target)
        if not ours:
            return []
        # One delete per inbox row (a row may be claimed twice in a drain:
        # by the cursor, and from the ack queue).
        unique = list({c.inbox_id: c for c in ours}.values())
        client, url = await self._connection()
        outcomes = await _bounded(
            [self._delete(client, url, chunk) for chunk in _chunks(unique)], return_exceptions=True
        )
        # A call that failed whole (the queue unreachable, the key refused):
        # the broker did not answer, which the protocol says by raising
        # (backed off, and judged by the process's health), once every call
        # has ended. The chunks deleted meanwhile are deleted again later.
        failed = [o for o in outcomes if isinstance(o, BaseException)]
        if failed:
            raise failed[0]
        left_ids = {c.inbox_id for chunk_left in outcomes for c in chunk_left}
        return [c for c in ours if c.inbox_id in left_ids]

    async def _delete(self, client: Client, url: str, chunk: Sequence[AckClaim]) -> list[AckClaim]:
        """One DeleteMessageBatch; the claims the queue refused one by one.
        A call that failed whole raises its AckError."""
        entries = [{"Id": str(i), "ReceiptHandle": c.ref} for i, c in enumerate(chunk)]
        try:
            with sqs_errors(
                self._name, f"DeleteMessageBatch x{len(chunk)} on queue {self._queue}", error=AckError
            ):
                reply = await client.delete_message_batch(QueueUrl=url, Entries=entries)
        except AckError as exc:
            if is_missing_queue(exc.__cause__ or exc):
                # The queue is gone, and its messages with it, or the answer
                # is wrong (AWS gives it for a queue this identity may not
                # see): owed, and given up only when it lasts (_still_owed).
                log.warning("delete_queue_missing", adapter=self._name, queue=self._queue, deletes=len(chunk))
                return self._still_owed([(c, MISSING_QUEUE) for c in chunk])
            await self._forget_connection()
            raise
        failed = reply.get("Failed", [])
        if not failed:
            return []
        codes: dict[str, int] = {}
        for f in failed:
            codes[str(f.get("Code", "error"))] = codes.get(str(f.get("Code", "error")), 0) + 1
        log.warning(
            "deletes_refused",
            adapter=self._name,
            queue=self._queue,
            refused=codes,
            first_inbox_id=chunk[int(failed[0]["Id"])].inbox_id,
            detail="left owed and retried; a message received again meanwhile brings a newer handle",
        )
        return self._still_owed([(chunk[int(f["Id"])], str(f.get("Code", ""))) for f in failed])

    def _still_owed(self, refused: Sequence[tuple[AckClaim, str]]) -> list[AckClaim]:
        """The refused claims to retry. One whose handle the queue has called
        invalid (or whose queue it has called missing) for
        GIVE_UP_AFTER_TIMEOUTS visibility timeouts is given up:
        were its message still queued, it would have been received again by
        now (its visibility long lapsed) and its row would carry a newer
        handle; it was deleted by someone else, moved, or expired. If it
        does come back later (no ingester ran meanwhile), the store asks
        for its ack again with the new handle: given up is never lost."""
        now = time.monotonic()
        owed: list[AckClaim] = []
        given_up: list[AckClaim] = []
        for claim, code in refused:
            if code not in (INVALID_HANDLE, MISSING_QUEUE):
                owed.append(claim)
                continue
            since = self._invalid_since.setdefault((claim.inbox_id, claim.ref or ""), now)
            (given_up if now - since >= self._give_up_after_s else owed).append(claim)
        if given_up:
            for claim in given_up:
                self._invalid_since.pop((claim.inbox_id, claim.ref or ""), None)
            log.warning(
                "acks_given_up",
                adapter=self._name,
                queue=self._queue,
                acks=len(given_up),
                first_inbox_id=given_up[0].inbox_id,
                reason=f"receipt handles refused as invalid for {self._give_up_after_s} s: their messages are"
                " no longer in the queue (a redelivery would have brought newer handles)",
            )
        return owed

    async def acked(self, claims: Sequence[AckClaim]) -> None:
        """Nothing to clean up: a delete is final."""

    async def _forget_connection(self) -> None:
        stack, self._stack, self._client, self._url = self._stack, None, None, None
        if stack is not None:
            try:
                await stack.aclose()
            except Exception as exc:  # noqa: BLE001 - closing what already failed
                log.info("sqs_close_failed", adapter=self._name, error=describe_error(exc))

    async def close(self) -> None:
        await self._forget_connection()


def _trace(attributes: Mapping[str, Any] | None) -> TraceCarrier | None:
    """The trace context of a message's attributes (String ones, as a
    producer's SDK sends them)."""
    if not attributes:
        return None

    def value(name: str) -> Any:
        attribute = attributes.get(name)
        return attribute.get("StringValue") if isinstance(attribute, Mapping) else None

    return trace_of(value(TRACEPARENT), value(TRACESTATE))
