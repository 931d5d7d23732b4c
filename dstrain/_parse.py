"""Building frozen config dataclasses from JSON dicts: unknown keys, did-you-mean, type checks.

The schema of a section is its dataclass, a subclass of `Section`, plus its three ClassVars (empty
unless the section says otherwise), read here and by `dstrain.config_reference` (README's config
reference table):

- ``_UNBUILT: dict[str, Unbuilt]``: DeepSpeed keys of features dstrain has not built. Accepted, with
  one INFO line "accepted, no effect: ...", when the value asks for nothing (DeepSpeed's default, or
  a section switched off); refused with `NotImplementedConfigError` when it asks for the feature. A
  room that builds the feature removes its entry and parses the key itself (a field or a section).
- ``_NO_EFFECT: dict[str, str]``: fields parsed and validated that change nothing in dstrain, with
  why; present in a config, each is logged once at INFO.
- ``_ALIASES: dict[str, str]``: JSON names accepted for a field (DeepSpeed's other spelling), to the
  field's name.

Every other field is honoured.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from dstrain.errors import ConfigError, NotImplementedConfigError

__all__ = [
    "Section",
    "Unbuilt",
    "build",
    "check_bool",
    "check_choice",
    "check_float",
    "check_int",
    "forget_notes",
    "note_no_effect",
    "reject_unknown",
]

log = logging.getLogger("dstrain.config")


@dataclass(frozen=True, kw_only=True, slots=True)
class Unbuilt:
    """A DeepSpeed key of a feature dstrain has not built: what values ask for nothing."""

    why: str
    """What the feature is and why it has no effect here (shown in the log line and the reference)."""
    default: Any = None
    """DeepSpeed's default: a value, or for a section (a dict) the defaults of its keys."""
    switch: str | None = None
    """A section's on/off key (``"enabled"``): the section switched off asks for nothing."""
    also: tuple[Any, ...] = ()
    """Other values that ask for nothing (e.g. ``False`` where DeepSpeed's default is ``None``)."""
    any_value: bool = False
    """Every value is accepted: the key only tunes something dstrain does its own way."""
    check: Callable[[Any], bool] | None = None
    """Extra acceptance test of a value (e.g. ``0`` for "off")."""

    def accepts(self, value: Any) -> bool:
        """True when ``value`` asks for nothing dstrain would have to build."""
        if (
            self.any_value
            or value is None
            or _same(value, self.default)
            or any(_same(value, a) for a in self.also)
        ):
            return True
        if self.check is not None and self.check(value):
            return True
        if isinstance(self.default, dict) and isinstance(value, Mapping):
            if self.switch is not None and value.get(self.switch) is False:
                return True
            return all(k in self.default and _same(v, self.default[k]) for k, v in value.items())
        return False

    def accepted_values(self) -> str:
        """The values `accepts`, in words."""
        if self.any_value:
            return "any value"
        if isinstance(self.default, dict):
            if self.switch is not None:
                return f'absent, null, or "{self.switch}": false'
            return "absent, null, or every key at DeepSpeed's default"
        values = [self.default, *self.also]
        return " or ".join(_json(v) for v in values)


class Section:
    """The base of every config section's dataclass: the schema's three ClassVars (module docstring),
    empty unless the section declares its own. `build` and `dstrain.config_reference` read them."""

    __slots__ = ()
    _ALIASES: ClassVar[Mapping[str, str]] = MappingProxyType({})
    _UNBUILT: ClassVar[Mapping[str, Unbuilt]] = MappingProxyType({})
    _NO_EFFECT: ClassVar[Mapping[str, str]] = MappingProxyType({})
    if TYPE_CHECKING:  # every section is a dataclass (dataclasses.fields reads it)
        __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]


S = TypeVar("S", bound=Section)


