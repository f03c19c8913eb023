"""The demo's source on this transport (``switchboard demo --transport sqs``;
the developer kit, ``embedded`` extra): a standard queue on an SQS
emulator of the demo's own (moto). Loaded by ``ingest.embedded.demo_sources``
by the transport's name, only for a demo on it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ingest.embedded.demo_sources import demo_adapter
from ingest.embedded.sqs_server import SqsServer, sqs_server

SQS_QUEUE = "orders"


class SqsSource:
    """A standard queue on the demo's own SQS emulator, through boto3's
    blocking client (moto's dependency, so the embedded kit has it). The
    demo's processes find the emulator's dummy credentials and region in
    their environment, as they would find AWS's."""

    transport = "sqs"
    source_word = "queue"
    ack_word = "DeleteMessageBatch"
    unacked_label = "left in the SQS queue"
    # The demo's ack_wait_ms, the queue's visibility timeout: what the killed
    # ingester held comes back this soon.
    ACK_WAIT_MS = 3000
    restart_note = f"what it held and never stored comes back after its visibility timeout ({ACK_WAIT_MS} ms)"
    SEND_BATCH = 10  # SendMessageBatch's most entries
    _COUNTS = ("ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible",
               "ApproximateNumberOfMessagesDelayed")  # fmt: skip

    def __init__(self, server: SqsServer) -> None:
        import boto3  # moto's dependency, which the embedded kit installs
        from botocore.config import Config

        from ingest.embedded.sqs_server import ACCESS_KEY_ID, SECRET_ACCESS_KEY

        self._endpoint, self._region = server.url, server.region
        self.process_env = server.client_env()
        session = boto3.session.Session(
            aws_access_key_id=ACCESS_KEY_ID,
            aws_secret_access_key=SECRET_ACCESS_KEY,
            region_name=server.region,
        )
        config = Config(
            connect_timeout=5, read_timeout=10, retries={"mode": "standard", "total_max_attempts": 3}
        )
        self._sqs = session.client("sqs", endpoint_url=server.url, config=config)
        attributes = {"VisibilityTimeout": str(self.ACK_WAIT_MS // 1000)}
        self._url: str = self._sqs.create_queue(QueueName=SQS_QUEUE, Attributes=attributes)["QueueUrl"]

    def adapter(self) -> dict[str, Any]:
        return demo_adapter(
            "sqs", "queue", SQS_QUEUE, self._endpoint, region=self._region, ack_wait_ms=self.ACK_WAIT_MS
        )

    def produce(self, bodies: list[bytes], traceparent: str | None = None) -> None:
        traced = {"traceparent": {"DataType": "String", "StringValue": traceparent}} if traceparent else {}
        for start in range(0, len(bodies), self.SEND_BATCH):
            chunk = bodies[start : start + self.SEND_BATCH]
            entries = [
                {"Id": str(i), "MessageBody": body.decode(), "MessageAttributes": traced}
                for i, body in enumerate(chunk)
            ]
            reply = self._sqs.send_message_batch(QueueUrl=self._url, Entries=entries)
            if reply.get("Failed"):
                raise RuntimeError(
                    f"SQS refused {len(reply['Failed'])} of the demo's messages: {reply['Failed'][0]}"
                )

    def unacked(self) -> int:
        """Visible, in flight and delayed: every message not yet deleted."""
        reply = self._sqs.get_queue_attributes(QueueUrl=self._url, AttributeNames=list(self._COUNTS))
        return sum(int(reply["Attributes"][name]) for name in self._COUNTS)

    def close(self) -> None:
        self._sqs.close()


@contextlib.contextmanager
def opened(base: Path) -> Iterator[tuple[SqsSource, str]]:
    """The source on a server of its own in ``base``, and where it runs."""
    with sqs_server(base / "sqs") as server:
        queue = SqsSource(server)
        try:
            yield queue, f"SQS (moto's emulator) on 127.0.0.1:{server.port} (pid {server.pid})"
        finally:
            queue.close()
