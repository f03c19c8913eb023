"""A public name kept (README, docs/workers.md): an application that runs its
own dramatiq CLI builds Switchboard's broker over PostgreSQL with
``ingest.worker.switchboard_broker`` (and may add middleware of its own).
The workers live in :mod:`ingest.processes.workers.worker`."""

from __future__ import annotations

from ingest.processes.workers.worker import SwitchboardMiddleware, switchboard_broker

__all__ = ["SwitchboardMiddleware", "switchboard_broker"]
