"""Building frozen config dataclasses from JSON dicts: unknown keys, did-you-mean, type checks."""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from dstrain.errors import ConfigError, NotImplementedConfigError

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

__all__ = [
    "build",
    "check_bool",
    "check_choice",
    "check_float",
    "check_int",
    "reject_unknown",
]

T = TypeVar("T", bound="DataclassInstance")


def reject_unknown(
    data: Mapping[str, Any],
    known: Iterable[str],
    unimplemented: Iterable[str],
    prefix: str,
) -> None:
    """Raise for the first key of ``data`` that is not in ``known``.

    A key in ``unimplemented`` raises `NotImplementedConfigError`; any other unknown key raises
    `ConfigError` with the closest known names as a did-you-mean.
    """
    if not isinstance(data, Mapping):
        raise ConfigError(prefix or "<config>", f"expected a JSON object, got {type(data).__name__}")
    known = list(known)
    unimplemented = set(unimplemented)
    for key in data:
        if key in known:
            continue
        field = f"{prefix}.{key}" if prefix else str(key)
        if key in unimplemented:
            raise NotImplementedConfigError(
                field, "is a DeepSpeed option dstrain recognises but has not implemented yet; remove it"
            )
        close = difflib.get_close_matches(str(key), known + sorted(unimplemented), n=3, cutoff=0.6)
        hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        raise ConfigError(field, f"unknown key{hint} (known: {', '.join(sorted(known))})")


def build(cls: type[T], data: Mapping[str, Any] | None, prefix: str, **extra: Any) -> T:
    """Construct dataclass ``cls`` from ``data``, rejecting keys that are not fields of ``cls``.

    ``cls`` may define a ``_UNIMPLEMENTED`` ClassVar of DeepSpeed keys that are recognised but not
    implemented, and ``_ALIASES`` mapping JSON names to field names.
    """
    data = {} if data is None else data
    aliases: dict[str, str] = getattr(cls, "_ALIASES", {})
    names = [f.name for f in dataclasses.fields(cls) if f.init and f.name not in extra]
    reject_unknown(data, names + list(aliases), getattr(cls, "_UNIMPLEMENTED", ()), prefix)
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
