"""A schema rejection's text carries no message content (issue 32.6): it is
stored in the inbox's ``error``, which the auditor's views show, and it
names the path, the keyword and the schema's expectation, never the value.
The same against PostgreSQL, with the audit view and the logs:
tests/integration/backhalf/test_schema_rejections.py."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest

from backhalf.errors import PoisonMessage
from backhalf.writes.body_schema import BodySchema
from backhalf.writes.normalize import BodyFormat, body_payload, fields_payload

CARD = "4111 1111 1111 1111"
DIGITS = "4111111111111111"
LIMIT = 1 << 20

# (schema, body, the rejection's detail): each keyword that can reject a body
# the card number is in, as a value or as a key.
CASES: list[tuple[dict[str, Any], Any, str]] = [
    (
        {"properties": {"card": {"type": "integer"}}},
        {"card": CARD},
        'at /card: keyword type failed (schema: "integer")',
    ),
    (
        {"properties": {"card": {"type": ["integer", "null"]}}},
        {"card": CARD},
        'at /card: keyword type failed (schema: ["integer", "null"])',
    ),
    (
        {"properties": {"card": {"pattern": "^[0-9]{4}$"}}},
        {"card": CARD},
        'at /card: keyword pattern failed (schema: "^[0-9]{4}$")',
    ),
    (
        {"properties": {"card": {"maxLength": 4}}},
        {"card": CARD},
        "at /card: keyword maxLength failed (schema: 4)",
    ),
    (
        {"properties": {"card": {"enum": ["visa", "amex"]}}},
        {"card": CARD},
        'at /card: keyword enum failed (schema: ["visa", "amex"])',
    ),
    (
        {"properties": {"card": {"const": "redacted"}}},
        {"card": CARD},
        'at /card: keyword const failed (schema: "redacted")',
    ),
    ({"properties": {"card": {"not": {"type": "string"}}}}, {"card": CARD}, "at /card: keyword not failed"),
    (
        {"properties": {"card": {"anyOf": [{"type": "integer"}, {"maxLength": 2}]}}},
        {"card": CARD},
        "at /card: keyword anyOf failed",
    ),
    (
        {"properties": {"n": {"maximum": 10}}},
        {"n": int(DIGITS)},
        "at /n: keyword maximum failed (schema: 10)",
    ),
    (
        {"properties": {"n": {"multipleOf": 7}}},
        {"n": int(DIGITS)},
        "at /n: keyword multipleOf failed (schema: 7)",
    ),
    (
        {"properties": {"n": {"exclusiveMaximum": 1.5}}},
        {"n": Decimal(DIGITS + "e400")},
        "at /n: keyword exclusiveMaximum failed (schema: 1.5)",
    ),
    # The card number as a key: the body's own key is never shown.
    ({"additionalProperties": False}, {CARD: 1}, "at /: keyword additionalProperties failed (schema: false)"),
    (
        {"additionalProperties": {"type": "integer"}},
        {CARD: "x"},
        'at /*: keyword type failed (schema: "integer")',
    ),
    (
        {"patternProperties": {"^4": {"type": "integer"}}},
        {CARD: "x"},
        'at /*: keyword type failed (schema: "integer")',
    ),
    ({"propertyNames": {"maxLength": 8}}, {CARD: 1}, "at /: keyword maxLength failed (schema: 8)"),
    ({"required": ["card", "cvv"]}, {CARD: 1}, 'at /: keyword required failed (missing: ["card", "cvv"])'),
    ({"dependentRequired": {"card": ["cvv"]}}, {"card": CARD}, "at /: keyword dependentRequired failed"),
    ({"maxProperties": 0}, {CARD: CARD}, "at /: keyword maxProperties failed (schema: 0)"),
    # Arrays: indexes are shown, values are not.
    ({"items": {"type": "integer"}}, [1, CARD], 'at /1: keyword type failed (schema: "integer")'),
    ({"uniqueItems": True}, [CARD, CARD], "at /: keyword uniqueItems failed (items 0 and 1 are equal)"),
    ({"contains": {"const": 1}}, [CARD], "at /: keyword contains failed"),
    (
        {"prefixItems": [{"type": "integer"}], "items": False},
        [1, CARD],
        "at /: keyword items failed (schema: false)",
    ),
    # A whole body that is the value, and a schema that allows nothing.
    ({"type": "object"}, CARD, 'at /: keyword type failed (schema: "object")'),
    ({"properties": {"card": False}}, {"card": CARD}, "at /: the schema allows no value here (false)"),
    # Older drafts, whose keywords take other values.
    (
        {"$schema": "http://json-schema.org/draft-04/schema#", "properties": {"card": {"type": "integer"}}},
        {"card": CARD},
        'at /card: keyword type failed (schema: "integer")',
    ),
    (
        {"$schema": "http://json-schema.org/draft-07/schema#", "dependencies": {"card": ["cvv"]}},
        {"card": CARD},
        "at /: keyword dependencies failed",
    ),
]


@pytest.mark.parametrize(("doc", "body", "detail"), CASES)
def test_a_rejection_names_path_keyword_and_expectation_never_the_value(
    doc: dict[str, Any], body: Any, detail: str
) -> None:
    with pytest.raises(PoisonMessage) as info:
        BodySchema(doc, "cards").check(body)
    assert info.value.reason == "schema_mismatch"
    assert info.value.detail == detail
    for fragment in (CARD, DIGITS, "4111"):
        assert fragment not in str(info.value)


def test_keys_the_schema_names_are_shown_wherever_the_schema_names_them() -> None:
    """A key the schema holds anywhere (a property, a required name, an enum)
    is the schema's text; the path shows it, and hides only the others."""
    cards = BodySchema(
        {
            "$defs": {"holder": {"properties": {"name": {"type": "string"}}}},
            "properties": {"wallet": {"additionalProperties": {"$ref": "#/$defs/holder"}}},
            "required": ["a/b~c"],
        },
        "cards",
    )
    with pytest.raises(PoisonMessage) as info:
        cards.check({"wallet": {CARD: {"name": 5}}, "a/b~c": 1})
    assert info.value.detail == 'at /wallet/*/name: keyword type failed (schema: "string")'
    with pytest.raises(PoisonMessage) as info:
        cards.check({"wallet": {"name": {"name": 5}}, "a/b~c": 1})
    assert info.value.detail == 'at /wallet/name/name: keyword type failed (schema: "string")'


