"""A reader for the small subset of YAML that ``ops/compose.yaml`` is written
in, since no YAML library is a dependency: block mappings and sequences,
flow sequences of scalars, quoted and plain scalars, comments. Anything
outside the subset (anchors, merge keys, block scalars, flow mappings, tabs,
a plain ``yes``/``no`` that YAML 1.1 would read as a boolean) is an error,
not a guess, so the file stays within what this reader proves."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

_PLAIN_BOOLEANS = {"yes", "no", "on", "off", "y", "n", "true", "false", "True", "False", "TRUE", "FALSE"}
_NUMBER = re.compile(r"-?[0-9]+")
_KEY = re.compile(r"(?P<key>[A-Za-z0-9_.\-]+):(?:\s+(?P<rest>.*))?$")


class YamlSubsetError(ValueError):
    """The text is outside the subset this reader understands."""


@dataclass(frozen=True)
class _Line:
    number: int
    indent: int
    text: str


def _strip_comment(text: str) -> str:
    """The line without a trailing comment: a ``#`` at the start or after a
    space, outside quotes."""
    quote: str | None = None
    for i, ch in enumerate(text):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or text[i - 1] == " "):
            return text[:i].rstrip()
    return text.rstrip()


def _scalar(text: str, number: int) -> Any:
    text = text.strip()
    if text.startswith('"'):
        if not text.endswith('"') or len(text) < 2:
            raise YamlSubsetError(f"line {number}: unterminated double-quoted string")
        return json.loads(text)  # the subset's escapes are JSON's
    if text.startswith("'"):
        if not text.endswith("'") or len(text) < 2:
            raise YamlSubsetError(f"line {number}: unterminated single-quoted string")
        return text[1:-1].replace("''", "'")
    if text[:1] in "&*!|>{@`%":
        raise YamlSubsetError(f"line {number}: {text[:1]!r} is outside the subset")
    if text in _PLAIN_BOOLEANS:
        raise YamlSubsetError(f"line {number}: plain {text!r} is a boolean to some readers: quote it")
    if _NUMBER.fullmatch(text):
        return int(text)
    return text


def _split_flow(body: str, number: int) -> list[str]:
    items: list[str] = []
    current = ""
    quote: str | None = None
    for ch in body:
        if quote:
            current += ch
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
            current += ch
        elif ch == ",":
            items.append(current)
            current = ""
        elif ch in "[]{}":
            raise YamlSubsetError(f"line {number}: nested flow collections are outside the subset")
        else:
            current += ch
    if quote:
        raise YamlSubsetError(f"line {number}: unterminated string in a flow sequence")
    if current.strip():
        items.append(current)
    return items


def _value(text: str, number: int) -> Any:
    if text.startswith("["):
        if not text.endswith("]"):
            raise YamlSubsetError(f"line {number}: a flow sequence must end on its line")
        return [_scalar(item, number) for item in _split_flow(text[1:-1], number)]
    return _scalar(text, number)


class _Reader:
    def __init__(self, lines: list[_Line]) -> None:
        self._lines = lines
        self._at = 0

    def _peek(self) -> _Line | None:
        return self._lines[self._at] if self._at < len(self._lines) else None

    def block(self, indent: int) -> Any:
        line = self._peek()
        assert line is not None
        if line.text.startswith("- ") or line.text == "-":
            return self._sequence(indent)
        return self._mapping(indent)

    def _nested(self, parent_indent: int) -> Any:
        """The block under a ``key:`` with nothing after it, or None (empty)."""
        line = self._peek()
        if line is None or line.indent <= parent_indent:
            # A sequence may sit at its key's own indent in YAML; the subset
            # indents it, so an un-indented "- " here is an error below.
            return None
        return self.block(line.indent)

    def _mapping(self, indent: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        while (line := self._peek()) is not None and line.indent == indent:
            if line.text.startswith("- "):
                raise YamlSubsetError(f"line {line.number}: a sequence item where a key was expected")
            self._at += 1
            self._entry(out, line.text, line.number, indent)
        if line is not None and line.indent > indent:
            raise YamlSubsetError(f"line {line.number}: unexpected indentation")
        return out

    def _entry(self, out: dict[str, Any], text: str, number: int, indent: int) -> None:
        match = _KEY.match(text)
        if match is None:
            raise YamlSubsetError(f"line {number}: expected 'key: value', got {text!r}")
        key, rest = match["key"], match["rest"]
        if key in out:
            raise YamlSubsetError(f"line {number}: key {key!r} given twice")
        if key == "<<":
            raise YamlSubsetError(f"line {number}: merge keys are outside the subset")
        out[key] = self._nested(indent) if rest is None else _value(rest, number)

    def _sequence(self, indent: int) -> list[Any]:
        out: list[Any] = []
        while (line := self._peek()) is not None and line.indent == indent and line.text.startswith("- "):
            self._at += 1
            item = line.text[2:].strip()
            if _KEY.match(item):
                # "- key: value" opens a mapping whose further keys sit under
                # the first one's column.
                mapping: dict[str, Any] = {}
                inner = indent + 2
                self._entry(mapping, item, line.number, inner)
                while (more := self._peek()) is not None and more.indent == inner:
                    self._at += 1
                    self._entry(mapping, more.text, more.number, inner)
                out.append(mapping)
            else:
                out.append(_value(item, line.number))
        return out


def loads(text: str) -> Any:
    lines: list[_Line] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        if "\t" in raw[: len(raw) - len(raw.lstrip())]:
            raise YamlSubsetError(f"line {number}: a tab in the indentation")
        stripped = _strip_comment(raw)
        if stripped.strip():
            lines.append(_Line(number, len(stripped) - len(stripped.lstrip()), stripped.strip()))
    if not lines:
        return None
    reader = _Reader(lines)
    value = reader.block(lines[0].indent)
    leftover = reader._peek()
    if leftover is not None:
        raise YamlSubsetError(f"line {leftover.number}: unexpected indentation")
    return value
