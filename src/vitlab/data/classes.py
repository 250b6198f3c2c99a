"""Class names: shown in errors, told from mere indices, and matched between a dataset and a
model (`vitlab eval --data`, a distillation teacher)."""

from __future__ import annotations

import unicodedata

from vitlab.data.download import DatasetError


def named(names: list[str]) -> str:
    """Class names for an error message (the first 12 of many)."""
    return repr(names) if len(names) <= 12 else f"{names[:12]!r} ... ({len(names)} classes)"


def numbered(classes: list[str]) -> bool:
    """Whether the classes are only their indices ("0", "1", ...), not names."""
    return classes == [str(i) for i in range(len(classes))]


def name_order(have: list[str], want: list[str], what: str) -> tuple[list[int] | None, str | None]:
    """How classes named `have` map onto as many classes named `want`: (None, None) by index, the
    same list or either side only numbered ("0", "1", ...); (order, None) when the same unique
    names come in another order (numbers as text sorted, "10" before "2", included): have[i] is
    want[order[i]]; (None, note) when no name is shared (another naming: by index, the note says
    so). Names partly shared, or repeated and reordered, are a DatasetError naming both (`what`:
    the two sides, for the message). Names are compared in one Unicode form (NFC: 'café'
    decomposed, as macOS writes folder names, is 'café')."""
    have, want = [nfc(c) for c in have], [nfc(c) for c in want]
    if have == want:
        return None, None
    if sorted(have) == sorted(want) and len(set(have)) == len(have):
        return [want.index(c) for c in have], None
    if numbered(have) or numbered(want):
        return None, None
    if not set(have) & set(want):
        return None, (f"{what} share no class name ({named(have)} and {named(want)}): taken by "
                      f"index, class i as class i")  # fmt: skip
    raise DatasetError(
        f"{what} name classes {named(have)} and {named(want)}: some names are "
        f"shared, some not (or repeated): a class cannot be matched by its name"
    )


def nfc(name: str) -> str:
    """A name in Unicode's composed form (NFC), as names are compared: macOS writes folder
    names decomposed ('café' as 'cafe' and a combining accent)."""
    return unicodedata.normalize("NFC", name)
