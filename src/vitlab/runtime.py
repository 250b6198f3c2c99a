"""Run-time helpers every layer may use (a leaf: imports nothing from vitlab)."""

from __future__ import annotations

import hashlib


def derive_seed(*parts: int) -> int:
    """A 63-bit seed that is a pure function of `parts` (e.g. seed, epoch, batch, rank): the same
    parts give the same seed in every process and run, and neighbouring parts give unrelated
    seeds (a hash, not a sum: seed 1 rank 0 and seed 0 rank 1 do not collide)."""
    digest = hashlib.blake2b(repr(tuple(int(p) for p in parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1
