"""The config reference, written from the definitions: one table per section
of the config file (key, type with its bounds, default, meaning; for
``[[adapters]]`` the modes a key applies to), from each setting's type,
default and :class:`~ingest.config.keys.Key`.

It lives in ``docs/configuration.md`` between two marker comments, the
hand-written prose around it; ``tests/unit/config/test_config_reference.py`` fails
when the two differ. ::

    python -m ingest.config.reference           # print the generated block
    python -m ingest.config.reference --write   # rewrite it in docs/configuration.md
"""

from __future__ import annotations

import argparse
import enum
import sys
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

from ingest.config import sections
from ingest.config.keys import Section, Setting

COMMAND = "python -m ingest.config.reference"
BEGIN = f"<!-- BEGIN generated: {COMMAND} -->"
END = "<!-- END generated -->"
DOCS = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
MIB = 1024 * 1024


def markdown(tables: Sequence[Section] | None = None) -> str:
    """The reference's block: each section's title, its intro and its table."""
    return "\n\n".join(_section(s) for s in (sections() if tables is None else tables)) + "\n"


def _section(section: Section) -> str:
    modes = any(s.key.modes is not None for s in section.settings)
    header = ["key", *(["modes"] if modes else []), "type", "default", "meaning"]
    lines = [f"## `{section.title}`", ""]
    if section.intro:
        lines += [section.intro, ""]
    lines += [_cells(header), _cells(["---"] * len(header))]
    for s in section.settings:
        applies = ", ".join(f"`{m}`" for m in s.key.modes) if s.key.modes is not None else "all"
        if s.key.transports is not None:
            applies += " of " + ", ".join(f"`{t}`" for t in s.key.transports)
        lines.append(_cells([f"`{s.name}`", *([applies] if modes else []), _type(s), _default(s), s.key.doc]))
    return "\n".join(lines)


def _cells(cells: Sequence[str]) -> str:
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def _type(s: Setting) -> str:
    if s.key.type_doc is not None:
        return s.key.type_doc
    kind = _unwrap_optional(s.kind)
    if kind is bool:
        return "boolean"
    if kind is str or get_origin(kind) is Literal or (isinstance(kind, type) and issubclass(kind, enum.Enum)):
        return "string"
    if kind not in (int, float):
        raise TypeError(f"{s.attr}: no type to show for {kind!r}: give its Key a type_doc")
    if s.key.parse is not None:  # a check of its own says the bounds
        return "integer" if kind is int else "number"
    if kind is float:
        return f"number {'>= 0' if s.key.zero else '> 0'}"
    low = 0 if s.key.zero else (s.key.minimum or 1)
    return f"integer {low}..{s.key.maximum}" if s.key.maximum is not None else f"integer >= {low}"


def _unwrap_optional(kind: Any) -> Any:
    if get_origin(kind) in (Union, types.UnionType):
        (kind,) = [a for a in get_args(kind) if a is not type(None)]
    return kind


def _default(s: Setting) -> str:
    value = s.default
    if s.key.default_doc is not None:
        return s.key.default_doc() if callable(s.key.default_doc) else s.key.default_doc
    if s.required:
        return "none: required"
    if value is None:
        return "none"
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, str):
        return f"`{value}`"
    if isinstance(value, float):
        return f"{value:g}"
    return f"{value}{_in_units(s.name, value)}"


def _in_units(name: str, value: int) -> str:
    """A size in MiB, a time in seconds or minutes, where that reads easier."""
    if name.endswith("_bytes") and value >= MIB and value % MIB == 0:
        return f" ({value // MIB} MiB)"
    if name.endswith("_ms") and value >= 1000 and value % 1000 == 0:
        seconds = value // 1000
        return f" ({seconds // 60} min)" if seconds >= 60 and seconds % 60 == 0 else f" ({seconds} s)"
    return ""


def replaced(text: str, block: str) -> str:
    """``text`` with what is between the markers replaced by ``block``."""
    before, begin, rest = text.partition(BEGIN)
    _, end, after = rest.partition(END)
    if not begin or not end:
        raise ValueError(f"no {BEGIN!r} ... {END!r} block to replace")
    return f"{before}{BEGIN}\n\n{block}\n{END}{after}"


def main(argv: Sequence[str] | None = None, docs: Path = DOCS) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description="The config reference, from the definitions.")
    parser.add_argument("--write", action="store_true", help=f"rewrite the block in {docs}")
    args = parser.parse_args(argv)
    if not args.write:
        sys.stdout.write(markdown())
        return 0
    docs.write_text(replaced(docs.read_text(encoding="utf-8"), markdown()), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
