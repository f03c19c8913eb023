"""structlog, configured once per process.

JSON lines when stderr is not a terminal (what operators ship), readable
console output on one. The stdlib loggers of dramatiq, psycopg, the
brokers' clients and alembic go through the same processors. A processor removes credentials from
anything that looks like a URL, so a password cannot reach a log line even if
an exception message carries a connection string.
"""

from __future__ import annotations

import logging
import re
import sys
import threading
import traceback
from collections.abc import Mapping, MutableMapping
from types import TracebackType
from typing import Any

import structlog

# One redaction for log lines, messages and stored errors; re-exported, as
# callers know it as ingest.observe.logs.redact.
from backhalf.bounded_text import cut
from backhalf.redaction import redact as redact

_PLAIN = (str, int, float, bool, type(None))


# A log field keeps this much of a long string (a traceback's end included),
# cut before redaction runs over it: an error echoing a megabyte of input
# would otherwise cost every pattern a megabyte, and every log line.
LOG_VALUE_MAX_CHARS = 16_384
LOG_VALUE_TAIL_CHARS = 4_096


def _redact_value(value: Any) -> Any:
    """Strings cut, then redacted; containers item by item; an exception as
    ``Type: message``; any other object by its repr, when that carries a
    credential (a renderer would print the repr)."""
    if isinstance(value, str):
        return redact(cut(value, LOG_VALUE_MAX_CHARS, tail=LOG_VALUE_TAIL_CHARS))
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, BaseException):
        return _redact_value(f"{type(value).__name__}: {value}")
    if isinstance(value, Mapping):
        return {k: _redact_value(v) for k, v in value.items()}
    if _is_secret_pair(value):
        # ("Cookie", "sid=..."): a header list's pair, its name a secret's.
        return [_redact_value(value[0]), "***"]
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_redact_value(v) for v in value]
    text = cut(repr(value), LOG_VALUE_MAX_CHARS, tail=LOG_VALUE_TAIL_CHARS)
    cleaned = redact(text)
    return value if cleaned == text else cleaned


# A field named as a secret (log.info(..., token=...)) is masked whatever
# its value looks like: redaction of the text alone sees no key. A pair's
# name (a header's) is matched the same way, "-" standing for "_".
_SECRET_FIELD = re.compile(
    r"(?:^|[_-])(?:password|passwd|pwd|passphrase|secret|token|api[_-]?key|authorization|credentials?"
    r"|signature(?:[_-]256)?|cookie)$",
    re.IGNORECASE,
)


def _is_secret_pair(value: Any) -> bool:
    """A two-item tuple whose first item names a secret: ``("password",
    "x")``, ``(b"authorization", b"Basic ...")``, a header list's pair. Its
    items alone, redacted one by one, would show no key."""
    if not isinstance(value, tuple) or len(value) != 2:
        return False
    name = value[0].decode("latin-1") if isinstance(value[0], bytes) else value[0]
    return (
        isinstance(name, str) and _SECRET_FIELD.search(name) is not None and value[1] not in (None, "", b"")
    )


def redact_credentials(
    _logger: Any, _method: str, event_dict: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    for key, value in event_dict.items():
        if isinstance(key, str) and _SECRET_FIELD.search(key) and value not in (None, ""):
            event_dict[key] = "***"
        else:
            event_dict[key] = _redact_value(value)
    return event_dict


def _print_redacted(
    kind: type[BaseException], exc: BaseException, tb: TracebackType | None, thread: str | None = None
) -> None:
    text = cut(
        "".join(traceback.format_exception(kind, exc, tb)), LOG_VALUE_MAX_CHARS, tail=LOG_VALUE_TAIL_CHARS
    )
    where = f"in thread {thread}: " if thread else ""
    print(f"{where}{redact(text)}", end="", file=sys.stderr)


def _thread_hook(args: threading.ExceptHookArgs) -> None:
    if args.exc_value is not None:
        name = args.thread.name if args.thread is not None else None
        _print_redacted(args.exc_type, args.exc_value, args.exc_traceback, name)


def redact_uncaught_tracebacks() -> None:
    """A traceback nothing caught (the main thread's or another thread's) is
    printed as Python would, through :func:`redact`: its message or a source
    line may carry a connection string. A process installs this once, at start."""
    sys.excepthook = _print_redacted
    threading.excepthook = _thread_hook


def configure(*, json_output: bool | None = None, level: int = logging.INFO) -> None:
    if json_output is None:
        json_output = not sys.stderr.isatty()
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.format_exc_info,
        redact_credentials,
    ]
    renderer: Any = (
        structlog.processors.JSONRenderer() if json_output else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.make_filtering_bound_logger(level),
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=shared,
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for noisy in ("asyncio",):
        logging.getLogger(noisy).setLevel(logging.WARNING)
