"""Where the suite's SQS comes from (DESIGN.md section 6b): the endpoint in
``SWITCHBOARD_TEST_SQS_ENDPOINT_URL``, else the emulator the suite starts
itself (moto with its fixes, ``ingest.embedded.sqs_server``). Tests that
stop or kill the emulator own one of their own (``owned_sqs``), whichever
source the shared one came from; a restart loses every queue (moto keeps
them in memory).

The rest is the tests' SQS client, blocking (boto3): queues made with their
dead-letter queue, messages sent in batches, and the queue's own figures,
the broker's record of what is visible, in flight and delayed. A client
always signs with the emulator's dummy credentials (``ACCESS_KEY_ID``), never
the caller's AWS ones; a Switchboard process or an in-process adapter finds
them in its environment (``client_env``, ``use_emulator_credentials``)."""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import boto3
import pytest
from botocore.config import Config

from ingest.embedded.servers import temp_base
from ingest.embedded.sqs_server import ACCESS_KEY_ID, SECRET_ACCESS_KEY, SqsServer, client_env
from ingest.embedded.sqs_server import REGION as REGION  # the tests' region, from here

URL_VARIABLE = "SWITCHBOARD_TEST_SQS_ENDPOINT_URL"
SEND_BATCH = 10  # SendMessageBatch's most entries
FIFO_SUFFIX = ".fifo"
# A receive may long-poll for up to 20 s: the read timeout lies above that.
_CLIENT_CONFIG = Config(
    connect_timeout=5, read_timeout=30, retries={"mode": "standard", "total_max_attempts": 3}
)


@contextlib.contextmanager
def shared_sqs() -> Iterator[str]:
    """The endpoint URL of the session's SQS."""
    endpoint = os.environ.get(URL_VARIABLE)
    if endpoint:
        yield endpoint
        return
    with owned_sqs() as server:
        yield server.url


@contextlib.contextmanager
def owned_sqs(module: str | None = None) -> Iterator[SqsServer]:
    """An emulator this caller owns, started; removed with its folder after.
    ``module``: the child's module in place of ours (``"moto.server"``: moto
    without the fixes)."""
    base = temp_base("switchboard-sqs-") / "sqs"
    server = SqsServer.create(base) if module is None else SqsServer.create(base, module=module)
    try:
        server.start()
        yield server
    finally:
        server.cleanup()
        with contextlib.suppress(OSError):
            server.base_dir.parent.joinpath("owner.pid").unlink()
            server.base_dir.parent.rmdir()


def use_emulator_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    """The emulator's dummy credentials and region in this process's
    environment for the test's length (an adapter reads AWS's usual chain)."""
    for name, value in client_env().items():
        monkeypatch.setenv(name, value)


def client(endpoint: str, *, region: str = REGION) -> Any:
    """A blocking SQS client (boto3's, untyped) for ``endpoint``."""
    session = boto3.session.Session(
        aws_access_key_id=ACCESS_KEY_ID, aws_secret_access_key=SECRET_ACCESS_KEY, region_name=region
    )
    return session.client("sqs", endpoint_url=endpoint, config=_CLIENT_CONFIG)


def _is_fifo(name_or_url: str) -> bool:
    return name_or_url.endswith(FIFO_SUFFIX)


def dlq_name(name: str) -> str:
    """``orders`` -> ``orders-dlq``; ``orders.fifo`` -> ``orders-dlq.fifo``."""
    if _is_fifo(name):
        return f"{name.removesuffix(FIFO_SUFFIX)}-dlq{FIFO_SUFFIX}"
    return f"{name}-dlq"


def _make_queue(sqs: Any, name: str, attributes: dict[str, str]) -> str:
    url: str = sqs.create_queue(QueueName=name, Attributes=attributes)["QueueUrl"]
    return url


def create_queue(
    sqs: Any,
    name: str,
    *,
    fifo: bool = False,
    visibility_timeout_s: int = 30,
    max_receive_count: int | None = None,
) -> str:
    """Create queue ``name`` (a FIFO one's name ends in ``.fifo``, as SQS
    requires) and return its URL. With ``max_receive_count``, ``dlq_name(name)``
    is created too and named in the queue's RedrivePolicy."""
    if fifo != _is_fifo(name):
        raise ValueError(f"queue {name!r}: a FIFO queue's name ends in {FIFO_SUFFIX}, another's does not")
    attributes = {"VisibilityTimeout": str(visibility_timeout_s)}
    if fifo:
        attributes["FifoQueue"] = "true"
    if max_receive_count is not None:
        dlq_url = _make_queue(sqs, dlq_name(name), {"FifoQueue": "true"} if fifo else {})
        dlq_arn = sqs.get_queue_attributes(QueueUrl=dlq_url, AttributeNames=["QueueArn"])["Attributes"][
            "QueueArn"
        ]
        policy = {"deadLetterTargetArn": dlq_arn, "maxReceiveCount": max_receive_count}
        attributes["RedrivePolicy"] = json.dumps(policy)
    return _make_queue(sqs, name, attributes)


def _entry(index: int, body: bytes | str, group: str | None, fifo: bool) -> dict[str, str]:
    entry = {"Id": str(index), "MessageBody": body.decode() if isinstance(body, bytes) else body}
    if group is not None:
        entry["MessageGroupId"] = group
    if fifo:
        # Unique per message: a body sent twice is two messages, as elsewhere in the suite.
        entry["MessageDeduplicationId"] = uuid.uuid4().hex
    return entry


def send(sqs: Any, url: str, bodies: Sequence[bytes | str], *, group: str | None = None) -> list[str]:
    """Send ``bodies`` in order, in batches of ten, every one accepted by SQS;
    their MessageIds in order. A FIFO queue's need ``group``."""
    fifo = _is_fifo(url)
    if fifo and group is None:
        raise ValueError(f"{url}: a FIFO queue's messages need a MessageGroupId (group=...)")
    ids: list[str] = []
    for start in range(0, len(bodies), SEND_BATCH):
        chunk = bodies[start : start + SEND_BATCH]
        entries = [_entry(i, body, group, fifo) for i, body in enumerate(chunk)]
        reply = sqs.send_message_batch(QueueUrl=url, Entries=entries)
        if reply.get("Failed"):
            raise AssertionError(f"SendMessageBatch to {url} refused entries: {reply['Failed']}")
        by_entry = {ok["Id"]: ok["MessageId"] for ok in reply["Successful"]}
        ids += [by_entry[str(i)] for i in range(len(chunk))]
    return ids


def receive(
    sqs: Any,
    url: str,
    max_messages: int = 10,
    *,
    wait_time_s: int = 0,
    visibility_timeout_s: int | None = None,
) -> list[dict[str, Any]]:
    """One ReceiveMessage: the messages (Body, MessageId, ReceiptHandle, and
    every system attribute), none deleted."""
    options: dict[str, Any] = {"MaxNumberOfMessages": max_messages, "WaitTimeSeconds": wait_time_s}
    if visibility_timeout_s is not None:
        options["VisibilityTimeout"] = visibility_timeout_s
    reply = sqs.receive_message(QueueUrl=url, MessageSystemAttributeNames=["All"], **options)
    messages: list[dict[str, Any]] = reply.get("Messages", [])
    return messages


def counts(sqs: Any, url: str) -> tuple[int, int, int]:
    """(visible, in flight, delayed): the queue's approximate figures."""
    names = ["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible",
             "ApproximateNumberOfMessagesDelayed"]  # fmt: skip
    attributes = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=names)["Attributes"]
    visible, in_flight, delayed = (int(attributes[name]) for name in names)
    return visible, in_flight, delayed
