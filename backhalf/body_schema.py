"""Per-adapter body schemas: a JSON Schema the decoded body must satisfy, or
the message is poison (issue 4, DESIGN.md section 8).

jsonschema is the reference implementation: it reads the schema's own
``$schema`` to pick the draft (2020-12 when it names none), checks the schema
itself at start-up, and its ``best_match`` names the one error worth showing.
``format`` is an annotation, as the 2020-12 draft says, not an assertion.

Two things a producer must not be able to do through a body (issue 11.10 and
11.11, from a security review):

* **Make the ingester fetch anything.** Every ``$ref`` / ``$dynamicRef`` is
  resolved at start-up (:class:`_Crawl`): a reference outside the document is
  retrieved once, under one deadline for all of them, and kept in the
  validator's ``referencing.Registry``, whose ``retrieve`` refuses. Left to
  itself jsonschema would fetch a missing reference over the network, with
  no timeout, when a message first needs it. A reference that cannot be
  resolved at start-up is a :class:`SchemaFileError` (a config error).
* **Make one validation take unbounded time.** Each keyword function of the
  validator class is wrapped to compare ``time.monotonic()`` with the
  deadline of the running :meth:`BodySchema.check` (:func:`_timed`), so any
  keyword that recurses (``items``, ``anyOf``, ``$ref``...) stops once the
  time limit has passed, and ``uniqueItems``, quadratic in jsonschema, is
  replaced by a linear equivalent (:func:`_unique_items`). The deadline is
  per thread (:data:`_DEADLINE`, a ``threading.local``): one ``check`` runs
  at a time in a thread, so one validator may serve several worker threads.
  What cannot be interrupted is a single keyword's own work between two
  checks: one ``pattern`` regex on a long string is one C call, one
  ``enum``/``const`` comparison one walk of the value.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import math
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Hashable, Iterator
from http.client import HTTPException
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urljoin, urlsplit

from backhalf.errors import PoisonMessage

if TYPE_CHECKING:
    from jsonschema.exceptions import ValidationError
    from jsonschema.protocols import Validator
    from referencing.jsonschema import SchemaRegistry, SchemaResource

# An error message quotes the failing value, which may be most of the body.
MAX_DETAIL_CHARS = 300
# A body's validation running longer is poison (validation_timeout); the
# adapter's schema_timeout_ms.
DEFAULT_SCHEMA_TIMEOUT_MS = 1000
# All of one schema's external references together, at start-up.
FETCH_TIMEOUT_S = 10.0
# A referenced document larger than this is refused rather than read whole.
MAX_REFERENCED_BYTES = 8 * 1024 * 1024
# The keywords that point at another schema. ``$recursiveRef`` (2019-09) is
# always "#" in practice, but resolving it costs nothing and proves it.
_REFERENCE_KEYWORDS = ("$ref", "$dynamicRef", "$recursiveRef")


class SchemaFileError(Exception):
    """The schema file is missing, not JSON, not a valid JSON Schema, or one of
    its references cannot be resolved at start-up."""


class _DeadlinePassed(Exception):
    """The running check's time limit has passed; raised inside jsonschema and
    turned into ``PoisonMessage('validation_timeout', ...)`` by ``check``."""


class Abandon:
    """Lets another thread end the checks of a worker thread early: the poll
    loop, when nobody waits for that worker's batch any more (a stop, a
    failure), so the worker, and the process's exit, need not wait out the
    running message's whole ``schema_timeout_ms``. See :func:`abandonable`."""

    __slots__ = ("at", "ended")

    def __init__(self) -> None:
        self.at = math.inf  # the running check's deadline
        self.ended = False

    def end(self) -> None:
        self.ended = True
        self.at = -math.inf  # a plain store: the worker's next keyword sees it

    def start(self, timeout_s: float) -> None:
        self.at = time.monotonic() + timeout_s
        if self.ended:  # ended meanwhile: the store above must not undo it
            self.at = -math.inf


class _Deadline(threading.local):
    # The class attribute is each thread's starting value: the checks of a
    # thread that has no Abandon of its own share this one, which only
    # ``check`` in that thread writes to.
    current: Abandon | None = None

    def clock(self) -> Abandon:
        if self.current is None:
            self.current = Abandon()
        return self.current


_DEADLINE = _Deadline()


def _check_deadline() -> None:
    if time.monotonic() > _DEADLINE.clock().at:
        raise _DeadlinePassed


