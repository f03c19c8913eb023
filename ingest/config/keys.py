"""How a setting is defined and read, the same way for every table of the
config file.

A table is a :class:`Section`: its title, the frozen dataclass its keys fill
and, per attribute, a :class:`Key` (in ``typing.Annotated``, or in
``Section.keys`` for a dataclass that cannot import this module, such as
``backhalf.db.DatabaseSettings``). The attribute's type and default and its
Key are the setting's whole definition: :meth:`Section.read` checks unknown
keys, types, bounds, required keys and defaults from it, and
:mod:`ingest.config.reference` writes the config reference from it."""

from __future__ import annotations

import dataclasses
import difflib
import functools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Annotated, Any, get_args, get_origin, get_type_hints

from ingest.errors import ConfigError

Parse = Callable[[str, Any], Any]
Rule = Callable[[str, Mapping[str, Any]], None]


@dataclass(frozen=True, slots=True)
class Key:
    """How one attribute is read from its table; its type and default are the
    rest of its definition.

    Numbers: ``minimum`` N bounds an ``int`` (``must be an integer >= N``);
    ``minimum=None`` takes any number above 0 of the declared type (a
    ``float`` a fraction too: ``must be a positive number``), the wording of
    ``[ingest]`` and ``[acker]``. ``zero`` also allows 0 (``off``);
    ``maximum`` bounds it above. ``parse`` replaces the check that follows
    from the type (``str``: a non-empty string), for keys whose values are a
    choice or a shape. ``rule`` runs after the key, given or not, with the
    values read so far: a rule across keys. ``required`` is what the message
    for a missing required key adds (without it, the key's own check refuses
    the missing value). ``env`` names a variable that takes the key's place
    when set (the message then names the variable).

    ``modes`` (adapters): where the key applies. Given for another mode it is
    an error naming the adapter and the key, and only where it applies is it
    published (``public``); None: every mode. ``transports`` narrows it the
    same way where transports share a mode's name (``queue``); None: every
    transport of those modes.

    ``doc`` is the key's one line in the config reference; ``default_doc`` and
    ``type_doc`` say there what the default and the type cannot say
    themselves (a default made from other keys; a check of its own);
    ``default_doc`` may be a function, for a default each transport says."""

    modes: tuple[str, ...] | None = None
    transports: tuple[str, ...] | None = None
    minimum: int | None = 1
    maximum: int | None = None
    zero: bool = False
    public: bool = True  # adapters: published in ``adapters.settings``
    toml: str | None = None  # the key in the table, if not the attribute's name
    parse: Parse | None = None
    rule: Rule | None = None
    required: str | None = None
    env: str | None = None
    doc: str = ""
    default_doc: str | Callable[[], str] | None = None
    type_doc: str | None = None

    def applies_to(self, mode: str, transport: str | None = None) -> bool:
        """Whether the key applies to ``mode`` (of ``transport``, where given)."""
        if self.modes is not None and mode not in self.modes:
            return False
        return transport is None or self.transports is None or transport in self.transports


class Derived:
    """Marks an attribute that is no key: it is computed from other keys."""


def string(where: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where}: must be a non-empty string (got {value!r})")
    return value


