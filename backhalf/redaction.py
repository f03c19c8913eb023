"""Credentials removed from text: the one redaction every log line, every
user-facing message and every stored error goes through.

It lives in the back half because the back half stores error text (a
handler's exception becomes ``todos.last_error``, which ``todos``, ``trace``
and the audit views show), and a handler's client library may put its
connection string, password included, in an exception's message. The
processes' log processor (``ingest.observe.logs``) uses the same function.

What it removes (``tests/unit/backhalf/test_redaction.py`` has a table):

* a URL's password (``scheme://user:***@host``), and a NATS URL's token (a
  user name with no password, ``nats://***@host``, which nats-py sends as
  a token);
* the value of a secret-named key: ``password``, ``passwd``, ``pwd``,
  ``passphrase``, ``secret`` (``client_secret``), ``token``
  (``access_token``, ``refresh_token``, ``X-Amz-Security-Token``),
  ``api_key``/``apikey``, ``secret_key``/``private_key``, ``signature``
  (``X-Amz-Signature``, ``Stripe-Signature``, ``webhook-signature``,
  ``X-Hub-Signature-256``), ``credential`` (``X-Amz-Credential``),
  ``cookie`` (``Cookie``, ``Set-Cookie``) and ``sig`` (an Azure SAS),
  written ``key=value`` (a DSN, a query string), ``"key": value`` (JSON, a
  repr), ``("key", value)`` (a repr's pair: a header list) or ``key:
  value`` where a key starts (a YAML line, a header, a flow mapping); a
  signature list (Standard Webhooks' ``v1,SIG v1,SIG``, Stripe's
  ``t=..,v1=..``) is one value, commas and all;
* an ``Authorization`` header's credentials, whatever the scheme, and a
  ``Bearer`` token wherever it stands.

Only the key's own name counts: ``tokens=3``, ``secretary: x`` and "the
password: check it" are left alone. So is a dotted name in the middle of
a line followed by prose (``todos.run_token: a worker's start ...``, a
migration's title): a column or an attribute named in a sentence, not a
key with its value (``Error: settings.password: hunter2`` is one).

Every pattern here takes linear time on any input (issue 33: the URL pattern
once took ten minutes on a megabyte of letters). A pattern that can begin
anywhere begins with a literal or is held to the start of a run by a
lookbehind, so no run of letters, spaces or ``=`` is scanned again from each
of its positions; the one part that looks ahead to the end of a line (a URL
password runs to the last ``@`` of its line) is done in :func:`_url_passwords`,
once per line.
"""

from __future__ import annotations

import re

MASK = "***"

# scheme://user: , the part of a URL kept before its password. The scheme
# starts where its run of scheme characters starts (the lookbehind), past
# any digits or signs leading that run, so a run of letters is walked once,
# not once from each of its letters.
_URL_HEAD = re.compile(r"(?<![a-zA-Z0-9+.-])[0-9+.-]*+[a-zA-Z][a-zA-Z0-9+.-]*+://[^:/@\s]*+:")

# The names whose value is a secret, as the end of a key (a key is a run of
# letters, digits, "_", "." and "-"): PGPASSWORD, db_password, access_token,
# client_secret, X-Amz-Signature, x-api-key. "sig" only as a whole word of
# its key (Azure's SAS "sig="; not "xsig").
_SECRET_NAMES = (
    "password",
    "passwd",
    "pwd",
    "passphrase",
    "secret",
    "token",
    "signature",
    "signature-256",  # GitHub's X-Hub-Signature-256
    "signature_256",
    "cookie",
    "credential",
    "credentials",
    "apikey",
    "api_key",
    "api-key",
    "secretkey",
    "secret_key",
    "secret-key",
    "secret_access_key",
    "privatekey",
    "private_key",
    "private-key",
)
_PASSWORD_NAMES = ("password", "passwd", "pwd", "passphrase")


