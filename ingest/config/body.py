"""What a pull and a push adapter share about the bodies they take: their
``format``, the ``schema`` file a body must satisfy, loaded once at
start-up, and the bound of one validation (``schema_timeout_ms``)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

from backhalf.writes.body_schema import BodySchema, SchemaFileError
from backhalf.writes.normalize import BodyFormat
from ingest.config.keys import Key, got
from ingest.errors import ConfigError


def _format(where: str, value: Any) -> BodyFormat:
    try:
        return BodyFormat(value)
    except ValueError as exc:
        raise ConfigError(
            f"{where} must be json, text or bytes {got(value, [f.value for f in BodyFormat])}"
        ) from exc


Format = Annotated[
    BodyFormat,
    Key(parse=_format, doc="`json`, `text` or `bytes`: how the body is read ([messages.md](messages.md))"),
]
# So a producer or a sender cannot stall the process validating its body.
SchemaTimeoutMs = Annotated[
    int, Key(doc="a body whose validation takes longer is rejected (`validation_timeout`)")
]


def body_schema(label: str, values: Mapping[str, Any], base_dir: Path) -> dict[str, Any]:
    """``schema``: a JSON Schema file, relative to the config file's
    directory, its references resolved now (never while messages arrive);
    the table's ``schema`` and ``body_schema`` values (none without one)."""
    if values["schema"] is None:
        return {}
    if values["format"] is BodyFormat.BYTES:
        raise ConfigError(f"{label}: key 'schema' cannot apply to format = \"bytes\" (nothing is decoded)")
    path = Path(values["schema"])
    path = path if path.is_absolute() else base_dir / path
    try:
        loaded = BodySchema.load(path, timeout_ms=values["schema_timeout_ms"])
    except SchemaFileError as exc:
        raise ConfigError(f"{label}: key 'schema': {exc}") from exc
    return {"schema": str(path), "body_schema": loaded}
