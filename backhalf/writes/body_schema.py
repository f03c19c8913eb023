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
  validator class is wrapped to compare the thread's CPU time with the
  deadline of the running :meth:`BodySchema.check` (:func:`_timed`), so any
  keyword that recurses (``items``, ``anyOf``, ``$ref``...) stops once the
  time limit has passed, and ``uniqueItems``, quadratic in jsonschema, is
  replaced by a linear equivalent (:func:`_unique_items`). The deadline is
  per thread (:data:`_DEADLINE`, a ``threading.local``): one ``check`` runs
  at a time in a thread, so one validator may serve several worker threads.
  CPU time, not the wall clock: a body is not charged for the time its
  thread waits for the GIL or the CPU (:data:`CLOCK_EVERY`).
  Each regex jsonschema runs on the body (``pattern``, ``patternProperties``
  and the ``additionalProperties`` / ``unevaluatedProperties`` that consult
  it) runs in the ``regex`` package instead of ``re``, under the time left
  and without the GIL (:class:`_BoundedSearch`): one catastrophic match on
  a short string would otherwise hold the whole process, event loop
  included, for as long as it takes. What cannot be interrupted is a
  single keyword's own work between two checks: one ``enum``/``const``
  comparison is one walk of the value.

What a rejection says carries no message content (issue 32.6): it reaches
the inbox's ``error``, which the auditor's ``audit_rejected`` view shows,
and the logs. jsonschema's messages quote the failing value (``'4111 1111
1111 1111' is not of type 'integer'``), so a ``schema_mismatch`` is told
from the error's structure instead (:func:`_mismatch`): where (the JSON
path, each key the schema itself does not hold shown as ``*``), which
keyword failed, and the schema's own value for it, never the body's.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import math
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Hashable, Iterable, Iterator
from http.client import HTTPException
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any
from urllib.parse import urljoin, urlsplit

from backhalf.errors import PoisonMessage

if TYPE_CHECKING:
    from jsonschema.exceptions import ValidationError
    from jsonschema.protocols import Validator
    from referencing.jsonschema import SchemaRegistry, SchemaResource

# A rejection's detail is cut here (a path 64 deep, a long schema value).
MAX_DETAIL_CHARS = 300
# The schema's value for the failing keyword (an enum, a pattern) is cut here.
MAX_EXPECTED_CHARS = 120
# A key in a rejection's path that the schema does not hold: the body's own
# text, never shown.
HIDDEN_KEY = "*"
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
# The clock of the time limit is the checking thread's CPU time
# (time.thread_time): time spent waiting for the GIL (another thread in a
# long C call) or for the CPU (a loaded machine) is not the body's doing,
# and counting it rejected good bodies as poison. Reading it is a system
# call (no vDSO path for CLOCK_THREAD_CPUTIME_ID): measured 0.77 us against
# 0.10 us for time.monotonic, which made the keyword wrapper 5.6 times as
# costly (870 ns a keyword, was 155). So the clock is read once every
# CLOCK_EVERY keyword applications, counted down on the thread's Abandon:
# 32 keeps the wrapper's cost where it was (150-170 ns) and adds at most 31
# keywords' own work to an overrun, microseconds next to a limit in
# milliseconds.
CLOCK_EVERY = 32
# The least time a regex match is given (see _BoundedSearch.search), so a
# short match right at the end of the budget is not failed for no work.
MIN_MATCH_TIMEOUT_S = 0.001


class SchemaFileError(Exception):
    """The schema file is missing, not JSON, not a valid JSON Schema, one of
    its references cannot be resolved at start-up, or one of its patterns
    does not compile."""


class _DeadlinePassed(Exception):
    """The running check's time limit has passed; raised inside jsonschema and
    turned into ``PoisonMessage('validation_timeout', ...)`` by ``check``."""


