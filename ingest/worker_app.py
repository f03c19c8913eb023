"""A public name kept (README, docs/workers.md): ``python -m dramatiq
ingest.worker_app`` runs the workers of ``SWITCHBOARD_CONFIG`` as
``switchboard worker`` does; the module is :mod:`ingest.processes.workers.worker_app`."""

from __future__ import annotations

from ingest.processes.workers.worker_app import broker

__all__ = ["broker"]
