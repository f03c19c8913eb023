"""The inbox as people read it, for the CLI and the console alike: a time
bound typed by a person (``1h``, an ISO moment), and a stored body made
readable (JSON pretty-printed, else UTF-8 text, else base64)."""

from __future__ import annotations

import base64
import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

_DURATION = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(s|m|h|d|w)$")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}
# The longest --since / --until age: far past any inbox row, well inside
# PostgreSQL's timestamps.
MAX_AGE = timedelta(days=365_000)


def time_bound(text: str) -> datetime | timedelta:
    """``--since`` / ``--until``: an ISO 8601 moment (UTC unless it says
    otherwise) or an age such as ``90s``, ``30m``, ``1h``, ``2d``, ``1w``."""
    duration = _DURATION.match(text.strip())
    if duration is not None:
        too_long = ValueError(f"an age must be at most {MAX_AGE.days}d, 1000 years (got {text!r})")
        try:
            age = timedelta(**{_UNITS[duration.group(2)]: float(duration.group(1))})
        except OverflowError as exc:  # past timedelta's range: a traceback, not exit 2, otherwise
            raise too_long from exc
        # PostgreSQL computes now() - age: past its timestamps' range, that
        # would be a database error at run time instead of a usage error now.
        if age > MAX_AGE:
            raise too_long
        return age
    try:
        moment = datetime.fromisoformat(text.strip())
    except ValueError as exc:
        raise ValueError(
            f"must be an ISO 8601 time (2026-12-01T10:00:00Z) or an age like 30m, 1h, 2d (got {text!r})"
        ) from exc
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


@dataclass(frozen=True, slots=True)
class BodyView:
    """A stored body made readable."""

    encoding: str  # "json" (pretty-printed), "text" (UTF-8) or "base64" (neither)
    lines: list[str]
    note: str


def decode(body: bytes, *, whole: bool) -> str | None:
    """The body as UTF-8 text, or None. A prefix may end inside a character:
    that cut is not a reason to call the rest binary."""
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError as exc:
        if not whole and exc.reason == "unexpected end of data" and exc.start >= len(body) - 3:
            return body[: exc.start].decode("utf-8", errors="strict")
        return None


def body_view(
    body: bytes, *, body_size: int | None, body_sha256: bytes | None, clean: Callable[[str], str] = str
) -> BodyView:
    """The stored body as JSON (pretty), UTF-8 text or base64, with what is
    known of its size; ``clean``: applied to each shown line of text."""
    whole = body_size is None
    digest = (body_sha256 if body_sha256 is not None else hashlib.sha256(body).digest()).hex()
    if whole:
        size = f"{len(body)} bytes, sha256 {digest}"
    else:
        size = (
            f"only its first {len(body)} bytes are stored, of a message of {body_size} bytes"
            f" (sha256 of the whole message {digest})"
        )
    text = decode(body, whole=whole)
    if text is None:
        return BodyView("base64", base64_lines(body), f"{size}; not UTF-8, shown as base64")
    if whole:
        try:
            parsed = json.loads(text)
        except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
            pass
        else:
            pretty = _encodable(json.dumps(parsed, indent=2, ensure_ascii=False))
            return BodyView("json", [clean(line) for line in pretty.splitlines()], f"{size}; JSON")
    kind = "UTF-8 text" if whole else "UTF-8 text, cut where the stored prefix ends"
    return BodyView("text", [clean(line) for line in text.splitlines()] or [""], f"{size}; {kind}")


def base64_lines(body: bytes) -> list[str]:
    """The body in base64, 76 characters a line."""
    encoded = base64.b64encode(body).decode("ascii")
    return [encoded[i : i + 76] for i in range(0, len(encoded), 76)] or [""]


def pretty_json(value: object) -> str:
    """A decoded JSON value (a todo's payload) indented for reading."""
    return _encodable(json.dumps(value, indent=2, ensure_ascii=False, sort_keys=True, default=str))


def _encodable(text: str) -> str:
    """``text`` with any lone surrogate written as its escape: JSON's
    ``"\\ud800"`` decodes to one, and no UTF-8 page or terminal can show it
    (encoding it raises)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")
