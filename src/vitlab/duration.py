"""Durations as people write them: `90s`, `3m`, `1h`, `1h30m`, `2m30s`, `1.5m`, or plain seconds."""

from __future__ import annotations

import math
import re

_PART = r"(?:(\d+(?:\.\d*)?|\.\d+)\s*{unit})?"
_DURATION = re.compile("".join(_PART.format(unit=u) for u in "hms"))
_SECONDS = {"h": 3600.0, "m": 60.0, "s": 1.0}


def parse_duration(value: str | float | int, where: str = "duration") -> float:
    """Seconds (> 0) of `value`: a number of seconds, or hours / minutes / seconds in that order,
    each at most once (`1h30m`, `3m`, `90s`, `1.5m`). Anything else is a ValueError naming
    `where`."""
    if isinstance(value, bool):
        seconds = math.nan
    elif isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str) and value.strip():
        text = value.strip().lower().replace(" ", "")
        match = _DURATION.fullmatch(text)
        try:
            seconds = float(text)
        except ValueError:
            seconds = math.nan
            if match and any(match.groups()):
                parts = zip(match.groups(), "hms", strict=True)
                seconds = sum(float(n) * _SECONDS[u] for n, u in parts if n is not None)
    else:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(
            f"{where}: expected a duration above 0 such as 90s, 3m, 1h30m or a number of "
            f"seconds, got {value!r}"
        )
    return seconds
