"""Which of a model's blocks or stages a caller asked for (forward_intermediates' `indices`),
whole numbers as a caller may give them (numpy's, 0-d arrays and tensors), and sizes that must be
positive."""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Sequence

from vitlab.config import ConfigError


def chosen_indices(indices: int | Sequence[int] | None, n: int, what: str) -> list[int]:
    """Sorted distinct indices into n `what`s (blocks, stages): all (None), the last k (an int),
    or the listed ones (negative from the end); a ValueError naming an index out of range."""
    if indices is None:
        return list(range(n))
    one = whole_number(indices)  # an int, numpy's, a 0-d array's or tensor's
    if one is not None:
        if not 0 <= one <= n:
            raise ValueError(f"cannot take the last {one} {what}s of a {n}-{what} model")
        return list(range(n - one, n))
    scalar = getattr(indices, "ndim", None) == 0  # a 0-d array of floats: not iterable
    items = (
        [whole_number(i) for i in indices]
        if isinstance(indices, Iterable) and not scalar
        else [None]
    )
    if None in items or isinstance(indices, str):
        raise ValueError(
            f"{what} indices are an int (the last k) or a sequence of ints, got {indices!r}"
        )
    out = []
    for i in items:
        if not -n <= i < n:
            raise ValueError(f"{what} index {i} out of range for a {n}-{what} model")
        out.append(i % n)
    return sorted(set(out))


def whole_number(x: object) -> int | None:
    """x as an int when it is a whole number (int, numpy's integers, a 0-d integer array or
    tensor; not a bool, which would read as 0 or 1), else None."""
    if getattr(x, "ndim", None) == 0 and callable(getattr(x, "item", None)):
        x = x.item()  # a float's or a bool's item is refused below
    return int(x) if isinstance(x, numbers.Integral) and not isinstance(x, bool) else None


def at_least(value: object, low: int, name: str) -> int:
    """`value` as an int (whole_number's kinds) when it is at least `low`, else a ValueError
    naming `name` (a Python function's argument checked as its command-line option is)."""
    n = whole_number(value)
    if n is None or n < low:
        raise ValueError(f"{name} must be a whole number >= {low}, got {value!r}")
    return n


def positive(**sizes: int | tuple[int, ...]) -> None:
    """A ConfigError naming every size (a pair: either side) that is not positive, if any."""
    bad = [f"{k}={v}" for k, v in sizes.items()
           if min(v if isinstance(v, tuple | list) else (v,)) <= 0]  # fmt: skip
    if bad:
        raise ConfigError(f"sizes must be positive, got {', '.join(bad)}")
