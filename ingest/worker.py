"""A public name kept (README, docs/workers.md): an application that runs its own
dramatiq workers adds ``ingest.worker.SwitchboardMiddleware`` to its broker.
The workers live in :mod:`ingest.processes.worker`."""

from __future__ import annotations

from ingest.processes.worker import SwitchboardMiddleware

__all__ = ["SwitchboardMiddleware"]
