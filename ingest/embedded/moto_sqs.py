"""The embedded SQS emulator's process: moto's server, with three fixes to its
SQS and one to its HTTP server.

``python -m ingest.embedded.moto_sqs --host 127.0.0.1 --port N`` is what
:mod:`ingest.embedded.sqs_server` runs as its child. It patches moto's SQS
backend, then serves moto's Flask app (``moto.server.main``) on the address
given.

The first fix: a FIFO group is redelivered from its first message. moto
5.2.5's ``SQSBackend.receive_message`` walks the queue's messages in order;
one that is visible again while still in ``pending_messages`` (its
visibility timeout ran out) is dropped from pending there and then, and the
pending groups are computed again. The group stays pending while its later
timed-out messages are still in ``pending_messages``, so it frees only once
the walk has passed them all. Say m0..m3 in one group, m0..m2 received and
never deleted: once their timeout has run out, the next receive skips m0 and
m1 and returns m2, m3. AWS returns m0 first. So every timed-out message is
released from pending before the original receive runs. A long poll that is
already waiting while the timeout runs out takes the same path inside
moto's own wait loop, so the original is always asked not to wait, and a
long poll is turns of release-then-receive, each after a short wait on the
queue's condition (woken by a new message), until the poll's deadline.
moto's own long-poll loop is never entered, nor its hot spin: its wait
returns at once while the queue holds visible messages, and a blocked
group's are, so it burnt a core for the whole poll.

The second fix: one SQS call at a time. moto's server runs each request on
a thread of its own, and its SQS backend takes no lock: a receive walking
the queue hands out a new receipt handle for a message a concurrent delete
has just removed (moto then refuses that handle, ``ReceiptHandleIsInvalid``,
for good: the demo's acker retried such deletes until the demo gave up),
and two concurrent deletes each rewrite the queue's message list from the
same old one, so one deletion is lost and its message comes back. Every
public method of ``SQSBackend`` runs under one lock; a long poll holds it
only for each of its turns, never while it waits. (Seen while receives were
slow, before the third fix; rare since, as the window is short, but a
thread switch can still fall in it.)

The third: speed. moto checks each message it hands out against the
queue's retention period by computing every attribute of the queue, three
counts over all its messages among them, and it reads the clock through
datetime arithmetic (about 12 us a call, two per message on each walk of
the queue): a receive of 10 from a queue of 600 took 0.9 s, from 2,000
about 2 s, so the demo's default run, whose backlog reaches thousands,
fell behind its own visibility timeout (and, with the lock, so did every
other call). The retention check reads the one attribute it needs, and the
SQS models read ``time.time()``, the same UTC epoch seconds.

The HTTP fix: one ``Server`` header. Werkzeug's request handler sends its
own beside the one moto's app sets (``amazon.com``); aiohttp's strict parser
(Python's dev mode, as the test suite runs) refuses such a response, so
aiobotocore could not talk to the emulator there. The handler's is left out
(``_send_response_without_server``).

Another difference, left as it is (nothing here needs it): a FIFO message
sent again with the same ``MessageDeduplicationId`` within 5 minutes is
dropped by moto as by AWS, but moto answers it with a new ``MessageId``
where AWS answers with the first one's; and moto forgets a deduplication id
once its message is deleted, where AWS keeps it for the 5 minutes.

The patches are written against moto 5.2.5's code and refuse any other moto:
``tests/integration/test_sqs_emulator.py`` runs the FIFO scenario above
against plain moto, and says when that fix can be dropped.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import inspect
import logging
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler
from typing import Any

import moto
import moto.server
import moto.sqs.models
from moto.sqs.models import Message, Queue, SQSBackend
from werkzeug.serving import WSGIRequestHandler

PATCHED_MOTO_VERSION = "5.2.5"
# A long poll's turns: how long one waits for a new message before looking
# again (a visibility timeout running out wakes no one).
LONG_POLL_TURN_S = 0.05
_PATCHED = "__switchboard_patched__"

# One SQS call at a time, across every account's and region's backend
# (reentrant: a send to a queue with a Lambda mapping receives from within).
_BACKEND_LOCK = threading.RLock()

_Receive = Callable[..., list[Message]]


def _check_moto() -> None:
    """Refuse a moto other than the one the patches were written against (the
    version decides; the attributes they use are checked too, for a clearer
    message, though ``Queue._messages_lock`` and ``message_retention_period``
    are set per queue and so are not)."""
    missing = [
        name
        for owner, name in (
            (SQSBackend, "receive_message"),
            (SQSBackend, "get_queue"),
            (SQSBackend, "delete_message"),
            (SQSBackend, "is_message_valid_based_on_retention_period"),
            (moto.sqs.models, "unix_time"),
            (moto.sqs.models, "unix_time_millis"),
            (Queue, "pending_messages"),
            (Message, "visible"),
        )
        if not hasattr(owner, name)
    ]
    if moto.__version__ != PATCHED_MOTO_VERSION or missing:
        raise RuntimeError(
            f"moto {moto.__version__} (missing: {', '.join(missing) or 'nothing'}): the SQS patches in"
            f" {__name__} were written for moto {PATCHED_MOTO_VERSION}'s SQSBackend; run"
            " tests/integration/test_sqs_emulator.py to see whether this moto still redelivers a FIFO"
            " group out of order and races concurrent calls, then update the patches or drop them"
        )


_MOTO_UNIX_TIME = moto.sqs.models.unix_time  # type: ignore[attr-defined] # moto's, imported there


def _unix_time(dt: datetime.datetime | None = None) -> float:
    """moto's ``unix_time``: now's from ``time.time()``, a given datetime's as moto reads it."""
    return time.time() if dt is None else float(_MOTO_UNIX_TIME(dt))


