"""Whether a URL splits into the parts it means: the check every URL of
the config passes first, whatever its scheme; and a transport's URL check
built on it (:func:`checked_url`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from ingest.config.keys import string
from ingest.errors import ConfigError

# Messages about a URL never quote it, nor any piece of it: a password with an
# unencoded reserved character is split at that character by every parser, so
# a "host" or "port" read from such a URL may be part of the password.
ENCODE_RULE = (
    "a reserved character in the password must be percent-encoded"
    " (@ as %40, / as %2F, ? as %3F, # as %23, % as %25, a space as %20)"
)


def url_shape_problem(url: str) -> str | None:
    """Why ``url`` cannot be split into its parts as intended, or None."""
    if any(c.isspace() for c in url):
        return f"contains whitespace; {ENCODE_RULE}"
    try:
        parts = urlsplit(url)
        _ = parts.port  # raises ValueError: a port that is no number, or out of range
    except ValueError:
        return f"has a port that is not a number, or {ENCODE_RULE}"
    # An unencoded '?' or '#' in the password moves the rest of the URL, its
    # '@' included, into the query or the fragment.
    moved = (parts.path, parts.query, parts.fragment)
    if parts.netloc.count("@") > 1 or any("@" in piece for piece in moved):
        return ENCODE_RULE
    return None


def checked_url(
    where: str,
    value: Any,
    schemes: tuple[str, ...],
    must_be: str,
    problem: Callable[[str], str | None] = lambda url: None,
) -> str:
    """``value``, a URL of one of ``schemes`` (else: ``where`` must be
    ``must_be``) that splits as it means and that the transport's own
    ``problem`` (asked only then) finds nothing wrong with; ``where`` names
    where it came from (a config key, an environment variable). Never
    echoed: it may hold a password."""
    url = string(where, value)
    if urlsplit(url).scheme not in schemes:
        raise ConfigError(f"{where} must be {must_be}")
    found = url_shape_problem(url) or problem(url)
    if found is not None:
        raise ConfigError(f"{where} is not a valid URL: {found}")
    return url
