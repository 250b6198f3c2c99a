"""Plain-text formatting shared by the cost reports: human-readable counts and byte sizes, and
aligned tables."""

from __future__ import annotations

from collections.abc import Sequence


def human(n: float, unit: str = "") -> str:
    """1.23e9 -> '1.23 G' (with `unit` appended: '1.23 GMACs')."""
    for scale, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {suffix}{unit}"
    return f"{n:.0f} {unit}".rstrip()


def byte_size(n: int) -> str:
    """1_862_832 -> '1.8 MiB'."""
    for scale, suffix in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if n >= scale:
            return f"{n / scale:.1f} {suffix}"
    return f"{n} B"


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Lines of an aligned table: header, a rule, rows; the first column left-aligned, the others
    (numbers) right-aligned."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]

    def fmt(row: Sequence[str]) -> str:
        return "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))
        )

    line = fmt(header)
    return [line, "-" * len(line)] + [fmt(row) for row in rows]
