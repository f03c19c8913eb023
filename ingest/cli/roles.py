"""Which of ``ops/roles.sql``'s roles runs each command: what a refused
privilege is explained with (``switchboard adapters disable`` run as the
acker's login is told to use the operator's, not to migrate)."""

from __future__ import annotations

import argparse

_READS = "the acker's or the operator's"
# By command path (its words after `switchboard`); a verb alone covers its actions.
_ROLE_OF: dict[str, str] = {
    "migrate": "the migrator's (it owns the schema)",
    "ingest": "the ingester's",
    "receive": "the receiver's",
    "ack": "the acker's",
    "worker": "the worker's",
    "prune": "the acker's",
    "web": "the operator's (the viewer's: read-only)",
    "status": _READS,
    "trace": _READS,
    "adapters list": _READS,
    "adapters enable": "the operator's",
    "adapters disable": "the operator's",
    "inbox list": _READS,
    "inbox show": _READS,
    "inbox replay": "the operator's",
    "todos list": _READS,
    "todos show": _READS,
    "todos retry": "the operator's",
    "todos cancel": "the operator's",
}


def command_path(args: argparse.Namespace) -> str:
    """``todos retry`` from the parsed arguments."""
    action = getattr(args, f"{args.verb}_verb", None)
    return f"{args.verb} {action}" if action else str(args.verb)


def role_hint(args: argparse.Namespace) -> str | None:
    """``run it as the operator's login (ops/roles.sql)``, or None."""
    path = command_path(args)
    role = _ROLE_OF.get(path)
    if role is None:
        return None
    return f"`switchboard {path}` runs as {role} login of ops/roles.sql (see docs/security.md)"
