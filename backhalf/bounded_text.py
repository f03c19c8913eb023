"""Text from outside (a handler's error, a log field) made bounded and
storable before anything else reads it.

Two rules, in this order, wherever such text is logged or stored:

1. **Cut first.** Redaction's patterns, the log renderer and PostgreSQL all
   pay for every character, and a handler may raise an error a megabyte
   long (echoing its input). The text is cut to a bound before any pattern
   runs over it, at whitespace: a credential (a URL, ``password=...``) is one
   whitespace-free token, so a cut never leaves half of one behind for
   redaction to miss. A token longer than the whole bound is dropped.
2. **Storable.** PostgreSQL's text refuses NUL, and a Python string may hold
   unpaired surrogates that UTF-8 cannot encode; both are written as
   escapes (``\\x00``, ``\\udcff``), so one odd character never fails a
   statement (and the batch of changes it is written in).
"""

from __future__ import annotations

import re

_SURROGATE = re.compile("[\ud800-\udfff]")


def cut(text: str, limit: int, *, tail: int = 0) -> str:
    """``text`` if it is at most ``limit`` characters; else its head, cut at
    whitespace (and, when asked, its last whole lines within ``tail``
    characters: a traceback's last line says what was raised), around a
    note of what was cut."""
    if len(text) <= limit:
        return text
    head_end = _last_space(text, max(0, limit - tail))
    head = text[:head_end]
    end = ""
    if tail:
        # The tail starts at a line: a key and its value (``Authorization:
        # Bearer ...``, ``password = x``) share a line, and a tail starting
        # between them would leave redaction the value without its key.
        start = text.find("\n", len(text) - tail)
        end = text[start:] if start > head_end else ""
    dropped = len(text) - len(head) - len(end)
    return f"{head} [... {dropped} characters cut ...]{end}"


def _last_space(text: str, before: int) -> int:
    """The index of the last whitespace before ``before`` (0: none)."""
    found = max(text.rfind(c, 0, before) for c in (" ", "\n", "\t", "\r"))
    return max(found, 0)


def storable(text: str) -> str:
    """``text`` with NUL and unpaired surrogates written as escapes."""
    if "\x00" in text:
        text = text.replace("\x00", "\\x00")
    if _SURROGATE.search(text):
        # A surrogate pair that is whole is a character already; any left
        # in a str is unpaired, which UTF-8 cannot encode.
        text = _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)
    return text
