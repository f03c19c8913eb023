"""Whether a URL splits into the parts it means: the check every URL of
the config passes first, whatever its scheme."""

from __future__ import annotations

from urllib.parse import urlsplit

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
