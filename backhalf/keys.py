"""Idempotency keys (DESIGN.md section 5, a contract).

* native id (stream entry):     ``{prefix}:{source}:{entry-id}``
* no native id (list, pub/sub): ``{prefix}:{source}:{sha256(body) hex}``
"""

from __future__ import annotations

import hashlib

DEFAULT_PREFIX = "redis"


def native_key(prefix: str, source: str, message_id: str) -> str:
    return f"{prefix}:{source}:{message_id}"


def body_key(prefix: str, source: str, body: bytes) -> str:
    return f"{prefix}:{source}:{hashlib.sha256(body).hexdigest()}"
