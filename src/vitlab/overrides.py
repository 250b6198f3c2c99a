"""Command-line overrides: `section.key=value` items, each value as YAML reads it, applied to a
config tree (vitlab.config reads the tree from a file and checks it; `vitlab convert` takes the
same items for a checkpoint's fields)."""

from __future__ import annotations

import contextlib
import typing
from collections.abc import Mapping
from typing import Any

from vitlab.validation import ConfigError, shown


def parse_value(text: str, key: str = "KEY") -> Any:
    """A command-line value as YAML reads it ('0.1', 'true', '[1, 2]', 'null'; quoted, a string),
    else the text; an empty one (an unset shell variable) is an error, not YAML's null."""
    import yaml

    if not text.strip():
        raise ConfigError(f"{key}= has no value (an unset shell variable?): give one, or "
                          f"{key}=null for a setting that may be unset")  # fmt: skip
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if isinstance(value, dict) and not text.lstrip().startswith("{"):  # imagefolder: (a name)
        return text
    if isinstance(value, str) and value == text.strip():  # YAML 1.1 reads 1e-3 as a string
        with contextlib.suppress(ValueError):
            return float(value)
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
