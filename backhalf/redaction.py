"""Credentials removed from text: the one redaction every log line, every
user-facing message and every stored error goes through.

It lives in the back half because the back half stores error text (a
handler's exception becomes ``todos.last_error``, which ``todos``, ``trace``
and the audit views show), and a handler's client library may put its
connection string, password included, in an exception's message. The
processes' log processor (``ingest.observe.logs``) uses the same function.
"""

from __future__ import annotations

import re

# scheme://user:password@host -> scheme://user:***@host. The password runs to
# the last "@" on its line: one with an unencoded "@" or a space in it leaves
# no tail behind. Reaching too far (a host name after a later "@" redacted
# too) is the lesser harm.
_URL_CREDENTIALS = re.compile(r"(?P<head>[a-zA-Z][a-zA-Z0-9+.-]*://[^:/@\s]*:)[^\n]*@")
# password=... in DSNs and keyword lists (PGPASSWORD=..., db_password=...),
# quoted or not, and 'password': '...' in a repr or "password": "..." in JSON.
# A quoted value ends at its closing quote, or at the end of the line when it
# was cut off; an unquoted one at whitespace, as libpq reads it.
_QUOTED = r"""'(?:[^'\\\n]|\\.)*'?|"(?:[^"\\\n]|\\.)*"?"""
_DSN_PASSWORD = re.compile(
    rf"""(?P<head>password\s*=\s*|["']password["']\s*:\s*)(?:{_QUOTED}|\S+)""", re.IGNORECASE
)


def redact(text: str) -> str:
    text = _URL_CREDENTIALS.sub(r"\g<head>***@", text)
    return _DSN_PASSWORD.sub(r"\g<head>***", text)