class Abandon:
    """Lets another thread end the checks of a worker thread early: the poll
    loop, when nobody waits for that worker's batch any more (a stop, a
    failure), so the worker, and the process's exit, need not wait out the
    running message's whole ``schema_timeout_ms``. See :func:`abandonable`."""

    __slots__ = ("at", "countdown", "ended")

    def __init__(self) -> None:
        # The running check's deadline, in its thread's CPU time
        # (time.thread_time); inf between checks.
        self.at = math.inf
        self.countdown = 0  # keyword applications until the clock is next read
        self.ended = False

    def end(self) -> None:
        self.ended = True
        # Plain stores, seen by the worker's next reading of the clock, which
        # the countdown brings forward to its next keyword (or, should the
        # worker's own decrement overwrite it, within CLOCK_EVERY of them).
        self.at = -math.inf
        self.countdown = 0

    def start(self, timeout_s: float) -> None:
        """Called by the thread that checks: the clock is its own."""
        self.at = time.thread_time() + timeout_s
        if self.ended:  # ended meanwhile: the store above must not undo it
            self.at = -math.inf
            self.countdown = 0  # and the first keyword reads the clock


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
    """The keyword wrappers' test (:func:`_timed`), for a loop inside one keyword."""
    clock = _DEADLINE.clock()
    clock.countdown -= 1
    if clock.countdown < 0:
        clock.countdown = CLOCK_EVERY
        if time.thread_time() > clock.at:
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
    each time it is applied (the clock itself every CLOCK_EVERY times).
    Every descent into a sub-schema applies that sub-schema's keywords, so
    a keyword that recurses is stopped within one sub-schema's worth of
    work. Kept to a closure and few lookups: it runs for every keyword of
    every sub-schema a body meets."""

    now, deadline, every = time.thread_time, _DEADLINE, CLOCK_EVERY  # closure cells: cheaper than globals

    @functools.wraps(keyword)
    def timed(validator: Any, value: Any, instance: Any, schema: Any) -> Any:
        # ``current`` is set: check() set it before any keyword runs.
        clock: Abandon = deadline.current  # type: ignore[assignment]
        clock.countdown -= 1
        if clock.countdown < 0:
            clock.countdown = every
            if now() > clock.at:
                raise _DeadlinePassed
        return keyword(validator, value, instance, schema)

    return timed


# The jsonschema modules that call ``re.search`` on what a body holds: a
# ``pattern`` on its strings, ``patternProperties`` (and the
# ``additionalProperties`` / ``unevaluatedProperties`` that consult it, in
# _utils, and for 2019-09 in _legacy_keywords) on its keys.
_SEARCHING_MODULES = ("jsonschema._keywords", "jsonschema._utils", "jsonschema._legacy_keywords")


def _regex() -> Any:
    """The ``regex`` package, imported on first use (it has no type stubs)."""
    import regex  # type: ignore[import-untyped]

    return regex


@functools.lru_cache(maxsize=1024)
def _compiled(pattern: str, flags: int) -> Any:
    """``pattern`` compiled by ``regex``, once. regex.search does not compile
    it again either (regex's own cache, keyed by pattern and flags), but
    finds it there through some Python-level work on every call: a search
    on a short string, with a timeout and concurrent, took 7.3 us that way,
    3.0 us from here (and the whole of _BoundedSearch.search 5.2 us,
    re.search 0.6 to 0.8 us)."""
    return _regex().compile(pattern, flags)


class _BoundedSearch:
    """Stands for the ``re`` module in jsonschema's modules that search what a
    body holds (_SEARCHING_MODULES, see :func:`_bound_jsonschema_searches`).

    Why: ``re`` matches in one C call that holds the GIL and that nothing
    interrupts, and a backtracking pattern takes exponential time on a
    short string (``^(a|aa)+$`` against 34 a's and a "!": 1.5 s, 40 a's
    about half a minute). The keyword wrappers check the limit only
    between keywords, so one such body stopped the whole process, event
    loop included, whatever ``schema_timeout_ms`` said. Within a check,
    :meth:`search` matches with the ``regex`` package instead, which
    releases the GIL while it matches (``concurrent=True``) and gives up at
    a timeout: what the check has left, turned into the same deadline
    exception the wrappers raise (so ``validation_timeout``).

    Outside a check (no deadline in this thread: another validator, the
    meta-schema check at start-up) it is ``re.search`` itself, and every
    other attribute is ``re``'s. regex matches as ``re`` does (its VERSION0
    is compatible with it) and accepts a superset of its syntax; the
    crawl compiles every pattern with it at start-up (_Crawl._compile)."""

    def __init__(self, real: ModuleType) -> None:
        self._re = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self._re, name)

    def search(self, pattern: Any, string: Any, flags: int = 0) -> Any:
        clock = _DEADLINE.current
        at = math.inf if clock is None else clock.at
        if at == math.inf:
            return self._re.search(pattern, string, flags)
        remaining = at - time.thread_time()
        if remaining <= 0:
            raise _DeadlinePassed
        # regex's timeout is wall-clock time, the budget CPU time: a match
        # is given what CPU time the check has left as wall-clock time. It
        # runs without the GIL, so only a machine short of CPU makes the two
        # differ (and then the match is stopped early, never late).
        try:
            return _compiled(pattern, flags).search(
                string, concurrent=True, timeout=max(remaining, MIN_MATCH_TIMEOUT_S)
            )
        except TimeoutError as exc:
            raise _DeadlinePassed from exc


_BOUNDED_RE = _BoundedSearch(re)


def _bound_jsonschema_searches() -> None:
    """Put :data:`_BOUNDED_RE` in place of ``re`` in jsonschema's searching
    modules; once per process (idempotent), when the first BodySchema is
    built. It imports ``regex`` now, not at the first message: about 20 ms
    (12 to 28 measured with -X importtime), paid only by a process with an
    adapter that has a schema, as jsonschema's own import is."""
    import importlib

    _regex()
    for name in _SEARCHING_MODULES:
        names = vars(importlib.import_module(name))
        if names["re"] is not _BOUNDED_RE:
            names["re"] = _BOUNDED_RE


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
    items by index, never by value (jsonschema's begins with the whole
    array), and a rejection quotes it (:func:`_mismatch`)."""
    if not unique or not validator.is_type(instance, "array"):
        return
    repeat = _first_repeat(instance)
    if repeat is not None:
        from jsonschema.exceptions import ValidationError

        yield ValidationError(f"items {repeat[0]} and {repeat[1]} are equal")


# What a schema's value for a keyword may be for a rejection to quote it.
_PLAIN = (str, int, float, bool, type(None))


def _schema_strings(documents: Iterable[Any]) -> frozenset[str]:
    """Every string the schema's documents hold, as a key or a value. A key
    of the body that is one of them is the schema's word, not the body's
    content, and a rejection's path may show it."""
    found: set[str] = set()
    todo = list(documents)
    while todo:
        item = todo.pop()
        if isinstance(item, str):
            found.add(item)
        elif isinstance(item, dict):
            found.update(key for key in item if isinstance(key, str))
            todo.extend(item.values())
        elif isinstance(item, list):
            todo.extend(item)
    return frozenset(found)


