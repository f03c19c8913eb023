"""``[queues.NAME]``: the todo queues the workers serve (DESIGN.md section
7). Parsed and checked by ``ingest.config``; read by the rescuer
(``backhalf.lifecycle.rescue``) and the workers (``backhalf.lifecycle.worker``)."""

from __future__ import annotations

from dataclasses import dataclass

# dramatiq actor names of Switchboard's queue actors: one per todo queue.
ACTOR_PREFIX = "switchboard:"


@dataclass(frozen=True, slots=True)
class QueueConfig:
    """``[queues.NAME]``: who does the todos of queue NAME, and how often it
    may try. ``handler`` names a plain function (sync or async) or an
    existing ``@dramatiq.actor``, whose function is called under these
    settings (not the actor's options)."""

    name: str
    handler: str
    max_attempts: int = 5  # runs in all; then the todo is failed
    time_limit_ms: int = 600_000  # a run past it is stopped (dramatiq's TimeLimit) and fails
    min_backoff_ms: int = 1_000  # retry delays, dramatiq's exponential backoff
    max_backoff_ms: int = 60_000
    # Retention (the acker's pruner, `switchboard prune`): done and cancelled
    # todos, and failed ones (kept longer: operators retry them), deleted with
    # their todo_events this many days after their last change. None: kept.
    retain_done_days: float | None = None
    retain_failed_days: float | None = None

    @property
    def actor_name(self) -> str:
        return ACTOR_PREFIX + self.name
