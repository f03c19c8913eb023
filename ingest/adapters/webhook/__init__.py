"""The push family's one transport, ``webhook`` (DESIGN.md section 12): no
broker to read, so no :class:`~ingest.adapters.base.PullAdapter`; what it
owns is the trust check of each delivery (:mod:`.verify`) and the
provenance its events carry. ``switchboard receive``
(ingest.processes.push.receiver) serves it over HTTP."""

from __future__ import annotations

from backhalf.records import Family, Provenance
from ingest.adapters.webhook.verify import Verified

PUSH: Family = "push"


def push_provenance(mode: str, verified: Verified) -> Provenance:
    """The events' family and trust columns: verified by signature, naming
    the mode and the variable whose secret matched (never the secret)."""
    return Provenance(
        family=PUSH,
        trust_mode=verified.trust_mode,
        verified=True,
        verify_detail=f"{mode} secret: {verified.secret}",
    )