def _unix_time_millis(dt: datetime.datetime | None = None) -> float:
    return _unix_time(dt) * 1000.0


def _within_retention(self: SQSBackend, queue_name: str, message: Message) -> bool:
    """moto's check, reading the retention period alone."""
    queue = self.get_queue(queue_name)
    retention_s = float(queue.message_retention_period)  # type: ignore[attr-defined] # set from the queue's attributes
    sent_s: float = (message.sent_timestamp or 0) / 1000
    return retention_s + sent_s > time.time()


def _serialized(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        with _BACKEND_LOCK:
            return method(*args, **kwargs)

    return call


def _release_timed_out(queue: Queue) -> None:
    """Drop from pending every message whose visibility timeout ran out, so
    its group is free again from its first message."""
    for message in [m for m in queue.pending_messages if m.visible]:
        queue.pending_messages.discard(message)


def _wait_for_new_message(queue: Queue, timeout_s: float) -> None:
    # add_message notifies this condition; a timeout running out does not,
    # hence the bound.
    with queue._messages_lock:
        queue._messages_lock.wait(timeout=timeout_s)


def _in_order(original: _Receive) -> _Receive:
    @functools.wraps(original)
    def receive_message(
        self: SQSBackend,
        queue_name: str,
        count: int,
        wait_seconds_timeout: int,
        visibility_timeout: int,
        message_attribute_names: list[str] | None = None,
    ) -> list[Message]:
        deadline = time.monotonic() + wait_seconds_timeout
        while True:
            with _BACKEND_LOCK:
                queue = self.get_queue(queue_name)  # each turn: the queue may be deleted meanwhile
                _release_timed_out(queue)
                received = original(self, queue_name, count, 0, visibility_timeout, message_attribute_names)
            left_s = deadline - time.monotonic()
            if received or left_s <= 0:
                return received
            _wait_for_new_message(queue, min(left_s, LONG_POLL_TURN_S))

    return receive_message


def patch_sqs_backend() -> None:
    """Apply the three fixes to moto's SQS backend (once; a second call does nothing)."""
    _check_moto()
    if getattr(SQSBackend, _PATCHED, False):
        return
    # Speed first, so the lock below wraps the quick retention check.
    SQSBackend.is_message_valid_based_on_retention_period = _within_retention  # type: ignore[method-assign]
    moto.sqs.models.unix_time = _unix_time  # type: ignore[attr-defined] # the name the models call
    moto.sqs.models.unix_time_millis = _unix_time_millis  # type: ignore[attr-defined]
    for name, method in list(vars(SQSBackend).items()):
        public = inspect.isfunction(method) and not name.startswith("_")
        if public and name != "receive_message" and not inspect.isgeneratorfunction(method):
            setattr(SQSBackend, name, _serialized(method))
    SQSBackend.receive_message = _in_order(SQSBackend.receive_message)  # type: ignore[method-assign]
    setattr(SQSBackend, _PATCHED, True)


def _send_response_without_server(
    self: BaseHTTPRequestHandler, code: int, message: str | None = None
) -> None:
    """http.server's ``send_response`` less its ``Server`` header: moto's app
    sends one of its own (``amazon.com``), and a response with two is refused
    by a strict HTTP parser (aiohttp's, in Python's dev mode: "Duplicate
    'Server' header found"), so aiobotocore could not talk to the emulator
    in the test suite. AWS sends one."""
    self.log_request(code)
    self.send_response_only(code, message)
    self.send_header("Date", self.date_time_string())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="moto's server with its SQS fixed (FIFO order, one call at a time)"
    )
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    patch_sqs_backend()
    WSGIRequestHandler.send_response = _send_response_without_server  # type: ignore[method-assign]
    # One line per request (the ingester long-polls all the time) would
    # bury what the log is for: the errors moto's app logs.
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    moto.server.main(["--host", args.host, "--port", str(args.port)])


if __name__ == "__main__":
    main()