@contextlib.contextmanager
def abandonable(abandon: Abandon) -> Iterator[None]:
    """Within this block, this thread's checks run on ``abandon``'s clock:
    once another thread calls ``abandon.end()``, the running check stops at
    its next keyword (``validation_timeout``) and so does every later one."""
    previous = _DEADLINE.current
    _DEADLINE.current = abandon
    try:
        yield
    finally:
        _DEADLINE.current = previous


KeywordFunction = Callable[[Any, Any, Any, Any], Any]


def _timed(keyword: KeywordFunction) -> KeywordFunction:
    """``keyword`` (a jsonschema keyword function), checking the deadline
    each time it is applied. Every descent into a sub-schema applies that
    sub-schema's keywords, so a keyword that recurses is stopped within one
    sub-schema's worth of work. Kept to a closure and two lookups: it runs
    for every keyword of every sub-schema a body meets."""

    now, deadline = time.monotonic, _DEADLINE  # closure cells: cheaper than globals

    @functools.wraps(keyword)
    def timed(validator: Any, value: Any, instance: Any, schema: Any) -> Any:
        # ``current`` is set: check() set it before any keyword runs.
        if now() > deadline.current.at:  # type: ignore[union-attr]
            raise _DeadlinePassed
        return keyword(validator, value, instance, schema)

    return timed


# Tags keep the kinds of JSON value apart in a key: True == 1 in Python, and
# an array's key must never equal an object's.
_BOOL, _ARRAY, _OBJECT = "bool", "array", "object"