def _key_ending(names: tuple[str, ...], *word_ends: str, dotted: bool = True) -> str:
    """A key that ends with one of ``names``, or with one of ``word_ends``
    after no letter or digit. The key is the whole run of key characters
    (the first lookbehind: it starts where the run starts), taken
    possessively, and its end is then tested by a lookbehind per name: each
    run is walked once, whatever it holds. ``dotted`` False: a run holding
    a "." is no key (it is a qualified name), and no key starts inside it."""
    ends = [f"(?<={re.escape(n)})" for n in names]
    ends += [f"(?<={re.escape(w)})(?<![a-z0-9]{re.escape(w)})" for w in word_ends]
    run = r"[\w.-]++" if dotted else r"[\w-]++(?!\.)"
    return r"(?<![\w.-])" + run + "(?:" + "|".join(ends) + ")"


_SECRET_KEY = _key_ending(_SECRET_NAMES, "sig")
_UNDOTTED_SECRET_KEY = _key_ending(_SECRET_NAMES, "sig", dotted=False)
_PASSWORD_KEY = _key_ending(_PASSWORD_NAMES)
_PAIR_KEY = _key_ending((*_SECRET_NAMES, "authorization"), "sig")

# A quoted value ends at its closing quote, or at the end of the line when it
# was cut off.
_QUOTED = r"""'(?:[^'\\\n]|\\.)*+'?|"(?:[^"\\\n]|\\.)*+"?"""
# A signature list is one value, commas and spaces within: Standard
# Webhooks' "v1,SIG v1,SIG" (webhook-signature) and Stripe's "t=..,v1=..".
# Each begins with a literal, so no position is scanned twice.
_SIGNATURE_LIST = r"""v\d++,[^\s,&"'<>}]++(?:[ \t]++v\d++,[^\s,&"'<>}]++)*+|t=\d++,[^\s&"'<>}]++"""

# password=... in DSNs and keyword lists (PGPASSWORD=..., ODBC's Pwd=...). An
# unquoted value ends at whitespace, as libpq reads it (a password may hold
# "&" or ";").
_PASSWORD_ASSIGNED = re.compile(rf"(?P<head>{_PASSWORD_KEY}[ \t]*+=[ \t]*+)(?:{_QUOTED}|\S++)", re.IGNORECASE)
# token=..., ?sig=...&: the other names' unquoted values end at whitespace,
# "&" (the next query parameter) or a quote (the string a URL sits in).
_SECRET_ASSIGNED = re.compile(
    rf"""(?P<head>{_SECRET_KEY}[ \t]*+=[ \t]*+)(?:{_QUOTED}|{_SIGNATURE_LIST}|[^\s&"'=<>][^\s&"'<>]*+)""",
    re.IGNORECASE,
)
# 'password': '...' in a repr, "access_token": "..." in JSON.
_QUOTED_KEY = re.compile(
    rf"""(?P<head>["']{_SECRET_KEY}["']\s*+:\s*+)(?:{_QUOTED}|[^\s,}}\]]++)""", re.IGNORECASE
)
# ('password', '...') in a repr: a pair, as a header list holds them
# (b'cookie', b'...' too).
_PAIR = re.compile(
    rf"""(?P<head>\([ \t]*+b?["']{_PAIR_KEY}["'][ \t]*+,[ \t]*+)(?:b?(?:{_QUOTED})|[^\s,)\]]++)""",
    re.IGNORECASE,
)
# password: ... where a key starts: at the start of a line (YAML, a header,
# a list item "- "), after "{", ",", ";", "(" or "[" (a flow mapping), or
# after another colon ("ValueError: token: ..."); never mid-sentence ("the
# password: check it"). A space must follow the colon, as YAML needs. The
# value runs to the end of the line, or of its flow mapping's entry; a
# signature list is one value.
_COLON_KEY = re.compile(
    rf"""(?P<head>(?:^[ \t]*+(?:-[ \t]++)?{_SECRET_KEY}|(?<=[{{,;:(\[])[ \t]*+{_UNDOTTED_SECRET_KEY})"""
    rf"""[ \t]*+:[ \t]++)(?:{_QUOTED}|{_SIGNATURE_LIST}|[^\s,}}][^\r\n,}}]*+)""",
    re.IGNORECASE | re.MULTILINE,
)
# A dotted name in the middle of a line is a key too ("Error:
# settings.password: hunter2 (from env)"): its value runs to the end of the
# line or of its entry, as for any key. One name is exempt: Switchboard's
# own column todos.run_token, which a migration's title names in prose
# ("...; todos.run_token: a worker's start recognizes its own run"): a
# run's token guards its end from another run and opens nothing.
_DOTTED_COLON_KEY = re.compile(
    rf"""(?P<head>(?<=[{{,;:(\[])[ \t]*+{_SECRET_KEY}(?<!run_token)[ \t]*+:[ \t]++)"""
    rf"""(?:{_QUOTED}|{_SIGNATURE_LIST}|[^\s,}}][^\r\n,}}]*+)""",
    re.IGNORECASE | re.MULTILINE,
)
# Authorization: Bearer ..., Basic ..., or a bare credential; as a header,
# key=value or a repr's 'Authorization': 'Bearer ...'. The scheme is kept.
_AUTHORIZATION = re.compile(
    r"""(?P<head>authorization["']?[ \t]*+[:=][ \t]*+["']?(?:[a-z0-9-]++[ \t]++)?)[^\s"',}]++""",
    re.IGNORECASE,
)
# A bearer token anywhere ("curl -H 'Bearer eyJ...'"), long enough not to be
# a word ("bearer tokens are refused" is left alone).
_BEARER = re.compile(r"(?P<head>(?<![a-z0-9])bearer[ \t]++)[a-z0-9._~+/-]{16,}+=*+", re.IGNORECASE)

