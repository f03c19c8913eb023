"""The console entry point: stop signals are caught before the heavy imports.

SQLAlchemy, redis and psycopg take a good part of a second to import. A
SIGTERM in that window (a supervisor stopping a process it just started)
would otherwise kill it with the default action; here it is recorded and the
process exits 0 as soon as its loop starts, like any other graceful stop.
``python -m ingest`` and the ``switchboard`` script both come through here.
"""

from __future__ import annotations

from ingest import signals


def main() -> int:
    signals.record_early()
    from ingest.cli import main as cli_main

    return cli_main()
