"""Named failpoints, so fault tests can crash a real process at an exact step.

Configured once per process from ``SWITCHBOARD_FAILPOINTS`` (read by the CLI at
start-up, never at import): a comma-separated list of ``name=action`` where
action is ``kill`` (SIGKILL this process: the crash a power cut or OOM kill
gives), ``stop`` (SIGSTOP this process: a stalled consumer, until someone
sends SIGCONT) or ``raise`` (raise :class:`InjectedFault`), optionally ``@N`` to fire
on the N-th hit only, e.g. ``after_read=kill@3,before_commit=raise``, or
``~TEXT`` to fire only for a batch holding a message whose body contains TEXT
(``before_store=kill~CRASH``: a message that crashes the ingester every time).

Unset, every check is one dict lookup on an empty dict.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterable
from dataclasses import dataclass

from backhalf.errors import InjectedFault

NAMES = frozenset(
    {
        "after_read",
        "before_store",
        "after_inbox_insert",
        "before_commit",
        "after_commit",
        "after_own_ack",
        "acker_after_select",
        "acker_after_ack",
        "worker_before_end_commit",
        "receiver_before_commit",
        "receiver_after_commit",
    }
)
ACTIONS = frozenset({"kill", "stop", "raise"})


@dataclass
class _Point:
    action: str
    fire_on_hit: int | None
    body_contains: bytes | None = None
    hits: int = 0


_points: dict[str, _Point] = {}


def parse(spec: str) -> dict[str, tuple[str, int | None, bytes | None]]:
    """Parse a failpoint spec; raise ValueError naming the bad part."""
    parsed: dict[str, tuple[str, int | None, bytes | None]] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, sep, action = part.partition("=")
        if not sep or name not in NAMES:
            raise ValueError(f"failpoint {part!r}: expected NAME=ACTION with NAME in {sorted(NAMES)}")
        action, tilde, text = action.partition("~")
        action, _, nth = action.partition("@")
        if action not in ACTIONS:
            raise ValueError(f"failpoint {part!r}: action must be one of {sorted(ACTIONS)}")
        if nth and not nth.isdigit():
            raise ValueError(f"failpoint {part!r}: @N must be a positive integer")
        parsed[name] = (action, int(nth) if nth else None, text.encode() if tilde else None)
    return parsed


def configure(spec: str) -> None:
    _points.clear()
    for name, (action, nth, body_contains) in parse(spec).items():
        _points[name] = _Point(action, nth, body_contains)


def hit(name: str, bodies: Iterable[bytes] = ()) -> None:
    point = _points.get(name)
    if point is None:
        return
    if point.body_contains is not None and not any(point.body_contains in b for b in bodies):
        return
    point.hits += 1
    if point.fire_on_hit is not None and point.hits != point.fire_on_hit:
        return
    if point.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if point.action == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)  # resumes here on SIGCONT
        return
    raise InjectedFault(f"failpoint {name} fired (hit {point.hits})")
