"""Command-line overrides: `section.key=value` items, each value as YAML reads it, applied to a
config tree (vitlab.config reads the tree from a file and checks it; `vitlab convert` takes the
same items for a checkpoint's fields)."""

from __future__ import annotations

import functools
import typing
from collections.abc import Mapping
from typing import Any

from vitlab.validation import FLOAT_TEXT, INT_TEXT, ConfigError, shown

# YAML 1.2's numbers (validation's INT_TEXT, FLOAT_TEXT): PyYAML resolves YAML 1.1's, where 1e-3
# is text, 012 octal 10 and 1:30 sexagesimal 90 (`time_budget: 1:30` was 90 seconds, said nowhere)
_INT_TAG, _FLOAT_TAG = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"


def _numbers_of_yaml_1_2(cls: type, only: bool = True) -> type:
    """`cls` (a PyYAML loader or dumper class) resolving plain scalars to numbers as YAML 1.2
    does, in place (`only`: instead of YAML 1.1's, else beside them): a dumper then quotes the
    text a loader would read as a number."""
    if only:
        cls.yaml_implicit_resolvers = {
            first: [(tag, r) for tag, r in resolvers if tag not in (_INT_TAG, _FLOAT_TAG)]
            for first, resolvers in cls.yaml_implicit_resolvers.items()
        }
    cls.add_implicit_resolver(_INT_TAG, INT_TEXT, list("-+0123456789"))
    cls.add_implicit_resolver(_FLOAT_TAG, FLOAT_TEXT, list("-+0123456789."))
    return cls


@functools.cache
def yaml_loader() -> type:
    """PyYAML's safe loader (libyaml's where built) reading numbers as YAML 1.2 does: 1e-3 a
    float, 012 twelve, 0o12 octal, 0x40 hex, 1:30 text; booleans, nulls and the rest as before."""
    import yaml

    class Loader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
        def construct_yaml_int(self, node):
            text = self.construct_scalar(node).replace("_", "")
            sign, digits = (-1, text[1:]) if text[0] == "-" else (1, text.lstrip("+"))
            base = {"0o": 8, "0x": 16}.get(digits[:2].lower(), 10)
            return sign * int(digits[2:] if base != 10 else digits, base)

    Loader.add_constructor(_INT_TAG, Loader.construct_yaml_int)
    return _numbers_of_yaml_1_2(Loader)


@functools.cache
def yaml_dumper() -> type:
    """PyYAML's safe dumper quoting what yaml_loader reads as a number, and what YAML 1.1 does
    (its own quoting is 1.1's only: the text '1e5' or '0o7' went out plain and came back a
    number)."""
    import yaml

    class Dumper(yaml.SafeDumper):
        pass

    # YAML 1.1's resolvers kept beside 1.2's: text either reads as a number is quoted (1:30 too,
    # for PyYAML's safe_load and vitlab before YAML 1.2's numbers)
    return _numbers_of_yaml_1_2(Dumper, only=False)


def parse_value(text: str, key: str = "KEY") -> Any:
    """A command-line value as YAML reads it ('0.1', '1e-3', 'true', '[1, 2]', 'null'; quoted,
    a string; numbers as YAML 1.2 reads them, yaml_loader), else the text; an empty one (an unset
    shell variable) is an error, not YAML's null."""
    import yaml

    if not text.strip():
        raise ConfigError(f"{key}= has no value (an unset shell variable?): give one, or "
                          f"{key}=null for a setting that may be unset")  # fmt: skip
    try:
        value = yaml.load(text, Loader=yaml_loader())
    except yaml.YAMLError:
        return text
    except (ValueError, OverflowError) as e:  # a number Python cannot hold (4,300+ digits)
        raise ConfigError(f"{key}={shown(text)} is not a value vitlab can read: {e}") from None
    if isinstance(value, dict) and not text.lstrip().startswith("{"):  # imagefolder: (a name)
        return text
    return value


def given_twice(overrides: typing.Iterable[str]) -> list[str]:
    """What a command line's KEY=VALUE items give more than once, a warning each: the last value
    is used (as argparse takes an option's last), which went without a word."""
    values: dict[str, list[str]] = {}
    for item in overrides:
        key, _, value = item.partition("=")
        values.setdefault(key, []).append(value)
    return [f"{key} is given {len(v)} times on the command line ({', '.join(v)}): the last, "
            f"{v[-1]}, is used" for key, v in values.items() if len(v) > 1]  # fmt: skip


def apply_overrides(tree: dict[str, Any], overrides: typing.Iterable[str]) -> dict[str, Any]:
    """Apply 'section.key=value' strings to a nested dict (a copy); a malformed item is an error."""
    out = {k: dict(v) if isinstance(v, Mapping) else v for k, v in tree.items()}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"expected an override like optim.lr=0.001, got {item!r}")
        section, dot, field = key.partition(".")
        if not dot or not field or "." in field:
            raise ConfigError(f"override keys are section.key (e.g. train.epochs), got {key!r}")
        node = out.setdefault(section, {})
        if not isinstance(node, dict):
            raise ConfigError(f"config section {section!r} must be a mapping, got {shown(node)}")
        node[field] = parse_value(value, key)
    return out