# nats://TOKEN@host (tls:// too): a NATS URL's user name alone is a token.
_URL_TOKEN = re.compile(r"(?P<head>(?<![a-zA-Z0-9+.-])(?:nats|tls)://)[^:/@\s]++(?=@)", re.IGNORECASE)

# Cheap tests first: most log lines hold none of these, and skip every pattern.
_SECRET_HINTS = ("secret", "token", "sig", "credential", "api", "private", "cookie")
_PASSWORD_HINTS = ("pass", "pwd")


def _url_passwords(text: str) -> str:
    """scheme://user:password@host -> scheme://user:***@host. The password
    runs to the last "@" on its line: one with an unencoded "@" or a space
    in it leaves no tail behind. Reaching too far (a host name after a later
    "@" redacted too) is the lesser harm.

    The last "@" of a line is looked up once per line, not once per URL on
    it: as one regular expression (``[^\\n]*@`` after each head) a line of
    many heads and no "@" took quadratic time."""
    if "://" not in text:
        return text
    pieces: list[str] = []
    kept = 0  # text[:kept] is in pieces
    line_end = last_at = -1  # the line of the previous head: its end, its last "@"
    head = _URL_HEAD.search(text)
    while head is not None:
        end = head.end()
        if end > line_end:
            line_end = text.find("\n", end)
            if line_end < 0:
                line_end = len(text)
            last_at = text.rfind("@", end, line_end)
        if last_at >= end:
            pieces += [text[kept:end], MASK]
            kept = last_at  # the "@" itself is kept
            head = _URL_HEAD.search(text, last_at + 1)
        else:
            head = _URL_HEAD.search(text, head.start() + 1)
    if not pieces:
        return text
    pieces.append(text[kept:])
    return "".join(pieces)


_REPLACEMENT = rf"\g<head>{MASK}"


def _masked(pattern: re.Pattern[str], text: str) -> str:
    return pattern.sub(_REPLACEMENT, text)


def redact(text: str) -> str:
    text = _url_passwords(text)
    lowered = text.lower()
    if "s://" in lowered:  # nats://, tls://
        text = _masked(_URL_TOKEN, text)
    passwords = any(hint in lowered for hint in _PASSWORD_HINTS)
    secrets = passwords or any(hint in lowered for hint in _SECRET_HINTS)
    if "=" in text:
        if passwords:
            text = _masked(_PASSWORD_ASSIGNED, text)
        if secrets:
            text = _masked(_SECRET_ASSIGNED, text)
    if secrets and ":" in text:
        text = _masked(_QUOTED_KEY, text)
        text = _masked(_COLON_KEY, text)
        text = _masked(_DOTTED_COLON_KEY, text)
    if (secrets or "authorization" in lowered) and "," in text:
        text = _masked(_PAIR, text)
    if "authorization" in lowered:
        text = _masked(_AUTHORIZATION, text)
    if "bearer" in lowered:
        text = _masked(_BEARER, text)
    return text
