"""Idempotency keys (DESIGN.md section 5, a contract).

* native id (stream entry):     ``{prefix}:{source}:{entry-id}``
* no native id (list, pub/sub): ``{prefix}:{source}:{sha256(body) hex}``
* a reused entry id (another body on a stored id): ``{native key}:{sha256(body) hex}``
"""

from __future__ import annotations

import hashlib

DEFAULT_PREFIX = "redis"


def native_key(prefix: str, source: str, message_id: str) -> str:
    return f"{prefix}:{source}:{message_id}"


def body_key(prefix: str, source: str, body: bytes) -> str:
    return f"{prefix}:{source}:{hashlib.sha256(body).hexdigest()}"


def reused_key(key: str, body_sha256: bytes) -> str:
    """The key of a new message on an entry id the inbox already holds with
    another body: the entry's key plus the message's digest. Stable, so a
    redelivery of that message dedups to it; distinct per body, so it cannot
    meet the entry's own key or another message's."""
    return f"{key}:{body_sha256.hex()}"
