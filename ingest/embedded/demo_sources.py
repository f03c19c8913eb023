"""What ``switchboard demo``'s sources share: the :class:`DemoSource`
protocol, the adapter table (:func:`demo_adapter`), and :class:`LoopThread` for an
asyncio client driven from the demo's main thread (:class:`AsyncClientSource`
a source's base on one). Each transport's source
is its own, ``ingest/adapters/<name>/demo.py``, loaded by name for a demo on
it: its ``opened(base)`` starts its server in ``base`` and yields the source
and a line saying where the server runs; an optional ``missing()`` says why
the server cannot run here, before anything starts."""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import contextlib
import importlib
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol, TypeVar

GROUP = "switchboard"

_T = TypeVar("_T")


class DemoSource(Protocol):
    transport: str
    source_word: str  # what the orders go to: a stream, a queue
    ack_word: str  # what the acker sends, for the report
    unacked_label: str
    restart_note: str
    process_env: dict[str, str]  # added to the ingester's, acker's and worker's environment

    def adapter(self) -> dict[str, Any]: ...

    def produce(self, bodies: list[bytes], traceparent: str | None = None) -> None:
        """Send ``bodies``, each with ``traceparent`` where this broker carries one (``--trace``)."""
        ...

    def unacked(self) -> int: ...


def demo_adapter(transport: str, mode: str, source: str, url: str, **own: Any) -> dict[str, Any]:
    """The demo's adapter table on ``transport``: what every source shares,
    its own mode, source and URL, and ``own`` keys of its transport."""
    return {"name": "orders", "queue": "orders", "ack_after": "store", "batch_size": 200, "block_ms": 200,
            "transport": transport, "mode": mode, "source": source, "url": url, **own}  # fmt: skip


def _module(transport: str) -> ModuleType:
    name = f"ingest.adapters.{transport}.demo"
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name != name:
            raise
        raise ValueError(f"the demo has no source on transport {transport!r}") from None


def missing_broker(transport: str) -> str | None:
    """Why ``transport``'s demo server cannot run here, with how to get it;
    None when it can."""
    missing: Callable[[], str | None] | None = getattr(_module(transport), "missing", None)
    return None if missing is None else missing()


def demo_source(transport: str, base: Path) -> contextlib.AbstractContextManager[tuple[DemoSource, str]]:
    """The source for ``transport`` on a server of its own in ``base``, and a
    line saying where that server runs."""
    opened: Callable[[Path], contextlib.AbstractContextManager[tuple[DemoSource, str]]]
    opened = _module(transport).opened
    return opened(base)


class LoopThread:
    """An event loop on a thread of its own, for a client the main thread
    calls and waits on. The demo's stop signals raise ``Stopped`` in the main
    thread wherever it is: inside an event loop's callback there (a socket's
    read), asyncio would catch it, log it as a fatal transport error and go
    on. Here the main thread only ever waits on a future, where ``Stopped``
    is raised cleanly, and makes no coroutine itself (none is left never
    awaited when a signal lands between making one and handing it over)."""

    def __init__(self, name: str) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def call(self, make: Callable[[], Awaitable[_T]], timeout_s: float) -> _T:
        """Run ``make()`` on the loop; its result, or its exception. A stop
        signal raises here while it runs on: ``close`` ends it."""
        done: concurrent.futures.Future[_T] = concurrent.futures.Future()

        def handover(task: asyncio.Future[_T]) -> None:
            if task.cancelled():
                done.cancel()
            elif (exc := task.exception()) is not None:
                done.set_exception(exc)
            else:
                done.set_result(task.result())

        def begin() -> None:
            asyncio.ensure_future(make()).add_done_callback(handover)

        self._loop.call_soon_threadsafe(begin)
        return done.result(timeout_s)

    def close(self, timeout_s: float) -> None:
        """Cancel what still runs on the loop, stop it and close it."""

        async def cancel_the_rest() -> None:
            rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in rest:
                task.cancel()
            await asyncio.gather(*rest, return_exceptions=True)

        try:
            self.call(cancel_the_rest, timeout_s)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout_s)
            if not self._thread.is_alive():
                self._loop.close()


class AsyncClientSource(abc.ABC):
    """A source whose broker client is asyncio only, driven from the demo's
    main thread on a :class:`LoopThread` of its own: ``_open`` runs at
    construction (the subclass sets what it needs first), ``_close`` at
    :meth:`close`, which a failed open calls too."""

    process_env: dict[str, str]
    CALL_TIMEOUT_S = 10.0
    # A chunk's publishes, each confirmed by the broker, with room to spare.
    PRODUCE_TIMEOUT_S = 60.0

    def __init__(self, thread_name: str) -> None:
        self.process_env = {}
        self._loop = LoopThread(thread_name)
        try:
            self._loop.call(self._open, self.CALL_TIMEOUT_S * 3)
        except BaseException:
            self.close()
            raise

    @abc.abstractmethod
    async def _open(self) -> None: ...

    @abc.abstractmethod
    async def _close(self) -> None:
        """Close what ``_open`` opened, as far as it got."""

    def _call(self, make: Callable[[], Awaitable[_T]], timeout_s: float | None = None) -> _T:
        return self._loop.call(make, self.CALL_TIMEOUT_S if timeout_s is None else timeout_s)

    def close(self) -> None:
        try:
            self._loop.call(self._close, self.CALL_TIMEOUT_S)
        finally:
            self._loop.close(self.CALL_TIMEOUT_S)
