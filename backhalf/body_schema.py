"""Per-adapter body schemas: a JSON Schema the decoded body must satisfy, or
the message is poison (issue 4, DESIGN.md section 8).

jsonschema is the reference implementation: it reads the schema's own
``$schema`` to pick the draft (2020-12 when it names none), checks the schema
itself at start-up, and its ``best_match`` names the one error worth showing.
``format`` is an annotation, as the 2020-12 draft says, not an assertion.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from backhalf.errors import PoisonMessage

# An error message quotes the failing value, which may be most of the body.
MAX_DETAIL_CHARS = 300


class SchemaFileError(Exception):
    """The schema file is missing, not JSON, or not a valid JSON Schema."""


class BodySchema:
    def __init__(self, schema: dict[str, Any], source: str) -> None:
        # Imported here: only adapters with a schema pay its slow import.
        from jsonschema import Draft202012Validator, SchemaError, validators
        from jsonschema.exceptions import best_match

        cls = validators.validator_for(schema, default=Draft202012Validator)
        try:
            cls.check_schema(schema)
        except SchemaError as exc:
            raise SchemaFileError(f"{source}: not a valid JSON Schema: {exc.message}") from exc
        self._validator = cls(schema)
        self.source = source
        self._best_match = best_match

    @classmethod
    def load(cls, path: Path) -> BodySchema:
        try:
            schema = json.loads(path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise SchemaFileError(f"{path}: cannot be read ({exc.strerror or type(exc).__name__})") from exc
        except ValueError as exc:
            raise SchemaFileError(f"{path}: not JSON ({exc})") from exc
        if not isinstance(schema, dict):
            raise SchemaFileError(f"{path}: the schema must be a JSON object")
        return cls(schema, str(path))

    def check(self, value: Any) -> None:
        """Raise ``PoisonMessage('schema_mismatch', ...)`` unless ``value`` conforms.

        A validator that fails on the value itself (a number beyond the float
        range, kept as a ``Decimal``, against a float ``multipleOf``: a
        TypeError inside jsonschema) makes the message poison too
        (``schema_error``): it would fail the same way on every delivery."""
        try:
            error = self._best_match(self._validator.iter_errors(value))
        except (ArithmeticError, TypeError, ValueError) as exc:
            detail = f"{type(exc).__name__}: {exc}"[:MAX_DETAIL_CHARS]
            raise PoisonMessage("schema_error", f"the validator failed on this body: {detail}") from exc
        if error is None:
            return
        where = "/" + "/".join(str(p) for p in error.absolute_path)
        message = error.message
        if len(message) > MAX_DETAIL_CHARS:
            message = message[:MAX_DETAIL_CHARS] + "..."
        raise PoisonMessage("schema_mismatch", f"at {where}: {message}")
