"""Aligned text tables for the CLI's people-facing output."""

from __future__ import annotations

import re
from collections.abc import Sequence

# Characters that would act on a terminal rather than show: C0/C1 controls
# (escape sequences) and the bidirectional overrides that reorder what a
# reader sees. Bodies, errors and todo_events details can carry text from a
# message, which is untrusted input.
_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """``text`` with every terminal control shown as ``\\uXXXX``; tabs and
    newlines stay (callers lay out lines)."""
    return _UNSAFE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def one_line(text: str | None) -> str:
    """``text`` on one line (runs of whitespace, newlines included, become
    one space), printable."""
    return printable(" ".join((text or "").split()))


def table(
    header: Sequence[str], rows: Sequence[Sequence[str]], right: frozenset[int] = frozenset()
) -> list[str]:
    """Aligned columns under a header; the last column is not padded.
    ``right``: the indexes of right-aligned (numeric) columns."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header) - 1)]

    def line(row: Sequence[str]) -> str:
        cells = [
            cell.rjust(widths[i]) if i in right else cell.ljust(widths[i]) for i, cell in enumerate(row[:-1])
        ]
        return "  ".join([*cells, row[-1]]).rstrip()

    return [line(header), *(line(row) for row in rows)]
