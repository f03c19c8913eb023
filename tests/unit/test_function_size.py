"""A ceiling on function length in the packages (issue 23): no function or
method in ``ingest``, ``backhalf`` or ``schema`` is over ``MAX_LINES``
lines, decorators and docstring included. Ruff bounds complexity, branches
and statements (``pyproject.toml``); this bounds what a reader has to hold
at once."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("ingest", "backhalf", "schema")
MAX_LINES = 80

# (module path, qualified name): why it may be longer for now. An entry that
# is no longer over the line fails the test, as ruff's RUF100 fails a noqa
# that is no longer needed.
EXEMPT: dict[tuple[str, str], str] = {}

Function = ast.FunctionDef | ast.AsyncFunctionDef


def _functions(tree: ast.AST, prefix: str = "") -> Iterator[tuple[str, Function]]:
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield f"{prefix}{node.name}", node
            yield from _functions(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{prefix}{node.name}.")
        else:
            yield from _functions(node, prefix)


def _length(node: Function) -> int:
    first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
    assert node.end_lineno is not None
    return node.end_lineno - first + 1


def function_lengths() -> dict[tuple[str, str], int]:
    lengths = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            module = path.relative_to(ROOT).as_posix()
            for name, node in _functions(ast.parse(path.read_text(encoding="utf-8"), module)):
                lengths[module, name] = _length(node)
    return lengths


def test_no_function_in_the_packages_is_over_the_line() -> None:
    lengths = function_lengths()
    assert len(lengths) > 500, "the walk found the packages' functions"
    over = sorted(
        f"{module}: {name} is {n} lines"
        for (module, name), n in lengths.items()
        if n > MAX_LINES and (module, name) not in EXEMPT
    )
    assert not over, f"functions over {MAX_LINES} lines (split them):\n" + "\n".join(over)


def test_every_exemption_is_still_needed() -> None:
    lengths = function_lengths()
    stale = sorted(
        f"{module}: {name}" for module, name in EXEMPT if lengths.get((module, name), 0) <= MAX_LINES
    )
    assert not stale, "no longer over the line (or gone): remove from EXEMPT:\n" + "\n".join(stale)


def test_the_walk_counts_methods_nested_functions_and_decorators() -> None:
    source = (
        "class A:\n    @staticmethod\n    def f():\n        def g():\n            pass\n        return g\n"
    )
    found = {name: _length(node) for name, node in _functions(ast.parse(source))}
    assert found == {"A.f": 5, "A.f.g": 2}
