"""Per-adapter body schemas: config loading, references resolved at load, the
poison verdict and the time limit on it."""

from __future__ import annotations

import ctypes
import http.server
import json
import re
import socket
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema._keywords
import jsonschema._legacy_keywords
import jsonschema._utils
import pytest
from jsonschema import Draft202012Validator

from backhalf.errors import PoisonMessage
from backhalf.writes.body_schema import Abandon, BodySchema, SchemaFileError, abandonable
from backhalf.writes.normalize import BodyFormat, body_payload, fields_payload
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
        (b'{"order_id": 7}', 'at /: keyword required failed (missing: ["qty"])'),
        (b'{"order_id": "7", "qty": 1}', 'at /order_id: keyword type failed (schema: "integer")'),
        (b'{"order_id": 7, "qty": -0.5}', "at /qty: keyword minimum failed (schema: 0)"),
        (b"[1, 2]", 'at /: keyword type failed (schema: "object")'),
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
    with pytest.raises(PoisonMessage, match=r'keyword required failed \(missing: \["sku"\]\)'):
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


# Issue 11.10: references are resolved at start-up, never while messages arrive.


@pytest.fixture
def silent_server() -> Iterator[str]:
    """An HTTP base URL on 127.0.0.1 whose server accepts connections and
    never answers (a request to it waits until its client gives up)."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.1)  # the accept loop sees the stop flag this often
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            accepted.append(conn)

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(5)
        listener.close()
        for conn in accepted:
            conn.close()


class DocumentServer:
    """JSON documents served over HTTP on 127.0.0.1, every request counted."""

    def __init__(self, documents: dict[str, Any]) -> None:
        self.hits: list[str] = []
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                server.hits.append(self.path)
                if self.path not in documents:
                    self.send_error(404)
                    return
                body = json.dumps(documents[self.path]).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/schema+json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # the test reads hits, not stderr

        self._http = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._http.serve_forever, args=(0.05,), daemon=True)
        self._thread.start()
        self.url = f"http://127.0.0.1:{self._http.server_address[1]}"
        self._stopped = False

    def stop(self) -> None:
        if not self._stopped:
            self._stopped = True
            self._http.shutdown()
            self._http.server_close()
            self._thread.join(5)


ORDER_DOCUMENTS = {
    # Its own $schema (the same draft), and a reference relative to itself.
    "/order.json": {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "type": "object",
        "required": ["id"],
        "properties": {"id": {"$ref": "common.json#/$defs/id"}},
    },
    "/common.json": {"$defs": {"id": {"type": "integer", "minimum": 1}}},
}


@pytest.fixture
def documents() -> Iterator[DocumentServer]:
    server = DocumentServer(ORDER_DOCUMENTS)
    try:
        yield server
    finally:
        server.stop()


def test_a_reference_to_a_server_that_never_answers_fails_at_load_within_the_timeout(
    silent_server: str,
) -> None:
    """It froze the ingester for 24 s when a message arrived, deaf to SIGTERM;
    now the schema does not load, and the ingester does not start (exit 2)."""
    started = time.monotonic()
    with pytest.raises(SchemaFileError) as info:
        BodySchema({"$ref": f"{silent_server}/order.json"}, "orders.json", fetch_timeout_s=0.5)
    assert time.monotonic() - started < 5  # the 0.5 s, with room for a loaded machine
    assert str(info.value).startswith(f"orders.json: $ref '{silent_server}/order.json': no complete answer")


def test_a_remote_reference_is_fetched_once_at_load_and_never_while_validating(
    documents: DocumentServer,
) -> None:
    url = documents.url
    orders = BodySchema(
        {
            "type": "array",
            "prefixItems": [{"$ref": f"{url}/order.json#/properties/id"}],
            "items": {"$ref": f"{url}/order.json"},
        },
        "orders",
    )
    # Each document once, though order.json is referenced twice.
    assert sorted(documents.hits) == ["/common.json", "/order.json"]

    def validate_some() -> None:
        for _ in range(3):
            orders.check([1, {"id": 3}, {"id": 4}])
            for body, where in (([0], "/0"), ([1, {"id": 0}], "/1/id"), ([1, {}], "/1")):
                with pytest.raises(PoisonMessage) as info:
                    orders.check(body)
                assert str(info.value).startswith(f"schema_mismatch: at {where}: ")

    validate_some()
    assert len(documents.hits) == 2
    documents.stop()
    validate_some()
    assert len(documents.hits) == 2


def test_relative_references_resolve_against_the_schema_file_at_load(tmp_path: Path) -> None:
    (tmp_path / "parts").mkdir()
    (tmp_path / "common").mkdir()
    (tmp_path / "order.json").write_text(json.dumps({"$ref": "parts/line.json"}))
    (tmp_path / "parts" / "line.json").write_text(
        json.dumps({"type": "object", "properties": {"sku": {"$ref": "../common/defs.json#/$defs/sku"}}})
    )
    (tmp_path / "common" / "defs.json").write_text(
        json.dumps({"$defs": {"sku": {"type": "string", "pattern": "^[A-Z]"}}})
    )
    orders = BodySchema.load(tmp_path / "order.json")
    for referenced in ("parts/line.json", "common/defs.json"):
        (tmp_path / referenced).unlink()  # read at load: never needed again
    orders.check({"sku": "A1"})
    with pytest.raises(PoisonMessage, match=r"^schema_mismatch: at /sku: keyword pattern failed"):
        orders.check({"sku": "a1"})


@pytest.mark.parametrize(
    ("ref", "needle"),
    [
        ("#/$defs/missing", "$ref '#/$defs/missing' does not resolve"),
        ("missing.json", "missing.json': cannot be read"),
        ("ftp://example.com/s.json", "scheme 'ftp' cannot be retrieved"),
        ("http://127.0.0.1:1/s.json", "$ref 'http://127.0.0.1:1/s.json': cannot be retrieved"),
        ("https://json-schema.org/draft/2020-12/schema", "meta-schemas cannot be referenced"),
        ("#/properties/qty/const", "$ref '#/properties/qty/const' is not a valid JSON Schema"),
    ],
)
def test_a_reference_unresolvable_at_load_is_a_config_error_naming_it(
    tmp_path: Path, ref: str, needle: str
) -> None:
    path = tmp_path / "order.json"
    path.write_text(json.dumps({"properties": {"qty": {"const": 5}, "order_id": {"$ref": ref}}}))
    db = {"url": "postgresql://sb@localhost/sb"}
    with pytest.raises(ConfigError) as info:
        from_mapping({"database": db, "adapters": [adapter_with(str(path))]}, {})
    message = str(info.value)
    assert message.startswith(f"adapter 'orders': key 'schema': {path}: ")
    assert needle in message
    assert "\n" not in message


def test_a_sub_schema_of_another_draft_is_refused() -> None:
    """jsonschema would switch validator class under it, and leave the time
    limit behind (test_the_time_limit_holds_through_a_reference_to_the_root)."""
    with pytest.raises(SchemaFileError, match="another draft than the schema's"):
        BodySchema(
            {
                "$schema": "https://json-schema.org/draft/2020-12/schema",
                "properties": {"a": {"$ref": "#/$defs/old"}},
                "$defs": {"old": {"$schema": "http://json-schema.org/draft-07/schema#", "type": "string"}},
            },
            "mixed",
        )


def test_a_reference_that_would_need_a_fetch_at_run_time_is_a_rejection_never_a_fetch(
    documents: DocumentServer,
) -> None:
    """The crawl leaves no such reference; this is the net under it, reached
    by swapping in a validator whose schema was never crawled."""
    orders = schema(ORDER)
    orders._validator = orders._validator.evolve(schema={"$ref": f"{documents.url}/order.json"})
    with pytest.raises(PoisonMessage) as info:
        orders.check({"id": 1})
    assert info.value.reason == "schema_error"
    assert "was not resolved at start-up" in info.value.detail
    assert documents.hits == []


# Issue 11.11: what a producer controls cannot make validation take unbounded time.

UNIQUE = {"type": "array", "uniqueItems": True}


@pytest.mark.parametrize(
    ("items", "unique"),
    [
        ([1, 1.0], False),
        ([0.5, 0.5], False),
        ([-0.0, 0], False),
        ([True, 1], True),
        ([False, 0], True),
        ([None, False], True),
        (["1", 1], True),
        ([True, True], False),
        ([{"a": 1, "b": [1, 2]}, {"b": [1, 2], "a": 1}], False),  # key order does not matter
        ([{"a": True}, {"a": 1}], True),
        ([{"a": 1}, {"a": 1, "b": 2}], True),
        ([[1, 2], [2, 1]], True),  # array order does
        ([[1], [1.0]], False),
        ([[], {}], True),
        ([[True], [1]], True),
    ],
)
def test_unique_items_is_json_equality(items: list[Any], unique: bool) -> None:
    assert Draft202012Validator(UNIQUE).is_valid(items) is unique  # the draft, as jsonschema reads it
    if unique:
        schema(UNIQUE).check(items)
    else:
        with pytest.raises(
            PoisonMessage,
            match=r"^schema_mismatch: at /: keyword uniqueItems failed \(items 0 and 1 are equal\)$",
        ):
            schema(UNIQUE).check(items)


def test_unique_items_compares_numbers_beyond_the_float_range() -> None:
    body_payload(b"[1e400, 1e401]", BodyFormat.JSON, LIMIT, schema(UNIQUE))
    with pytest.raises(PoisonMessage, match="keyword uniqueItems failed"):
        body_payload(b"[1e400, 1E+400]", BodyFormat.JSON, LIMIT, schema(UNIQUE))


def test_unique_items_over_8000_objects_compares_no_pair(monkeypatch: pytest.MonkeyPatch) -> None:
    """jsonschema compared every pair of an array of objects: 2,000 / 4,000 /
    8,000 took 2.5 / 10 / 38 s on the event loop. Its pairwise ``equal`` is
    counted rather than the clock read: a linear check calls it never."""
    calls = 0
    pairwise = jsonschema._utils.equal

    def counted(one: Any, two: Any) -> bool:
        nonlocal calls
        calls += 1
        if calls > 1000:
            raise AssertionError("uniqueItems compared items pairwise")
        return bool(pairwise(one, two))

    monkeypatch.setattr(jsonschema._utils, "equal", counted)
    items = [{"id": i, "name": f"n{i}", "tags": [i % 7, "x"]} for i in range(8000)]
    orders = schema(UNIQUE)
    orders.check(items)
    duplicate = {"tags": [0, "x"], "name": "n0", "id": 0.0}  # items[0], its keys reordered, id a float
    with pytest.raises(PoisonMessage, match="items 0 and 8000 are equal"):
        orders.check([*items, duplicate])
    assert calls == 0


def nested_arrays(depth: int) -> list[Any]:
    body: list[Any] = []
    for _ in range(depth):
        body = [body]
    return body


# Both branches of anyOf recurse, and the first fails only after its items
# were checked: each level doubles the work, 2**30 sub-schemas for a body of
# 30 nested arrays (hours), against a limit of milliseconds. The root's
# $schema and the "$ref": "#" are the shape that used to slip out of the
# limit (jsonschema re-picked the validator class at the root).
SLOW = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "anyOf": [
        {"type": "array", "items": {"$ref": "#"}, "minItems": 1000},
        {"type": "array", "items": {"$ref": "#"}},
    ],
}


def test_the_time_limit_holds_through_a_reference_to_the_root(tmp_path: Path) -> None:
    path = tmp_path / "slow.json"
    path.write_text(json.dumps(SLOW))
    db = {"url": "postgresql://sb@localhost/sb"}
    raw = adapter_with(str(path), schema_timeout_ms=10)
    slow = from_mapping({"database": db, "adapters": [raw]}, {}).adapters[0].body_schema
    assert slow is not None
    assert body_payload(json.dumps(nested_arrays(3)).encode(), BodyFormat.JSON, LIMIT, slow)
    with pytest.raises(PoisonMessage) as info:
        body_payload(json.dumps(nested_arrays(30)).encode(), BodyFormat.JSON, LIMIT, slow)
    assert str(info.value).startswith("validation_timeout: ")
    assert "schema_timeout_ms=10" in str(info.value)


def test_the_time_limit_is_per_thread() -> None:
    """Checks in another thread, with a limit of their own, neither lengthen
    this thread's deadline nor inherit it: one validator may serve several
    worker threads."""
    slow = BodySchema(SLOW, "slow", timeout_ms=50)
    patient = BodySchema(SLOW, "patient", timeout_ms=60_000)
    stop = threading.Event()
    failures: list[str] = []
    quick = 0

    def check_quick_ones() -> None:
        nonlocal quick
        give_up = time.monotonic() + 10  # were the deadline shared, the slow check would end only now
        while not stop.is_set() and time.monotonic() < give_up:
            try:
                patient.check(nested_arrays(2))
                slow.check(nested_arrays(2))
            except PoisonMessage as exc:
                failures.append(str(exc))
            quick += 1

    other = threading.Thread(target=check_quick_ones, daemon=True)
    other.start()
    try:
        with pytest.raises(PoisonMessage, match=r"^validation_timeout: "):
            slow.check(nested_arrays(30))
        assert other.is_alive()  # stopped by its own deadline, while the other thread ran
    finally:
        stop.set()
        other.join(15)
    assert not other.is_alive()
    assert quick > 0
    assert failures == []


def test_schema_timeout_ms_is_an_adapter_key_at_least_1(tmp_path: Path) -> None:
    path = tmp_path / "order.json"
    path.write_text(json.dumps(ORDER))
    db = {"url": "postgresql://sb@localhost/sb"}
    default = from_mapping({"database": db, "adapters": [adapter_with(str(path))]}, {}).adapters[0]
    assert default.schema_timeout_ms == 1000
    assert default.body_schema is not None
    assert default.body_schema.timeout_ms == 1000
    assert default.public_settings()["schema_timeout_ms"] == 1000
    raw = adapter_with(str(path), schema_timeout_ms=250)
    assert from_mapping({"database": db, "adapters": [raw]}, {}).adapters[0].body_schema.timeout_ms == 250  # type: ignore[union-attr]
    with pytest.raises(ConfigError, match=r"key 'schema_timeout_ms': must be an integer >= 1 \(got 0\)"):
        from_mapping({"database": db, "adapters": [adapter_with(str(path), schema_timeout_ms=0)]}, {})


# A body cannot buy a long match either: jsonschema's regex calls run under
# the check's limit, and release the GIL while they match.

# Backtracking tries every way to split the a's into "a" and "aa" before the
# "!" fails the match: a Fibonacci number of them. Sized so that a match
# nothing stops still ends in seconds (about 1.5 s with re, 4.5 s with
# regex, on the machine this was written on): a regression fails the test,
# it does not hang it. The marker is a backstop only: no signal handler runs
# while one C call holds the thread.
CATASTROPHIC = "^(a|aa)+$"
SLOW_TEXT = "a" * 34 + "!"
SLOW_KEY = {SLOW_TEXT: 1}


def stopped_in(exc: PoisonMessage) -> list[str]:
    """Where the time limit stopped the check: ``file:function`` of each frame."""
    deadline = exc.__cause__
    assert deadline is not None
    return [f"{Path(f.filename).name}:{f.name}" for f in traceback.extract_tb(deadline.__traceback__)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("doc", "body", "where"),
    [
        ({"type": "string", "pattern": CATASTROPHIC}, SLOW_TEXT, "_keywords.py:pattern"),
        ({"patternProperties": {CATASTROPHIC: {}}}, SLOW_KEY, "_keywords.py:patternProperties"),
        # These come first, so the match is theirs, not patternProperties'.
        (
            {"additionalProperties": False, "patternProperties": {CATASTROPHIC: {}}},
            SLOW_KEY,
            "_utils.py:find_additional_properties",
        ),
        (
            {"unevaluatedProperties": False, "patternProperties": {CATASTROPHIC: {}}},
            SLOW_KEY,
            "_utils.py:find_evaluated_property_keys_by_schema",
        ),
        (
            {
                "$schema": "https://json-schema.org/draft/2019-09/schema",
                "unevaluatedProperties": False,
                "patternProperties": {CATASTROPHIC: {}},
            },
            SLOW_KEY,
            "_legacy_keywords.py:find_evaluated_property_keys_by_schema",
        ),
    ],
)
def test_a_catastrophic_pattern_is_stopped_within_the_match(
    doc: dict[str, Any], body: Any, where: str
) -> None:
    """One re.search is one C call: the limit, checked between keywords, came
    only once it had returned (or never: a pattern was the last keyword),
    however long it took. Now the match itself times out."""
    bounded = BodySchema(doc, "redos", timeout_ms=50)
    started = time.monotonic()
    with pytest.raises(PoisonMessage) as info:
        bounded.check(body)
    assert str(info.value).startswith("validation_timeout: ")
    assert "schema_timeout_ms=50" in str(info.value)
    # Inside the match, by its timeout, not at a keyword after it.
    assert info.value.__cause__ is not None
    assert isinstance(info.value.__cause__.__cause__, TimeoutError)
    assert where in stopped_in(info.value)
    assert time.monotonic() - started < 10  # 50 ms of CPU, with room for a loaded machine


@pytest.mark.timeout(60)
def test_a_long_match_lets_other_threads_run() -> None:
    """re holds the GIL through a match, so the event loop froze with it. The
    switch interval is set far longer than the check here: the other thread
    can run during the check only if the match lets the GIL go."""
    bounded = BodySchema({"type": "string", "pattern": CATASTROPHIC}, "redos", timeout_ms=200)
    count = 0
    stop = threading.Event()

    def counting() -> None:
        nonlocal count
        while not stop.is_set():
            count += 1
            time.sleep(0.0001)  # lets the GIL go each turn, so the check gets it back

    interval = sys.getswitchinterval()
    other = threading.Thread(target=counting, daemon=True)
    sys.setswitchinterval(20)
    try:
        other.start()
        before = count
        with pytest.raises(PoisonMessage) as info:
            bounded.check(SLOW_TEXT)
        advanced = count - before
    finally:
        stop.set()
        sys.setswitchinterval(interval)
        other.join(10)
    assert advanced > 0
    assert str(info.value).startswith("validation_timeout: ")


def test_ordinary_patterns_still_validate() -> None:
    skus = BodySchema(
        {
            "type": "object",
            "properties": {"sku": {"type": "string", "pattern": r"^[A-Z]{2}-\d+$"}},
            "patternProperties": {"^x-": {"type": "string"}},
            "additionalProperties": False,
        },
        "skus",
    )
    skus.check({"sku": "AB-12", "x-note": "fine"})
    for body, expected in (
        ({"sku": "ab-12"}, r'schema_mismatch: at /sku: keyword pattern failed (schema: "^[A-Z]{2}-\\d+$")'),
        # A key only the body holds is not shown: it is the body's content.
        ({"sku": "AB-12", "x-note": 5}, 'schema_mismatch: at /*: keyword type failed (schema: "string")'),
        (
            {"sku": "AB-12", "note": "x"},
            "schema_mismatch: at /: keyword additionalProperties failed (schema: false)",
        ),
    ):
        with pytest.raises(PoisonMessage) as info:
            skus.check(body)
        assert str(info.value) == expected
    tagged = BodySchema({"patternProperties": {"^t[0-9]$": True}, "unevaluatedProperties": False}, "tags")
    tagged.check({"t1": 1, "t2": 2})
    with pytest.raises(PoisonMessage) as info:
        tagged.check({"t1": 1, "tx": 2})
    assert str(info.value) == "schema_mismatch: at /: keyword unevaluatedProperties failed (schema: false)"


def test_a_pattern_that_does_not_compile_is_refused_at_load() -> None:
    """Draft 4 does not check patternProperties' keys: this schema loaded, and
    every object body then failed inside the validator (re.error), on every
    delivery, a crash rather than a rejection."""
    with pytest.raises(SchemaFileError, match=r"^old: pattern '\(' does not compile: "):
        BodySchema(
            {"$schema": "http://json-schema.org/draft-04/schema#", "patternProperties": {"(": {}}}, "old"
        )


def test_the_bounded_search_is_installed_once_and_is_re_otherwise() -> None:
    schema(ORDER)
    bounded = vars(jsonschema._keywords)["re"]
    assert bounded is not re
    assert vars(jsonschema._utils)["re"] is bounded
    assert vars(jsonschema._legacy_keywords)["re"] is bounded
    assert bounded.compile is re.compile
    assert bounded.IGNORECASE is re.IGNORECASE
    schema(ORDER)
    assert vars(jsonschema._keywords)["re"] is bounded
    # Outside a check there is no limit, and re itself answers.
    assert bounded.search("^a", "ab") is not None
    assert Draft202012Validator({"pattern": "^a"}).is_valid("ab")


# The limit counts the checking thread's CPU time: waiting for the GIL is not
# the body's doing.


def hold_the_gil(seconds: float) -> None:
    """Sleep without letting the GIL go, as a C extension busy in one call
    does: through ctypes.PyDLL, which keeps the GIL across the call."""
    libc = ctypes.PyDLL(None)
    libc.usleep(ctypes.c_uint(int(seconds * 1_000_000)))


@pytest.mark.timeout(60)
def test_time_spent_waiting_for_the_gil_does_not_count_against_the_body() -> None:
    """With time.monotonic, a good body was rejected validation_timeout when
    another thread held the GIL while it validated."""
    items = BodySchema({"type": "array", "items": {"type": "integer", "minimum": 0}}, "items", timeout_ms=200)
    body = list(range(3000))  # some milliseconds of CPU: the other thread takes the GIL meanwhile
    go = threading.Event()

    def hold() -> None:
        go.wait(10)
        hold_the_gil(0.5)

    other = threading.Thread(target=hold, daemon=True)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.001)
    try:
        other.start()
        go.set()
        started = time.monotonic()
        items.check(body)
        elapsed = time.monotonic() - started
    finally:
        sys.setswitchinterval(interval)
        other.join(10)
    assert elapsed > 0.2  # the check did wait out the other thread, past its limit in wall time


def test_another_thread_ends_a_check_under_way() -> None:
    """Abandon.end, as the poll loop calls it on stop: the running check ends
    at one of its next keywords, long before its own limit."""
    patient = BodySchema(SLOW, "patient", timeout_ms=60_000)
    abandon = Abandon()
    outcome: list[str] = []
    running = threading.Event()

    def validate() -> None:
        with abandonable(abandon):
            running.set()
            try:
                patient.check(nested_arrays(30))
            except PoisonMessage as exc:
                outcome.append(str(exc))

    worker = threading.Thread(target=validate, daemon=True)
    worker.start()
    assert running.wait(10)
    time.sleep(0.05)
    started = time.monotonic()
    abandon.end()
    worker.join(10)
    assert not worker.is_alive()
    assert time.monotonic() - started < 5
    assert len(outcome) == 1
    assert outcome[0].startswith("validation_timeout: ")
    # And every later check of that thread ends at once.
    with abandonable(abandon), pytest.raises(PoisonMessage, match=r"^validation_timeout: "):
        schema(ORDER).check({"order_id": 1, "qty": 1})


# Credentials in a reference never reach a message.


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("http://user:s3cret@127.0.0.1:{port}/x.json", "127.0.0.1:{port}/x.json"),
        # No port: http.client reads "s3cret@127.0.0.1" as one, and its
        # InvalidURL text quotes it.
        ("http://user:s3cret@127.0.0.1/x.json", "127.0.0.1/x.json"),
        ("http://s3cret@127.0.0.1:{port}/x.json", "127.0.0.1:{port}/x.json"),
        ("http://127.0.0.1:{port}/x.json?token=s3cret", "127.0.0.1:{port}/x.json"),
        # A control character: http.client's InvalidURL text quotes the path and query.
        ("http://127.0.0.1:{port}/x.json?token=s3cret\x01", "127.0.0.1:{port}/x.json"),
    ],
)
def test_a_reference_s_credentials_are_not_in_its_error(url: str, shown: str) -> None:
    port = closed_port()
    url, shown = url.format(port=port), shown.format(port=port)
    with pytest.raises(SchemaFileError) as info:
        BodySchema({"properties": {"a": {"$ref": url}}}, "orders.json", fetch_timeout_s=5)
    message = str(info.value)
    assert message.startswith("orders.json: ")
    assert shown in message
    assert "s3cret" not in message
    # Nor in what a traceback would print: the causes quote the URI too.
    assert "s3cret" not in "".join(traceback.format_exception(info.value))


def test_a_reference_s_credentials_are_not_in_a_run_time_rejection(documents: DocumentServer) -> None:
    orders = schema(ORDER)
    orders._validator = orders._validator.evolve(
        schema={"$ref": "http://user:s3cret@127.0.0.1:1/o.json?k=s3cret"}
    )
    with pytest.raises(PoisonMessage) as info:
        orders.check({"id": 1})
    assert info.value.reason == "schema_error"
    assert "127.0.0.1:1/o.json" in info.value.detail
    assert "s3cret" not in info.value.detail
