"""Strict, typed configuration: dataclasses whose fields are checked against their annotations.

Every config object in vitlab (the model's ViTConfig now; data, optim and train configs later) is a
dataclass validated by `validate`: a wrong type or an unknown key is a `ConfigError` that names the
field, what was expected and what came.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration value or key that cannot be used."""


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return f"tuple[{_type_name(args[0])}, ...]"
        return "tuple[" + ", ".join(_type_name(a) for a in args) + "]"
    if tp is type(None):
        return "None"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any) -> tuple[bool, Any]:
    """(ok, value converted to `tp`), converting only losslessly (int -> float, list -> tuple)."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return True, value
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            ok, out = _coerce(value, arg)
            if ok:
                return True, out
        return False, value
    if origin is typing.Literal:
        return value in typing.get_args(tp), value
    if tp is type(None):
        return value is None, value
    if tp is bool:
        return isinstance(value, bool), value
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return True, float(value)
        return False, value
    if tp is str:
        return isinstance(value, str), value
    if origin is tuple:
        if not isinstance(value, (tuple, list)):
            return False, value
        args = typing.get_args(tp)
        elem_types = [args[0]] * len(value) if args[1:] == (Ellipsis,) else list(args)
        if len(elem_types) != len(value):
            return False, value
        out = []
        for v, t in zip(value, elem_types):
            ok, c = _coerce(v, t)
            if not ok:
                return False, value
            out.append(c)
        return True, tuple(out)
    if isinstance(tp, type):
        return isinstance(value, tp), value
    return True, value


def validate(obj: Any) -> None:
    """Check every field of dataclass `obj` against its type hint, converting losslessly."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        ok, converted = _coerce(value, hints[f.name])
        if not ok:
            raise ConfigError(
                f"{type(obj).__name__}.{f.name}: expected {_type_name(hints[f.name])}, "
                f"got {value!r} ({type(value).__name__})"
            )
        if converted is not value:
            object.__setattr__(obj, f.name, converted)


def check_keys(cls: type, keys: typing.Iterable[str], where: str | None = None) -> None:
    """Raise ConfigError naming any key that is not a field of dataclass `cls`."""
    names = [f.name for f in dataclasses.fields(cls)]
    for key in keys:
        if key not in names:
            close = difflib.get_close_matches(key, names, n=3, cutoff=0.5)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ConfigError(
                f"unknown key {key!r} for {where or cls.__name__}{hint} "
                f"(valid keys: {', '.join(names)})"
            )


def from_dict(cls: type[T], data: Mapping[str, Any], where: str | None = None) -> T:
    """Build dataclass `cls` from a mapping, refusing unknown keys and wrong types."""
    check_keys(cls, data.keys(), where)
    return cls(**data)


def to_dict(obj: Any) -> dict[str, Any]:
    """A plain dict of a config dataclass (tuples as lists), ready for JSON or YAML."""

    def plain(v: Any) -> Any:
        if isinstance(v, tuple):
            return [plain(x) for x in v]
        return v

    return {f.name: plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
