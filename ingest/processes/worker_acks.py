"""dramatiq's ack of a message, held until its todo's end is committed
(issue 25: finished in the background).

A successful run hands its end to the state writer and its worker thread
moves on; dramatiq then acks the message at once, from that thread. Acked
before the end is durable, a crash in between would leave the todo running
with no message behind it: rescued all the same once its lease expires,
but the message's ack would have said done for a todo that is not. So the
consumer's ack of such a message is held (:meth:`DeferredAcks.ack`) and
made once the end is settled: committed, or given up (the todo is then
rescued). A crash before the ack leaves the message in dramatiq's Redis,
redelivered when the process is declared dead; its todo, done by then or
running under a lease, is skipped (or rescued and run again: at least
once).

The acks themselves go to Redis from a thread of their own, so a slow or
unreachable Redis holds up no commit of the state writer.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog
from dramatiq.errors import BrokerConnectionError

log = structlog.get_logger(__name__)

# A held ack that fails on Redis is tried again after these waits, then
# dropped (the message is redelivered later, and its done todo skipped).
ACK_RETRY_DELAYS_S = (0.1, 0.5, 1.0, 2.0, 5.0)
CLOSE_TIMEOUT_S = 30.0

Ack = Callable[[Any], None]


@dataclass(slots=True)
class _Held:
    message: Any
    settled: bool = False
    ack: Ack | None = None  # the consumer's, once dramatiq asked for it


class DeferredAcks:
    """The held acks of one worker process, and the thread that makes them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[int, _Held] = {}
        self._due: queue.SimpleQueue[tuple[Ack, Any] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="switchboard-dramatiq-acks", daemon=True)
        self._thread.start()

    def hold(self, message: Any) -> Callable[[], None]:
        """Hold the message's ack (worker thread, before the end is handed
        over); what is returned releases it (writer thread, once settled)."""
        held = _Held(message)
        with self._lock:
            self._held[id(message)] = held

        def release() -> None:
            with self._lock:
                held.settled = True
                ack = held.ack
                if ack is not None:
                    del self._held[id(message)]
            if ack is not None:
                self._due.put((ack, message))

        return release

    def ack(self, message: Any, ack: Ack) -> None:
        """dramatiq's ack of ``message`` (worker thread): made now, or, if its
        end is still being written, once it is settled."""
        with self._lock:
            held = self._held.get(id(message))
            if held is not None and held.message is message:
                if not held.settled:
                    held.ack = ack
                    return
                del self._held[id(message)]
        ack(message)

    def forget(self, message: Any) -> None:
        """dramatiq rejects the message instead (nack): no ack is owed."""
        with self._lock:
            held = self._held.get(id(message))
            if held is not None and held.message is message:
                del self._held[id(message)]

    @property
    def waiting(self) -> int:
        """Acks held for an end not settled yet, or queued for Redis."""
        return len(self._held) + self._due.qsize()

    def close(self) -> None:
        """Make the acks queued so far, then stop (after the state writer
        closed: every end it had is settled by then)."""
        self._due.put(None)
        self._thread.join(CLOSE_TIMEOUT_S)
        with self._lock:
            left = len(self._held)
        if left:
            # Ends never settled (the writer stopped first): redelivered
            # once this process is gone, and skipped or rescued then.
            log.warning("dramatiq_acks_left", messages=left)

    def _run(self) -> None:
        while True:
            item = self._due.get()
            if item is None:
                return
            ack, message = item
            self._make(ack, message)

    def _make(self, ack: Ack, message: Any) -> None:
        for delay_s in (*ACK_RETRY_DELAYS_S, None):
            try:
                ack(message)
            except BrokerConnectionError as exc:
                if delay_s is None:
                    log.warning("dramatiq_ack_dropped", message_id=str(message.message_id)[:64],
                                error=f"{type(exc).__name__}: {exc}",
                                reason="redelivered once this process is gone, then skipped")  # fmt: skip
                    return
                time.sleep(delay_s)
            except Exception as exc:  # this thread must outlive one bad ack
                log.exception("dramatiq_ack_failed", message_id=str(message.message_id)[:64],
                              error=f"{type(exc).__name__}: {exc}")  # fmt: skip
                return
            else:
                return
