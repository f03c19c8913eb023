"""The outcome every action may return instead of its own "done"."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Refused:
    """The action was not taken, and nothing was changed. ``reason`` names
    its subject and why, in the words the front ends show as they are."""

    reason: str