def positive_int(where: str, value: Any, *, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{where}: must be an integer >= {minimum} (got {value!r})")
    return value


def positive_number(where: str, value: Any, kind: type) -> Any:
    """A positive number of the field's declared type: a ``float`` field takes
    an integer or a fraction, an ``int`` field only an integer."""
    allowed = (int, float) if kind is float else (int,)
    if isinstance(value, bool) or not isinstance(value, allowed) or value <= 0:
        noun = "number" if kind is float else "integer"
        raise ConfigError(f"{where}: must be a positive {noun} (got {value!r})")
    return value


def _bounded(key: Key, kind: type) -> Parse:
    """The check of a number: its type, then the Key's bounds."""
    minimum, maximum = key.minimum, key.maximum

    def number(where: str, value: Any) -> Any:
        if key.zero and value == 0 and not isinstance(value, bool):
            return 0
        if minimum is None:
            checked = positive_number(where, value, kind)
            if maximum is not None and checked > maximum:
                raise ConfigError(f"{where} must be at most {maximum} (got {value!r})")
            return checked
        checked = positive_int(where, value, minimum=minimum)
        if maximum is not None and checked > maximum:
            raise ConfigError(f"{where} must be at most {maximum}")
        return checked

    return number


def close_match(value: Any, known: Iterable[str]) -> str | None:
    """The known name closest to a typo (``bach_size``: ``batch_size``), by
    difflib's ratio at its default cutoff, or None when none is close: the
    one place a config error learns its "did you mean"."""
    if not isinstance(value, str) or not value:
        return None
    found = difflib.get_close_matches(value, sorted(known), n=1)
    return found[0] if found else None


def got(value: Any, choices: Iterable[str]) -> str:
    """The tail of a refused choice's message: ``(got 'lsit')``, and
    ``(got 'lsit'; did you mean 'list'?)`` when one choice is close."""
    near = close_match(value, choices)
    return f"(got {value!r})" if near is None else f"(got {value!r}; did you mean {near!r}?)"


def check_keys(where: str, table: Mapping[str, Any], allowed: set[str]) -> None:
    """An unknown key is an error naming it, with the closest allowed key
    when one is close, else every allowed key (the message stays one line)."""
    unknown = sorted(set(table) - allowed)
    if not unknown:
        return
    near = close_match(unknown[0], allowed)
    hint = f"did you mean {near!r}?" if near is not None else f"allowed: {', '.join(sorted(allowed))}"
    raise ConfigError(f"{where}: unknown key {unknown[0]!r} ({hint})")


@dataclass(frozen=True, slots=True)
class Setting:
    """One key, as read from its attribute's definition."""

    attr: str
    name: str  # the key in the table
    key: Key
    kind: Any  # the declared type, without its Key
    default: Any  # dataclasses.MISSING: required, or made by a factory
    required: bool
    parse: Parse


def boolean(where: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{where}: must be true or false (got {value!r})")
    return value


def _parser(where: str, kind: Any, key: Key) -> Parse:
    """The check that follows from an attribute's type."""
    if key.parse is not None:
        return key.parse
    if kind is str:
        return string
    if kind is bool:
        return boolean
    if kind is int or (kind is float and key.minimum is None):
        return _bounded(key, kind)
    raise TypeError(f"{where}: no check for type {kind!r}: give its Key a parse")


@dataclass(frozen=True, eq=False)
class Section:
    """One table of the config file: its ``title`` as the reference writes
    it, the dataclass whose attributes its keys are and, for a dataclass
    that cannot import :class:`Key` (``backhalf``'s), ``keys``: each
    attribute's Key, or None for one that is no key, in the order they are
    checked. ``intro`` is the reference's paragraph under the title."""

    title: str
    cls: type
    intro: str = ""
    keys: Mapping[str, Key | None] | None = None

    @functools.cached_property
    def settings(self) -> tuple[Setting, ...]:
        """The keys, in the order they are checked: of several errors in a
        table, the first is reported."""
        hints = get_type_hints(self.cls, include_extras=True)
        fields = {f.name: f for f in dataclasses.fields(self.cls)}
        order = list(self.keys) if self.keys is not None else list(fields)
        if set(order) != set(fields):
            raise TypeError(f"{self.cls.__name__}: {self.title}'s keys must name each field once")
        settings = []
        for attr in order:
            f, hint, key = fields[attr], hints[attr], None
            extras = get_args(hint)[1:] if get_origin(hint) is Annotated else ()
            kind = get_args(hint)[0] if extras else hint
            if self.keys is not None:
                key = self.keys[attr]
            elif not any(isinstance(e, Derived) for e in extras):
                key = next((e for e in extras if isinstance(e, Key)), None)
                if key is None:
                    raise TypeError(f"{self.cls.__name__}.{attr}: a setting needs a Key (or Derived())")
            if key is None:
                continue
            required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            where = f"{self.cls.__name__}.{attr}"
            settings.append(
                Setting(attr, key.toml or attr, key, kind, f.default, required, _parser(where, kind, key))
            )
        return tuple(settings)

    def names(self) -> frozenset[str]:
        return frozenset(s.name for s in self.settings)

    def public_values(self, holder: object, mode: str) -> dict[str, Any]:
        """``holder``'s public keys that apply to ``mode`` and are set, an
        enum by its value: what ``adapters.settings`` shows of them."""
        public: dict[str, Any] = {}
        for s in self.settings:
            value = getattr(holder, s.attr)
            if s.key.public and s.key.applies_to(mode) and value is not None:
                public[s.name] = value.value if isinstance(value, Enum) else value
        return public

    def read(
        self,
        label: str,
        raw: Mapping[str, Any],
        *,
        defaults: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        context: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The values of table ``raw``, by attribute: checked, defaults filled.
        ``label`` begins each message (``[ingest]``, ``adapter 'orders'``);
        ``defaults`` are those that depend on the rest of the file, checked
        as if given. ``context``: values of the same table read by another
        section (an adapter's shared keys, for its transport's own): its
        rules and the mode check see them; they are not returned."""
        check_keys(label, raw, set(self.names()))
        table = {**(defaults or {}), **raw}
        env = env or {}
        values: dict[str, Any] = dict(context or {})
        for s in self.settings:
            where = f"{label}: key {s.name!r}"
            if s.name in raw and "mode" in values and not s.key.applies_to(values["mode"]):
                # DESIGN.md 6b: a key that does not apply to the adapter's mode
                # is an error naming it, never silently ignored.
                modes = " or ".join(repr(m) for m in s.key.modes or ())
                raise ConfigError(
                    f"{where} does not apply to mode = {values['mode']!r} (it applies to mode {modes})"
                )
            transports = s.key.transports
            if (
                s.name in raw
                and transports is not None
                and values.get("transport", transports[0]) not in transports
            ):
                named = " or ".join(repr(t) for t in transports)
                raise ConfigError(
                    f"{where} does not apply to transport = {values['transport']!r} (it applies to"
                    f" transport {named})"
                )
            if s.key.env is not None and env.get(s.key.env):
                values[s.attr] = s.parse(s.key.env, env[s.key.env])
            elif s.name in table:
                values[s.attr] = s.parse(where, table[s.name])
            elif s.required and s.key.required is not None:
                raise ConfigError(f"{where} is required ({s.key.required})")
            elif s.required:  # refused, with what was expected
                values[s.attr] = s.parse(where, None)
            elif s.default is not dataclasses.MISSING:
                values[s.attr] = s.default
            if s.key.rule is not None:
                s.key.rule(label, values)
        return {s.attr: values[s.attr] for s in self.settings if s.attr in values}


def table(raw: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    """Top-level table ``name`` of the file, empty when absent."""
    value = raw.get(name, {})
    if not isinstance(value, Mapping):
        raise ConfigError(f"[{name}]: must be a table")
    return value


MAX_RETAIN_DAYS = 36_500  # a century; more is a typo, and overflows a timedelta soon after
DAYS_TYPE = f"number > 0, <= {MAX_RETAIN_DAYS}"  # the config reference's type of a days key


def days(where: str, value: Any) -> float:
    """A number of days, fractional allowed (0.5 is twelve hours)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= MAX_RETAIN_DAYS:
        raise ConfigError(f"{where} must be a number of days, > 0 and <= {MAX_RETAIN_DAYS} (got {value!r})")
    return float(value)