def _shown_path(path: Iterable[str | int], known: frozenset[str]) -> str:
    """A JSON Pointer (RFC 6901) to the failing value: array indexes and the
    keys the schema holds as they are, any other key as HIDDEN_KEY."""
    steps = []
    for step in path:
        if isinstance(step, int):
            steps.append(str(step))
        elif step in known:
            steps.append(step.replace("~", "~0").replace("/", "~1"))
        else:
            steps.append(HIDDEN_KEY)
    return "/" + "/".join(steps)


def _schema_value(value: Any) -> str | None:
    """The schema's value for a keyword as JSON, when it is a plain value or
    a list of them (a type, a bound, a pattern, an enum, ``false``), cut to
    MAX_EXPECTED_CHARS; None for a sub-schema or a list of them."""
    if not isinstance(value, _PLAIN) and not (
        isinstance(value, list) and all(isinstance(v, _PLAIN) for v in value)
    ):
        return None
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=False)
    except ValueError:
        return None
    return text if len(text) <= MAX_EXPECTED_CHARS else text[:MAX_EXPECTED_CHARS] + "..."


def _mismatch(error: ValidationError, known: frozenset[str]) -> str:
    """A schema_mismatch's detail, from the error's structure, never its
    message (jsonschema's quote the value): where, which keyword failed, and
    what the schema asks there. ``at /order_id: keyword type failed (schema:
    "integer")``."""
    where = _shown_path(error.absolute_path, known)
    keyword, expected = error.validator, error.validator_value
    if not isinstance(keyword, str):  # a schema that is ``false``
        return f"at {where}: the schema allows no value here (false)"
    if keyword == "required" and isinstance(expected, list) and isinstance(error.instance, dict):
        # The names come from the schema; the body's own keys are not listed.
        missing = [name for name in expected if isinstance(name, str) and name not in error.instance]
        return f"at {where}: keyword required failed (missing: {_schema_value(missing)})"
    if keyword == "uniqueItems":  # always _unique_items (see _limited): its message names indexes only
        return f"at {where}: keyword uniqueItems failed ({error.message})"
    shown = _schema_value(expected)
    return f"at {where}: keyword {keyword} failed" + ("" if shown is None else f" (schema: {shown})")


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


