"""Idempotency keys (DESIGN.md section 5, a contract).

* native id (stream entry):     ``{prefix}:{source}:{entry-id}``
* no native id (list, pub/sub): ``{prefix}:{source}:{sha256(body) hex}``
* a reused entry id (another body on a stored id): ``{native key}:{sha256(body) hex}``
* a producer's id (where a transport lets producers choose them): ``{prefix}:{source}:{key_id(id)}``, the
  id with ``%``, ``:``, whitespace and control characters percent-encoded
  and a lone surrogate as ``%uXXXX`` (:func:`key_id`): a producer cannot end
  its id in what looks like a reused id's digest, nor send a NUL PostgreSQL
  cannot store, and ids that differ make keys that differ.
"""

from __future__ import annotations

import hashlib
import re

# What a producer's id may not carry into a key as it is: the escape itself,
# the key's separator, whitespace, and every control character (NUL among
# them, which no PostgreSQL text holds), and a lone surrogate (a JSON
# client's decoding of "\\ud800", which UTF-8 cannot encode). Unicode
# letters stay readable.
_UNSAFE_IN_KEY = re.compile(r"[%:\s\x00-\x1f\x7f-\x9f\ud800-\udfff]")
# What a text column refuses: NUL, and what UTF-8 cannot encode.
_UNSTORABLE = re.compile(r"[\x00\ud800-\udfff]")
# U+FFFD, Unicode's own mark for a character that could not be kept.
_REPLACEMENT = "\ufffd"


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


def key_id(producer_id: str) -> str:
    """A producer-chosen id in the form a key may hold: injective (``%`` is
    escaped too, so two ids never share a form), with no ``:`` (nothing a
    producer sends can take the shape of :func:`reused_key`'s suffix or of
    another source's key) and nothing PostgreSQL refuses. An id of plain
    characters (a UUID, ``order-42``) is itself, so its key reads as before."""
    return _UNSAFE_IN_KEY.sub(_percent, producer_id)


def _percent(match: re.Match[str]) -> str:
    char = match.group()
    if "\ud800" <= char <= "\udfff":
        # A lone surrogate (a byte that was not UTF-8, kept by a client as a
        # surrogate escape; or a JSON "\\ud800") has an escape of its own,
        # so it never spells the bytes of a real character ("\\x80").
        return f"%u{ord(char):04X}"
    return "".join(f"%{b:02X}" for b in char.encode("utf-8"))


def storable_id(producer_id: str) -> str:
    """A producer's id as received, made storable: a NUL (which no text
    column holds) or a lone surrogate becomes U+FFFD; everything else is
    kept as sent. For
    ``source_message_id``, read by people and ``trace``; the key uses
    :func:`key_id`, which is unambiguous."""
    return _UNSTORABLE.sub(_REPLACEMENT, producer_id)
