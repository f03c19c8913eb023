"""The console entry point: stop signals are caught before the heavy imports.

SQLAlchemy, redis and psycopg take a good part of a second to import. A
SIGTERM in that window (a supervisor stopping a process it just started)
would otherwise kill it with the default action; here it is recorded and the
process exits 0 as soon as its loop starts, like any other graceful stop.
"""

from __future__ import annotations

import signal
from types import FrameType

_requested: list[int] = []


def _record(signum: int, _frame: FrameType | None) -> None:
    _requested.append(signum)


def stop_requested_early() -> bool:
    return bool(_requested)


def restore_default_handlers() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def main() -> int:
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _record)
    from ingest.cli import main as cli_main

    return cli_main()