def test_a_long_expectation_and_a_deep_path_are_cut() -> None:
    many = [f"choice-{i}" for i in range(100)]
    with pytest.raises(PoisonMessage) as info:
        BodySchema({"enum": many}, "long").check(CARD)
    assert info.value.detail.startswith('at /: keyword enum failed (schema: ["choice-0", "choice-1"')
    assert info.value.detail.endswith("...)")
    assert len(info.value.detail) < 200
    deep: dict[str, Any] = {"type": "integer"}
    body: Any = CARD
    for _ in range(60):
        deep = {"properties": {"level-with-a-long-name": deep}}
        body = {"level-with-a-long-name": body}
    with pytest.raises(PoisonMessage) as info:
        BodySchema(deep, "deep").check(body)
    assert len(info.value.detail) <= 303
    assert CARD not in str(info.value)


def test_a_validator_failure_names_its_class_only() -> None:
    money = BodySchema({"properties": {"x": {"multipleOf": 0.5}}}, "money")
    with pytest.raises(PoisonMessage) as info:
        body_payload(b'{"x": 4111111111111111e400}', BodyFormat.JSON, LIMIT, money)
    assert str(info.value) == "schema_error: the validator failed on this body (TypeError)"


def test_text_bodies_and_field_maps_are_rejected_without_their_value() -> None:
    short = BodySchema({"maxLength": 4}, "short")
    with pytest.raises(PoisonMessage) as info:
        body_payload(CARD.encode(), BodyFormat.TEXT, LIMIT, short)
    assert str(info.value) == "schema_mismatch: at /: keyword maxLength failed (schema: 4)"
    fields = BodySchema({"properties": {"card": {"pattern": "^x"}}, "required": ["sku"]}, "fields")
    with pytest.raises(PoisonMessage) as info:
        fields_payload({b"card": CARD.encode()}, LIMIT, fields)
    assert CARD not in str(info.value)
