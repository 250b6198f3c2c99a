"""The SwinConfig a Swin state dict (timm's names, which are vitlab's) was trained with, read from
its tensors and the hints its format states; models.checkpoint dispatches here for Swins.

From the tensors: the width C and patch P (patch_embed.proj, (C, in_chans, P, P)), the stages and
their depths (layers.{i}.blocks.{j}), the heads of each stage (the width of its relative position
bias table, ((2M - 1)^2, heads)), the window M (the first stage's table: timm shrinks the table of
a stage whose map is smaller than the window, so later tables may be smaller), the MLP ratio
(fc1), qkv bias and the classes (head.fc). The image size is in no tensor: it comes from the
format's config (timm's or transformers' config.json, vitlab's metadata) or is guessed as the
smallest size consistent with the tables (a warning says so).
"""

from __future__ import annotations

import logging
import math
import re

from torch import Tensor

from vitlab.config import ConfigError
from vitlab.formats.base import CheckpointError, Source, pass_key
from vitlab.models.swin import SwinConfig

log = logging.getLogger(__name__)


_BLOCK = re.compile(r"^layers\.(\d+)\.blocks\.(\d+)\.")


def table_window(rows: int) -> int | None:
    """M of a square window whose relative bias table has (2M - 1)^2 rows, or None."""
    side = math.isqrt(rows)
    return (side + 1) // 2 if side * side == rows and side % 2 == 1 else None


def _mlp_ratio(widths: list[int], hidden: list[int], where: str) -> float:
    """A ratio from which every stage builds its MLP width as int(width * ratio)."""
    if min(widths) <= 0:
        raise CheckpointError(f"{where}: a patch embedding of width {widths[0]}")
    first = hidden[0] / widths[0]
    for ratio in (first, math.nextafter(first, math.inf)):
        if all(int(w * ratio) == h for w, h in zip(widths, hidden)):
            return ratio
    raise CheckpointError(f"{where}: no mlp_ratio gives MLP widths {hidden} at widths {widths}")


def guess_grid(windows: list[int], window: int) -> int | None:
    """The side of the smallest square patch grid at which stage i's window is clamped to
    windows[i] (the configured `window` where the map is at least that) and the windows tile every
    map; else the smallest at which the clamping fits; None when no grid fits."""
    fits = []
    for g in range(1, window * 2 ** len(windows) + 1):
        maps = [-(-g // 2**i) for i in range(len(windows))]
        if all(min(window, n) == m for n, m in zip(maps, windows)):
            if all(n % m == 0 for n, m in zip(maps, windows)):
                return g
            fits.append(g)
    return fits[0] if fits else None


def infer_swin_config(src: Source, img_size: int | tuple[int, int] | None = None) -> SwinConfig:
    """The SwinConfig `src`'s tensors were trained with. `img_size`: the size a caller wants,
    taken as the trained size when the source states none and the tables fit it."""
    s, hints, where = src.state, dict(src.hints), src.where

    def need(key: str, ndim: int = 1) -> Tensor:
        if key not in s:
            raise CheckpointError(f"{where}: no {key} tensor, so not a complete Swin checkpoint")
        if s[key].ndim != ndim:
            raise CheckpointError(f"{where}: {key} has shape {tuple(s[key].shape)}, not {ndim}-D")
        return s[key]

    dim, chans, p, pw = need("patch_embed.proj.weight", 4).shape
    if p != pw:
        raise CheckpointError(f"{where}: patches of {p}x{pw}: vitlab's Swin has square patches")
    need("patch_embed.norm.weight")
    blocks: dict[int, set[int]] = {}
    for key in s:
        m = _BLOCK.match(key)
        if m:
            blocks.setdefault(int(m.group(1)), set()).add(int(m.group(2)))
    stages = len(blocks)
    if sorted(blocks) != list(range(stages)):
        raise CheckpointError(f"{where}: stages {sorted(blocks)} are not numbered 0..n-1")
    depths = tuple(max(blocks[i]) + 1 for i in range(stages))
    tables = []
    for i, depth in enumerate(depths):
        for j in range(depth):
            need(f"layers.{i}.blocks.{j}.norm1.weight")
        if i:
            need(f"layers.{i}.downsample.reduction.weight", 2)
        tables.append(need(f"layers.{i}.blocks.0.attn.relative_position_bias_table", 2))
    need("norm.weight")
    widths = [dim * 2**i for i in range(stages)]
    hidden = [need(f"layers.{i}.blocks.0.mlp.fc1.weight", 2).shape[0] for i in range(stages)]
    windows = [table_window(t.shape[0]) for t in tables]
    window = hints.pop("window_size", None)
    if window is None:
        if windows[0] is None:
            raise CheckpointError(
                f"{where}: a bias table of {tables[0].shape[0]} rows is no square window's "
                f"((2M - 1)^2): {pass_key('window_size')}"
            )
        window = windows[0]
    img = hints.pop("img_size", None)
    if img is None:
        img = _trained_size(windows, window, p, img_size, where)
    fields = dict(
        img_size=img,
        patch_size=p,
        in_chans=chans,
        num_classes=need("head.fc.weight", 2).shape[0] if "head.fc.weight" in s else 0,
        embed_dim=dim,
        depths=depths,
        num_heads=tuple(t.shape[1] for t in tables),
        window_size=window,
        mlp_ratio=_mlp_ratio(widths, hidden, where),
        qkv_bias="layers.0.blocks.0.attn.qkv.bias" in s,
    )
    fields.update({k: v for k, v in hints.items() if v is not None})
    try:
        return SwinConfig(**fields)
    except (ConfigError, TypeError) as e:
        raise CheckpointError(f"{where}: the tensors describe no valid Swin: {e}") from None


def _trained_size(
    windows: list[int | None],
    window: int | tuple[int, int],
    patch: int,
    wanted: int | tuple[int, int] | None,
    where: str,
) -> int | tuple[int, int]:
    """The image size a source that states none was trained at: `wanted` when its maps clamp the
    windows as the tables say, else the smallest that does (guess_grid), with a warning."""
    if (isinstance(window, tuple) and window[0] != window[1]) or None in windows:
        raise CheckpointError(
            f"{where}: cannot tell the image size of a Swin with non-square windows: "
            f"{pass_key('img_size')}"
        )
    m = window if isinstance(window, int) else window[0]
    if wanted is not None:
        h, w = (wanted, wanted) if isinstance(wanted, int) else wanted
        if all(
            min(m, -(-side // (patch * 2**i))) == win
            for side in (h, w)
            for i, win in enumerate(windows)
        ):
            return wanted
    grid = guess_grid(windows, m)  # type: ignore[arg-type]
    if grid is None:
        raise CheckpointError(
            f"{where}: bias tables for windows {windows} fit no image size with window {m}: "
            f"{pass_key('img_size')}"
        )
    clamped = [f"stage {i}: {n}" for i, n in enumerate(windows) if n != m]
    why = f"; windows clamped to the map at {', '.join(clamped)}" if clamped else ""
    maps = [-(-grid // 2**i) for i in range(len(windows))]
    tiles = all(n % w == 0 for n, w in zip(maps, windows))
    log.warning(
        "%s: assuming img_size=%d, the smallest %s%s (the size is in no tensor); if not, %s",
        where,
        grid * patch,
        f"whose maps windows of {m} tile" if tiles else "that fits the bias tables",
        why,
        pass_key("img_size"),
    )
    return grid * patch