def _json_key(value: Any) -> Hashable:
    """A hashable key equal for two values exactly when they are equal as
    JSON (the drafts' definition, as jsonschema's ``equal``): 1, 1.0 and
    Decimal(1) are one number (Python gives equal numbers equal hashes),
    True is not 1, arrays compare in order, objects by key and value in any
    order. Recursive: bodies reach it nested at most 64 deep (normalize)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bool):  # before numbers: bool is an int subclass
        return (_BOOL, value)
    if isinstance(value, list):
        return (_ARRAY, tuple(map(_json_key, value)))
    if isinstance(value, dict):
        return (_OBJECT, frozenset((k, _json_key(v)) for k, v in value.items()))
    number: Hashable = value  # int, float, Decimal
    return number


def _first_repeat(items: list[Any]) -> tuple[int, int] | None:
    """The indexes of the first item equal to an earlier one, and of that one."""
    seen: dict[Hashable, int] = {}
    for index, item in enumerate(items):
        # One item's key is bounded by the body's size; the whole array is
        # not, relative to the time limit, so it is checked per item.
        _check_deadline()
        first = seen.setdefault(_json_key(item), index)
        if first != index:
            return first, index
    return None


def _unique_items(validator: Any, unique: Any, instance: Any, schema: Any) -> Iterator[ValidationError]:
    """``uniqueItems`` in linear time. jsonschema's compares every pair once
    the items cannot be sorted (any array of objects): 8,000 objects took
    tens of seconds. Same verdict as jsonschema's; the message names the two
    items, since it is cut at MAX_DETAIL_CHARS and jsonschema's begins with
    the whole array."""
    if not unique or not validator.is_type(instance, "array"):
        return
    repeat = _first_repeat(instance)
    if repeat is not None:
        from jsonschema.exceptions import ValidationError

        yield ValidationError(f"has non-unique elements: items {repeat[0]} and {repeat[1]} are equal")


@functools.cache
def _limited(base: type[Validator]) -> type[Validator]:
    """``base`` (the class ``$schema`` chose) with every keyword timed and a
    linear ``uniqueItems``; meta-schema, type and format checkers are kept."""
    from jsonschema import validators

    keywords: dict[str, KeywordFunction] = dict(base.VALIDATORS)
    if "uniqueItems" in keywords:
        keywords["uniqueItems"] = _unique_items
    extended: type[Validator] = validators.extend(  # type: ignore[no-untyped-call]
        base, {name: _timed(function) for name, function in keywords.items()}
    )
    return extended


class _NotRetrievedAtStartUp(LookupError):
    """A reference the start-up crawl did not retrieve (it leaves none)."""


def _refuse_at_run_time(uri: str) -> SchemaResource:
    """The registry's ``retrieve``: everything was retrieved at start-up, so
    a reference that still needs a fetch is this message's rejection
    (``schema_error``, see :meth:`BodySchema.check`), never a network call.
    referencing turns what this raises into ``Unresolvable``."""
    raise _NotRetrievedAtStartUp(f"{uri!r} was not retrieved at start-up")


def _cause(exc: BaseException, kind: type[SchemaFileError]) -> SchemaFileError | None:
    """The ``kind`` error that ``exc`` wraps: referencing wraps whatever a
    ``retrieve`` raises (Unretrievable, then Unresolvable)."""
    seen: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and len(seen) < 8 and not any(current is s for s in seen):
        if isinstance(current, kind):
            return current
        seen.append(current)
        current = current.__cause__ or current.__context__
    return None


class _Crawl:
    """Every reference of one schema, resolved once, at start-up.

    The walk mirrors what jsonschema's validator will do with the same
    ``referencing`` objects (a resolver rooted at the schema, entering each
    sub-schema with ``in_subresource``, ``lookup`` for each reference), so
    the URIs this ``retrieve`` is asked for are exactly the ones the
    validator would look up; each is fetched once and handed to the
    validator's registry (:attr:`retrieved`).

    The documents walked are the validator's own copies, and each ``$schema``
    met at a schema position is removed from them: jsonschema re-picks the
    validator class for any sub-schema carrying ``$schema`` (a ``"$ref":
    "#"`` back to the root, a retrieved document), which would leave the
    time limit and the linear ``uniqueItems`` behind for that sub-tree. It
    may only name the root's own draft, so removing it changes nothing
    else; another draft is refused."""

    def __init__(
        self, source: str, base: type[Validator], base_uri: str | None, fetch_timeout_s: float
    ) -> None:
        import referencing.jsonschema

        self.source = source
        self.base = base
        self.base_uri = base_uri
        self.fetch_timeout_s = fetch_timeout_s
        self.deadline = time.monotonic() + fetch_timeout_s
        # The specification jsonschema gives the class: its meta-schema's id
        # ("id" up to draft 4, "$id" since).
        meta = base.META_SCHEMA
        self.specification = referencing.jsonschema.specification_with(
            meta.get("$id") or meta.get("id") or "urn:unknown-dialect",
            default=referencing.Specification.OPAQUE,
        )
        self.retrieved: dict[str, SchemaResource] = {}

    def run(self, root: dict[str, Any]) -> None:
        """Walk ``root`` (the validator's copy) and everything it refers to."""
        from referencing import Registry

        # mypy does not see referencing's attrs alias (retrieve for _retrieve).
        registry: SchemaRegistry = Registry(retrieve=self.retrieve)  # type: ignore[call-arg]
        resolver = registry.resolver_with_root(self.specification.create_resource(root))
        # (contents, resolver, reference): a reference's target comes with
        # its resolver already in place, as jsonschema's descend gets it, and
        # names the reference for messages.
        todo: list[tuple[Any, Any, str | None]] = [(root, resolver, None)]
        seen: dict[int, Any] = {}  # id -> contents, kept alive so ids stay unique
        while todo:
            contents, resolver, reference = todo.pop()
            if id(contents) in seen:
                continue
            seen[id(contents)] = contents
            if reference is not None:
                self._check_target(contents, reference)
            if not isinstance(contents, dict):
                continue  # a boolean schema holds no references
            self._drop_dialect(contents)
            resource = self.specification.create_resource(contents)
            if reference is None:
                resolver = resolver.in_subresource(resource)
            for keyword in _REFERENCE_KEYWORDS:
                ref = contents.get(keyword)
                if isinstance(ref, str):
                    target = self._lookup(resolver, f"{keyword} {ref!r}", ref)
                    todo.append((target.contents, target.resolver, f"{keyword} {ref!r}"))
            todo.extend((sub.contents, resolver, None) for sub in resource.subresources())

    def _lookup(self, resolver: Any, reference: str, ref: str) -> Any:
        from referencing.exceptions import Unresolvable

        try:
            return resolver.lookup(ref)
        except Unresolvable as exc:
            wrapped = _cause(exc, SchemaFileError)
            if wrapped is not None:
                raise SchemaFileError(str(wrapped)) from exc
            raise SchemaFileError(
                f"{self.source}: {reference} does not resolve ({type(exc).__name__})"
            ) from exc

    def _check_target(self, contents: Any, reference: str) -> None:
        """A reference's target must be a schema: check_schema saw only the
        root, and the target may sit where no keyword holds a schema, or in
        another document."""
        from jsonschema.exceptions import SchemaError

        try:
            self.base.check_schema(contents)
        except SchemaError as exc:
            raise SchemaFileError(
                f"{self.source}: {reference} is not a valid JSON Schema: {exc.message}"
            ) from exc

    def _drop_dialect(self, contents: dict[str, Any]) -> None:
        from jsonschema import validators

        if "$schema" not in contents:
            return
        if validators.validator_for(contents, default=self.base) is not self.base:
            raise SchemaFileError(
                f"{self.source}: a sub-schema or referenced document declares $schema "
                f"{contents['$schema']!r}, another draft than the schema's: one draft per schema"
            )
        del contents["$schema"]

    def retrieve(self, uri: str) -> SchemaResource:
        """Called by referencing for a URI not in the registry: at most once
        per URI (referencing's registries are immutable, so another branch
        of the walk may ask again)."""
        if uri in self.retrieved:
            return self.retrieved[uri]
        where = f"{self.source}: $ref {uri!r}"
        target = uri if urlsplit(uri).scheme else self._absolute(uri, where)
        contents = self._parse(self._read(target, where), where)
        if isinstance(contents, dict):
            # Here, not only when walked: a reference to a fragment
            # ("x.json#/$defs/a") never walks the document's root.
            self._drop_dialect(contents)
        resource: SchemaResource = self.specification.create_resource(contents)
        self.retrieved[uri] = resource
        return resource

    def _absolute(self, uri: str, where: str) -> str:
        if self.base_uri is None:
            raise SchemaFileError(f"{where}: a relative reference, and the schema has no base URI")
        return urljoin(self.base_uri, uri)

    def _read(self, uri: str, where: str) -> bytes:
        parts = urlsplit(uri)
        if parts.hostname in ("json-schema.org", "www.json-schema.org"):
            # jsonschema would resolve these from its bundled copies, and run
            # them with its own classes, whose $schema escapes the time limit.
            raise SchemaFileError(f"{where}: JSON Schema's own meta-schemas cannot be referenced")
        if parts.scheme == "file":
            return self._read_file(parts.netloc, parts.path, where)
        if parts.scheme in ("http", "https"):
            return self._read_url(uri, where)
        raise SchemaFileError(f"{where}: scheme {parts.scheme!r} cannot be retrieved (file, http, https)")

    def _read_file(self, host: str, path: str, where: str) -> bytes:
        if host not in ("", "localhost"):
            raise SchemaFileError(f"{where}: a file: URI must name no host (got {host!r})")
        file = Path(urllib.request.url2pathname(path))
        try:
            if file.stat().st_size > MAX_REFERENCED_BYTES:
                raise SchemaFileError(f"{where}: larger than {MAX_REFERENCED_BYTES} bytes")
            return file.read_bytes()
        except OSError as exc:
            raise SchemaFileError(f"{where}: cannot be read ({exc.strerror or type(exc).__name__})") from exc

    def _read_url(self, uri: str, where: str) -> bytes:
        remaining = self.deadline - time.monotonic()
        late = f"{where}: no complete answer within {self.fetch_timeout_s:g} s, at start-up"
        if remaining <= 0:
            raise SchemaFileError(late)
        agent = {"User-Agent": "switchboard (schema $ref at start-up)"}
        request = urllib.request.Request(uri, headers=agent)  # noqa: S310 (http or https only, see _read)
        chunks: list[bytes] = []
        size = 0
        try:
            # The socket timeout bounds each connect and read; the deadline,
            # checked between reads, bounds a server that answers a byte at
            # a time. The scheme is http or https here (S310).
            with urllib.request.urlopen(request, timeout=remaining) as response:  # noqa: S310
                while chunk := response.read1(64 * 1024):
                    size += len(chunk)
                    if size > MAX_REFERENCED_BYTES:
                        raise SchemaFileError(f"{where}: larger than {MAX_REFERENCED_BYTES} bytes")
                    if time.monotonic() > self.deadline:
                        raise SchemaFileError(late)
                    chunks.append(chunk)
        except urllib.error.HTTPError as exc:
            raise SchemaFileError(f"{where}: HTTP {exc.code} {exc.reason}") from exc
        except TimeoutError as exc:
            raise SchemaFileError(late) from exc
        except urllib.error.URLError as exc:
            if isinstance(exc.reason, TimeoutError):
                raise SchemaFileError(late) from exc
            raise SchemaFileError(f"{where}: cannot be retrieved ({exc.reason})") from exc
        except (OSError, HTTPException, ValueError) as exc:
            raise SchemaFileError(f"{where}: cannot be retrieved ({type(exc).__name__}: {exc})") from exc
        return b"".join(chunks)

    def _parse(self, data: bytes, where: str) -> Any:
        try:
            return json.loads(data)
        except ValueError as exc:
            raise SchemaFileError(f"{where}: not JSON ({exc})") from exc


class BodySchema:
    """One adapter's schema, checked and with every reference resolved at
    construction; :meth:`check` then never does I/O and stops a validation
    that runs past ``timeout_ms``.

    ``base_uri`` is where relative references are resolved when the schema
    has no absolute ``$id``: the schema file, for :meth:`load`."""

    def __init__(
        self,
        schema: dict[str, Any],
        source: str,
        *,
        timeout_ms: int = DEFAULT_SCHEMA_TIMEOUT_MS,
        base_uri: str | None = None,
        fetch_timeout_s: float = FETCH_TIMEOUT_S,
    ) -> None:
        # Imported here: only adapters with a schema pay its slow import.
        from jsonschema import (
            Draft3Validator,
            Draft4Validator,
            Draft202012Validator,
            SchemaError,
            validators,
        )
        from jsonschema.exceptions import best_match
        from referencing import Registry
        from referencing.exceptions import Unresolvable

        base = validators.validator_for(schema, default=Draft202012Validator)
        try:
            base.check_schema(schema)
        except SchemaError as exc:
            raise SchemaFileError(f"{source}: not a valid JSON Schema: {exc.message}") from exc
        # The validator's own copy: the crawl edits it (module docstring).
        root = copy.deepcopy(schema)
        if base_uri is not None:
            # The schema's $id, resolved against where it was read from (the
            # file), becomes the base of its relative references.
            id_keyword = "id" if base in (Draft3Validator, Draft4Validator) else "$id"
            own_id = root.get(id_keyword)
            root[id_keyword] = urljoin(base_uri, own_id if isinstance(own_id, str) else "")
        crawl = _Crawl(source, base, base_uri, fetch_timeout_s)
        crawl.run(root)
        registry: SchemaRegistry = Registry(retrieve=_refuse_at_run_time)  # type: ignore[call-arg]
        registry = registry.with_resources(crawl.retrieved.items()).crawl()
        self._validator = _limited(base)(root, registry=registry)
        self.source = source
        self.timeout_ms = timeout_ms
        self._timeout_s = timeout_ms / 1000
        self._best_match = best_match
        self._unresolvable = Unresolvable  # imported once, not per check

    @classmethod
    def load(
        cls,
        path: Path,
        *,
        timeout_ms: int = DEFAULT_SCHEMA_TIMEOUT_MS,
        fetch_timeout_s: float = FETCH_TIMEOUT_S,
    ) -> BodySchema:
        try:
            schema = json.loads(path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise SchemaFileError(f"{path}: cannot be read ({exc.strerror or type(exc).__name__})") from exc
        except ValueError as exc:
            raise SchemaFileError(f"{path}: not JSON ({exc})") from exc
        if not isinstance(schema, dict):
            raise SchemaFileError(f"{path}: the schema must be a JSON object")
        return cls(
            schema,
            str(path),
            timeout_ms=timeout_ms,
            base_uri=path.absolute().as_uri(),
            fetch_timeout_s=fetch_timeout_s,
        )

    def check(self, value: Any) -> None:
        """Raise ``PoisonMessage('schema_mismatch', ...)`` unless ``value`` conforms.

        A validator that fails on the value itself (a number beyond the float
        range, kept as a ``Decimal``, against a float ``multipleOf``: a
        TypeError inside jsonschema) makes the message poison too
        (``schema_error``): it would fail the same way on every delivery. So
        does a validation still running after ``timeout_ms``
        (``validation_timeout``), and a reference that would need a fetch
        (``schema_error``; the start-up crawl leaves none)."""
        clock = _DEADLINE.clock()
        previous = clock.at  # restored: a nested check (none today) keeps its caller's
        clock.start(self._timeout_s)
        try:
            error = self._best_match(self._validator.iter_errors(value))
        except _DeadlinePassed as exc:
            raise PoisonMessage(
                "validation_timeout",
                f"validating the body took longer than schema_timeout_ms={self.timeout_ms}",
            ) from exc
        except self._unresolvable as exc:
            raise PoisonMessage(
                "schema_error",
                f"reference {exc.ref!r} was not resolved at start-up, and nothing is fetched later",
            ) from exc
        except (ArithmeticError, TypeError, ValueError) as exc:
            detail = f"{type(exc).__name__}: {exc}"[:MAX_DETAIL_CHARS]
            raise PoisonMessage("schema_error", f"the validator failed on this body: {detail}") from exc
        finally:
            if not clock.ended:
                clock.at = previous
        if error is None:
            return
        where = "/" + "/".join(str(p) for p in error.absolute_path)
        message = error.message
        if len(message) > MAX_DETAIL_CHARS:
            message = message[:MAX_DETAIL_CHARS] + "..."
        raise PoisonMessage("schema_mismatch", f"at {where}: {message}")
