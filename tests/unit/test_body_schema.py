"""Per-adapter body schemas: config loading and the poison verdict."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from backhalf.body_schema import BodySchema
from backhalf.errors import PoisonMessage
from backhalf.normalize import BodyFormat, body_payload, fields_payload
from ingest.config import from_mapping, load
from ingest.errors import ConfigError

ORDER = {
    "type": "object",
    "required": ["order_id", "qty"],
    "properties": {"order_id": {"type": "integer"}, "qty": {"type": "number", "minimum": 0}},
}
LIMIT = 1024 * 1024


def schema(doc: dict[str, Any]) -> BodySchema:
    return BodySchema(doc, "test")


def test_conforming_body_passes_and_keeps_its_text() -> None:
    body = b'{"order_id": 7, "qty": 1.5e400}'
    assert body_payload(body, BodyFormat.JSON, LIMIT, schema(ORDER)) == body.decode()


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (b'{"order_id": 7}', "at /: 'qty' is a required property"),
        (b'{"order_id": "7", "qty": 1}', "at /order_id: '7' is not of type 'integer'"),
        (b'{"order_id": 7, "qty": -0.5}', "at /qty: -0.5 is less than the minimum of 0"),
        (b"[1, 2]", "is not of type 'object'"),
    ],
)
def test_nonconforming_body_is_poison_naming_where(body: bytes, needle: str) -> None:
    with pytest.raises(PoisonMessage) as info:
        body_payload(body, BodyFormat.JSON, LIMIT, schema(ORDER))
    assert info.value.reason == "schema_mismatch"
    assert needle in str(info.value)


def test_detail_is_bounded_even_when_the_value_is_huge() -> None:
    body = json.dumps({"order_id": 1, "qty": "x" * 100_000}).encode()
    with pytest.raises(PoisonMessage) as info:
        body_payload(body, BodyFormat.JSON, LIMIT, schema(ORDER))
    assert len(str(info.value)) < 400


def test_text_bodies_and_field_maps_are_checked_as_decoded() -> None:
    short = schema({"type": "string", "maxLength": 3})
    assert body_payload(b"abc", BodyFormat.TEXT, LIMIT, short) == '"abc"'
    with pytest.raises(PoisonMessage, match="schema_mismatch"):
        body_payload(b"abcd", BodyFormat.TEXT, LIMIT, short)
    fields = schema({"type": "object", "required": ["sku"]})
    assert json.loads(fields_payload({b"sku": b"A1"}, LIMIT, fields)) == {"sku": "A1"}
    with pytest.raises(PoisonMessage, match="'sku' is a required property"):
        fields_payload({b"other": b"1"}, LIMIT, fields)


def adapter_with(schema_value: str, **kw: Any) -> dict[str, Any]:
    return {"name": "orders", "mode": "stream", "source": "orders", "schema": schema_value, **kw}


def test_config_resolves_a_relative_schema_against_the_config_file(tmp_path: Path) -> None:
    (tmp_path / "schemas").mkdir()
    (tmp_path / "schemas" / "order.json").write_text(json.dumps(ORDER))
    config = tmp_path / "switchboard.toml"
    config.write_text(
        '[database]\nurl = "postgresql://sb@localhost/sb"\n'
        '[[adapters]]\nname = "orders"\nsource = "orders"\nschema = "schemas/order.json"\n'
    )
    a = load(config, {}).adapters[0]
    assert a.schema == str(tmp_path / "schemas" / "order.json")
    assert a.body_schema is not None
    assert a.public_settings()["schema"] == a.schema


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (None, "cannot be read"),
        ("{not json", "not JSON"),
        ("[1]", "must be a JSON object"),
        ('{"type": "no-such-type"}', "not a valid JSON Schema"),
    ],
)
def test_bad_schema_files_are_config_errors_naming_adapter_and_key(
    tmp_path: Path, content: str | None, needle: str
) -> None:
    path = tmp_path / "order.json"
    if content is not None:
        path.write_text(content)
    db = {"url": "postgresql://sb@localhost/sb"}
    with pytest.raises(ConfigError) as info:
        from_mapping({"database": db, "adapters": [adapter_with(str(path))]}, {})
    assert "adapter 'orders': key 'schema'" in str(info.value)
    assert needle in str(info.value)


def test_schema_is_refused_for_bytes_format(tmp_path: Path) -> None:
    path = tmp_path / "order.json"
    path.write_text(json.dumps(ORDER))
    db = {"url": "postgresql://sb@localhost/sb"}
    with pytest.raises(ConfigError, match=r"'schema' cannot apply to format = \"bytes\""):
        from_mapping({"database": db, "adapters": [adapter_with(str(path), format="bytes")]}, {})


def test_a_validator_failing_on_the_body_is_poison_not_a_crash() -> None:
    """Issue 11.8: a decimal multipleOf (the usual money check) and a number
    beyond the float range, kept as a Decimal: jsonschema raised TypeError,
    which crashed the whole batch on every delivery."""
    money = BodySchema(
        {"type": "object", "properties": {"x": {"type": "number", "multipleOf": 0.5}}}, "money"
    )
    assert body_payload(b'{"x": 1.5}', BodyFormat.JSON, 1 << 20, money) == '{"x": 1.5}'
    with pytest.raises(PoisonMessage) as info:
        body_payload(b'{"x": 1e400}', BodyFormat.JSON, 1 << 20, money)
    assert info.value.reason == "schema_error"
    assert "TypeError" in info.value.detail
