"""Aligned text tables for the CLI's people-facing output."""

from __future__ import annotations

from collections.abc import Sequence


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
