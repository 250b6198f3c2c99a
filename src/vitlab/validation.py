"""Typed dataclass validation, which every config in vitlab (models' configs, the run's sections)
goes through: `validate` checks each field against its annotation, converting only losslessly;
`check_keys` / `from_dict` refuse unknown keys, naming the close ones. A wrong type or an unknown
key is a `ConfigError` naming field, expected and given."""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import re
import reprlib
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration value or key that cannot be used."""


def pair(size: int | tuple[int, int]) -> tuple[int, int]:
    """(height, width) of a size given as one side or as a pair (img_size, window_size)."""
    return (size, size) if isinstance(size, int) else (size[0], size[1])


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
    if tp is float:  # NaN, inf: no setting
        ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        return ok, float(value) if ok else value
    if tp is str:  # a path object (pathlib's, from Python) as the text it names
        value = os.fspath(value) if isinstance(value, os.PathLike) else value
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


def validate(
    obj: Any, values: Mapping[str, Any] | None = None, section: str | None = None
) -> dict[str, Any]:
    """Check every field of dataclass `obj` against its type hint, converting losslessly; with
    `values` (some fields' values, `obj` its class), check and return those converted instead.
    A field is named as `section.field` (`section`, else the class's `config_section`: a run
    config's section, `data.hflip`, as the user wrote it), else as `Class.field`."""
    in_place, cls = values is None, obj if values is not None else type(obj)
    if in_place:
        values = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    hints, out = typing.get_type_hints(cls), {}
    for name, value in values.items():
        ok, out[name] = _coerce(value, hints[name])
        if not ok:
            finite = isinstance(value, float) and not math.isfinite(value)  # nan, inf
            why = ": numbers must be finite" if finite else _quoted(value, hints[name])
            where = section or getattr(cls, "config_section", cls.__name__)
            raise ConfigError(
                f"{where}.{name.rstrip('_')}: expected {_type_name(hints[name])}, got "
                f"{shown(value)} ({type(value).__name__}){why}"
            )
        if in_place and out[name] is not value:
            object.__setattr__(obj, name, out[name])
    return out


# YAML 1.2's numbers as text (digits' underscores kept), which overrides.yaml_loader reads as
# numbers; PyYAML's own resolvers are YAML 1.1's, where 1e-3 is text and 012 octal 10
INT_TEXT = re.compile(r"^[-+]?(?:[0-9][0-9_]*|0o[0-7][0-7_]*|0x[0-9a-fA-F][0-9a-fA-F_]*)$")
FLOAT_TEXT = re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*\.[0-9_]*|\.[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)?
                        |[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+
                        |[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$""", re.X)  # fmt: skip


def _quoted(value: Any, tp: Any) -> str:
    """What to do about a number in quotes, which is text (config files and KEY=VALUE alike),
    for a field that takes a number."""
    numeric = tp in (int, float) or any(a in (int, float) for a in typing.get_args(tp))
    if numeric and isinstance(value, str) and (INT_TEXT.match(value) or FLOAT_TEXT.match(value)):
        return ": a number in quotes is text; write it without them"
    return ""


def check_keys(
    cls: type, keys: typing.Iterable[str], where: str | None = None, also: tuple[str, ...] = ()
) -> None:
    """Raise ConfigError naming any key that is not a field of dataclass `cls` (or in `also`:
    keys the caller takes itself, such as a run config's model.name)."""
    names = [*also, *(f.name for f in dataclasses.fields(cls))]
    for key in keys:
        if not isinstance(key, str):
            raise ConfigError(f"keys of {where or cls.__name__} are names, got {key!r}")
        if key not in names:
            close = difflib.get_close_matches(key, names, n=3)  # (0.5 offered pool for foo)
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
    return {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}


def _plain(v: Any) -> Any:
    return [_plain(x) for x in v] if isinstance(v, tuple) else v


def json_text(obj: Any, indent: int | None = 2, **options: Any) -> str:
    """`obj` as JSON with NaN and infinities as null: Python's json writes NaN, which JSON does not
    have (other readers refuse the whole text), e.g. the loss of a model whose weights hold NaN."""
    return json.dumps(_finite(obj), indent=indent, allow_nan=False, **options)


def _finite(v: Any) -> Any:
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    return [_finite(x) for x in v] if isinstance(v, list | tuple) else v


_SHOWN = reprlib.Repr()  # (Python 3.11's takes no arguments)
_SHOWN.maxlevel, _SHOWN.maxlist, _SHOWN.maxtuple, _SHOWN.maxdict = 3, 8, 8, 8
_SHOWN.maxstring = _SHOWN.maxother = 200


def shown(value: Any) -> str:
    """repr(value) for a message, cut short: a file's 323 bytes of YAML aliases expand to a list
    whose whole repr took 56 MB): a few levels of 8 items, 300 characters in all."""
    text = _SHOWN.repr(value)
    return text if len(text) <= 300 else f"{text[:297]}..."


def few(names: typing.Sequence[str], n: int = 4) -> str:
    """The first `n` names, joined for a message, ", ..." where more follow."""
    return ", ".join(names[:n]) + (", ..." if len(names) > n else "")