def _same(a: Any, b: Any) -> bool:
    """JSON equality (``1 == 1.0``, but ``true`` is not ``1``)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def _json(value: Any) -> str:
    import json

    try:
        return json.dumps(value)
    except TypeError:
        return repr(value)


_noted: set[str] = set()


def forget_notes() -> None:
    """Log every `note_no_effect` line again (tests that check them)."""
    _noted.clear()


def note_no_effect(field: str, value: Any, why: str) -> None:
    """Log once per process at INFO that ``field`` was accepted and has no effect, and why."""
    line = f"accepted, no effect: {field}={_json(value)} ({why})"
    if line not in _noted:
        _noted.add(line)
        log.info("%s", line)


def reject_unknown(
    data: Mapping[str, Any],
    known: Iterable[str],
    unbuilt: Mapping[str, Unbuilt] | Iterable[str],
    prefix: str,
) -> dict[str, Any]:
    """``data`` without its accepted `Unbuilt` keys; raises for the first key that is not in ``known``.

    An `Unbuilt` key whose value asks for the feature raises `NotImplementedConfigError` (a plain
    name in ``unbuilt`` always does); any other unknown key raises `ConfigError` with the closest
    known names as a did-you-mean.
    """
    if not isinstance(data, Mapping):
        raise ConfigError(prefix or "<config>", f"expected a JSON object, got {type(data).__name__}")
    known = list(known)
    specs: Mapping[str, Unbuilt | None] = unbuilt if isinstance(unbuilt, Mapping) else dict.fromkeys(unbuilt)
    kept: dict[str, Any] = {}
    for key, value in data.items():
        if key in known:
            kept[key] = value
            continue
        field = f"{prefix}.{key}" if prefix else str(key)
        if key in specs:
            spec = specs[key]
            if spec is None:
                raise NotImplementedConfigError(
                    field, "is a DeepSpeed option dstrain recognises but has not implemented yet; remove it"
                )
            if not spec.accepts(value):
                raise NotImplementedConfigError(
                    field,
                    f"{spec.why}; dstrain has not built this: it accepts {spec.accepted_values()} "
                    f"(got {_json(value)})",
                )
            note_no_effect(field, value, spec.why)
            continue
        close = difflib.get_close_matches(str(key), known + sorted(specs), n=3, cutoff=0.6)
        hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        raise ConfigError(field, f"unknown key{hint} (known: {', '.join(sorted(known))})")
    return kept


def build(cls: type[S], data: Mapping[str, Any] | None, prefix: str, **extra: Any) -> S:
    """Construct the section dataclass ``cls`` from ``data``, rejecting keys that are not fields of
    ``cls``: its ``_UNBUILT``, ``_NO_EFFECT`` and ``_ALIASES`` say what else is accepted (see the module
    docstring)."""
    data = {} if data is None else data
    aliases = cls._ALIASES
    names = [f.name for f in dataclasses.fields(cls) if f.init and f.name not in extra]
    data = reject_unknown(data, names + list(aliases), cls._UNBUILT, prefix)
    for key, why in cls._NO_EFFECT.items():
        if key in data:
            note_no_effect(_field(prefix, key), data[key], why)
    kwargs = {aliases.get(k, k): v for k, v in data.items()}
    kwargs.update(extra)
    for f in dataclasses.fields(cls):
        missing = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if f.init and missing and f.name not in kwargs:
            raise ConfigError(_field(prefix, f.name), "is required")
    return cls(**kwargs)


def _field(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def check_bool(prefix: str, name: str, value: object) -> None:
    """Raise `ConfigError` unless ``value`` is a bool."""
    if not isinstance(value, bool):
        raise ConfigError(_field(prefix, name), f"expected true or false, got {value!r}")


def check_int(prefix: str, name: str, value: object, *, min_value: int | None = None) -> None:
    """Raise `ConfigError` unless ``value`` is an int (floats with integral value are accepted) >= min."""
    ok = isinstance(value, int) and not isinstance(value, bool)
    ok = ok or (isinstance(value, float) and value.is_integer())
    if not ok:
        raise ConfigError(_field(prefix, name), f"expected an integer, got {value!r}")
    if min_value is not None and value < min_value:  # type: ignore[operator]
        raise ConfigError(_field(prefix, name), f"must be >= {min_value}, got {value!r}")


def check_float(
    prefix: str,
    name: str,
    value: object,
    *,
    min_value: float | None = None,
    max_value: float | None = None,
    strict_min: bool = False,
) -> None:
    """Raise `ConfigError` unless ``value`` is a number in range."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise ConfigError(_field(prefix, name), f"expected a number, got {value!r}")
    if not math.isfinite(value):
        raise ConfigError(_field(prefix, name), f"expected a finite number, got {value!r}")
    if min_value is not None and (value <= min_value if strict_min else value < min_value):
        op = ">" if strict_min else ">="
        raise ConfigError(_field(prefix, name), f"must be {op} {min_value}, got {value!r}")
    if max_value is not None and value > max_value:
        raise ConfigError(_field(prefix, name), f"must be <= {max_value}, got {value!r}")


def check_choice(prefix: str, name: str, value: object, choices: Iterable[object]) -> None:
    """Raise `ConfigError` unless ``value`` is one of ``choices``."""
    choices = list(choices)
    if value not in choices:
        raise ConfigError(
            _field(prefix, name), f"expected one of {', '.join(repr(c) for c in choices)}, got {value!r}"
        )