# A URI's scheme and authority up to its userinfo's "@" (urlsplit's split:
# the netloc ends at the first "/", "?" or "#", the userinfo at its last "@").
_USERINFO = re.compile(r"^([\x00-\x20]*(?:[A-Za-z][A-Za-z0-9+.\-]*:)?//)[^/?#]*@")


def _redacted(uri: str) -> str:
    """``uri`` as a message may quote it: its userinfo (``user:password@``)
    and its query, where credentials travel, are ``***``; the scheme, host,
    port, path and fragment are kept, to name the document. Messages reach
    the logs, the console and the inbox."""
    rest, hash_mark, fragment = uri.partition("#")
    rest, question_mark, _query = rest.partition("?")
    rest = _USERINFO.sub(r"\1***@", rest, count=1)
    return f"{rest}{question_mark}{'***' if question_mark else ''}{hash_mark}{fragment}"


class _NotRetrievedAtStartUp(LookupError):
    """A reference the start-up crawl did not retrieve (it leaves none)."""


def _refuse_at_run_time(uri: str) -> SchemaResource:
    """The registry's ``retrieve``: everything was retrieved at start-up, so
    a reference that still needs a fetch is this message's rejection
    (``schema_error``, see :meth:`BodySchema.check`), never a network call.
    referencing turns what this raises into ``Unresolvable``."""
    raise _NotRetrievedAtStartUp(f"{_redacted(uri)!r} was not retrieved at start-up")


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
    validator's registry (:attr:`retrieved`). Every URI a message quotes is
    :func:`_redacted`, and no error raised here chains the exception of
    urllib, http.client or referencing it replaces: their texts quote the
    URI whole.

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
            self._compile(contents)
            resource = self.specification.create_resource(contents)
            if reference is None:
                resolver = resolver.in_subresource(resource)
            for keyword in _REFERENCE_KEYWORDS:
                ref = contents.get(keyword)
                if isinstance(ref, str):
                    reference = f"{keyword} {_redacted(ref)!r}"
                    target = self._lookup(resolver, reference, ref)
                    todo.append((target.contents, target.resolver, reference))
            todo.extend((sub.contents, resolver, None) for sub in resource.subresources())

    def _lookup(self, resolver: Any, reference: str, ref: str) -> Any:
        from referencing.exceptions import Unresolvable

        try:
            return resolver.lookup(ref)
        except Unresolvable as exc:
            # Not chained: referencing's exceptions quote the reference whole,
            # credentials and query included, and a traceback would print it.
            wrapped = _cause(exc, SchemaFileError)
            if wrapped is not None:
                raise SchemaFileError(str(wrapped)) from None
            raise SchemaFileError(
                f"{self.source}: {reference} does not resolve ({type(exc).__name__})"
            ) from None

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

    def _compile(self, contents: dict[str, Any]) -> None:
        """Compile, as :class:`_BoundedSearch` will, each regex this schema
        applies to bodies: one that does not compile would fail every body
        (regex accepts what re does, but draft 4 and earlier do not check
        patternProperties' keys at all)."""
        patterns = [contents["pattern"]] if isinstance(contents.get("pattern"), str) else []
        keyed = contents.get("patternProperties")
        if isinstance(keyed, dict) and keyed:
            patterns += keyed
            if "additionalProperties" in contents:
                patterns.append("|".join(keyed))  # one search, in jsonschema's additionalProperties
        for pattern in patterns:
            try:
                _compiled(pattern, 0)
            except _regex().error as exc:
                raise SchemaFileError(f"{self.source}: pattern {pattern!r} does not compile: {exc}") from exc

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
        where = f"{self.source}: $ref {_redacted(uri)!r}"
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
            if "@" in parts.netloc:
                # urllib would not send them as credentials, but look the
                # whole of "user:password@host" up as a host name (DNS).
                raise SchemaFileError(f"{where}: a URI with credentials (user:password@) cannot be retrieved")
            return self._read_url(uri, where)
        raise SchemaFileError(f"{where}: scheme {parts.scheme!r} cannot be retrieved (file, http, https)")

    def _read_file(self, host: str, path: str, where: str) -> bytes:
        if host not in ("", "localhost"):
            shown = host.rpartition("@")[2]  # not its userinfo
            raise SchemaFileError(f"{where}: a file: URI must name no host (got {shown!r})")
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
        # Only causes that cannot quote the URL are chained (urllib's and
        # http.client's exceptions keep it, credentials and query included,
        # and a chained cause is printed with any traceback), and
        # only texts that cannot quote the URL are: the socket layer's (an
        # OSError: errno and strerror) and urllib's own reasons (fixed
        # phrases). http.client's are dropped: its InvalidURL quotes the
        # host and port, or the path and query, as given.
        except urllib.error.HTTPError as exc:
            raise SchemaFileError(f"{where}: HTTP {exc.code} {exc.reason}") from None
        except TimeoutError as exc:  # the socket's: no URL in it
            raise SchemaFileError(late) from exc
        except urllib.error.URLError as exc:
            if isinstance(exc.reason, TimeoutError):
                raise SchemaFileError(late) from exc.reason
            raise SchemaFileError(f"{where}: cannot be retrieved ({exc.reason})") from None
        except OSError as exc:
            raise SchemaFileError(f"{where}: cannot be retrieved ({type(exc).__name__}: {exc})") from None
        except (HTTPException, ValueError) as exc:
            raise SchemaFileError(f"{where}: cannot be retrieved ({type(exc).__name__})") from None
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

        _bound_jsonschema_searches()
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
        self._known = _schema_strings([root, *(r.contents for r in crawl.retrieved.values())])
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
        """Raise ``PoisonMessage('schema_mismatch', ...)`` unless ``value``
        conforms, naming where and which keyword failed, never the value
        (:func:`_mismatch`).

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
                f"reference {_redacted(exc.ref)!r} was not resolved at start-up, "
                "and nothing is fetched later",
            ) from exc
        except (ArithmeticError, TypeError, ValueError) as exc:
            # Its class only: the exception's text may quote the value.
            raise PoisonMessage(
                "schema_error", f"the validator failed on this body ({type(exc).__name__})"
            ) from exc
        finally:
            if not clock.ended:
                clock.at = previous
        if error is None:
            return
        detail = _mismatch(error, self._known)
        if len(detail) > MAX_DETAIL_CHARS:
            detail = detail[:MAX_DETAIL_CHARS] + "..."
        raise PoisonMessage("schema_mismatch", detail)
