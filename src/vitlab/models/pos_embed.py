"""Position information for the Vision Transformer: the absolute embeddings added to the tokens
(learned 1-D, learned 2-D, fixed sin-cos, none), the relative bias added inside attention, and
resampling of both to another patch grid. Shapes: T tokens (prefix + N patches), D width, d head
width, (gh, gw) the patch grid."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vitlab.models.indices import whole_number

Grid = tuple[int, int]


def _grid(grid: Grid | int, name: str) -> tuple[int, int]:
    """(rows, columns) of patches: a pair, or one number for a square grid."""
    try:
        pair = (grid, grid) if whole_number(grid) is not None else tuple(grid)  # type: ignore
        sides = [whole_number(n) for n in pair]
        if len(sides) == 2 and all(n is not None and n > 0 for n in sides):
            return sides[0], sides[1]
    except TypeError:
        pass
    raise ValueError(f"{name} is (rows, columns) of patches or one number for a square grid, "
                     f"got {grid!r}")  # fmt: skip


def resample_pos_embed(
    pos_embed: Tensor,
    new_grid: Grid | int,
    old_grid: Grid | int | None = None,
    num_prefix_tokens: int = 1,
    interpolation: str = "bicubic",
    antialias: bool = True,
    align_corners: bool = False,
) -> Tensor:
    """Resample a 1-D position table (1, prefix + gh * gw, D) to another patch grid (paper §3.2);
    a grid is (gh, gw), or one number for a square one.

    The patch part is interpolated in 2-D in float32; the prefix rows (class, distillation tokens)
    are kept as they are. `old_grid` defaults to the square grid that fits the table. Resampling to
    the same grid returns the input unchanged. The defaults are timm's; transformers' ViT
    interpolates without antialias, torchvision's with align_corners=True as well.
    """
    if pos_embed.ndim != 3 or pos_embed.shape[0] != 1:
        raise ValueError(
            f"expected a position table of shape (1, T, D), got {tuple(pos_embed.shape)}"
        )
    num_patches = pos_embed.shape[1] - num_prefix_tokens
    new_grid = _grid(new_grid, "new_grid")
    old_grid = None if old_grid is None else _grid(old_grid, "old_grid")
    if old_grid is None:
        side = math.isqrt(num_patches)
        if side * side != num_patches:
            raise ValueError(
                f"cannot infer the grid of a position table with {num_patches} patch rows "
                f"({num_prefix_tokens} prefix tokens): pass old_grid"
            )
        old_grid = (side, side)
    if old_grid[0] * old_grid[1] != num_patches:
        raise ValueError(
            f"position table has {num_patches} patch rows after {num_prefix_tokens} prefix tokens, "
            f"but old_grid {old_grid[0]}x{old_grid[1]} has {old_grid[0] * old_grid[1]}"
        )
    if old_grid == new_grid:
        return pos_embed
    prefix, patches = pos_embed[:, :num_prefix_tokens], pos_embed[:, num_prefix_tokens:]
    dim = pos_embed.shape[-1]
    patches = patches.float().reshape(1, old_grid[0], old_grid[1], dim).permute(0, 3, 1, 2)
    patches = _interpolate(patches, new_grid, interpolation, antialias, align_corners)
    patches = patches.permute(0, 2, 3, 1).reshape(1, new_grid[0] * new_grid[1], dim)
    return torch.cat([prefix, patches.to(pos_embed.dtype)], dim=1)


def _interpolate(
    x: Tensor, size: Grid, mode: str = "bicubic", antialias: bool = True, align: bool = False
) -> Tensor:
    """(1, C, h, w) to `size`; nearest has no corners to align nor antialias."""
    align = align if mode in ("bilinear", "bicubic") else None
    anti = antialias and mode in ("bilinear", "bicubic")
    return F.interpolate(x, size=size, mode=mode, align_corners=align, antialias=anti)


def _resample_rows(table: Tensor, length: int) -> Tensor:
    """Resample a (L, C) table along L to `length` rows (bicubic, float32)."""
    if table.shape[0] == length:
        return table
    x = table.float().t()[None, :, None, :]  # (1, C, 1, L)
    x = _interpolate(x, (1, length))
    return x[0, :, 0].t().to(table.dtype)


def sincos_2d(grid: Grid, dim: int, temperature: float = 10000.0) -> Tensor:
    """Fixed 2-D sin-cos table (big_vision, MoCo v3): [sin x, cos x, sin y, cos y], (N, D)."""
    if dim % 4:
        raise ValueError(f"sincos2d position embeddings need a width divisible by 4, got {dim}")
    y, x = torch.meshgrid(
        torch.arange(grid[0], dtype=torch.float32),
        torch.arange(grid[1], dtype=torch.float32),
        indexing="ij",
    )
    quarter = dim // 4
    omega = torch.arange(quarter, dtype=torch.float32) / max(quarter - 1, 1)
    omega = 1.0 / temperature**omega  # (D/4,)
    xo = x.flatten()[:, None] * omega[None]  # (N, D/4)
    yo = y.flatten()[:, None] * omega[None]
    return torch.cat([xo.sin(), xo.cos(), yo.sin(), yo.cos()], dim=1)  # (N, D)


class PosEmbed(nn.Module):
    """Base of the absolute position embeddings: adds one vector per token to (B, T, D) tokens."""

    kind = "none"

    def __init__(self, grid: Grid, num_prefix_tokens: int, dim: int) -> None:
        super().__init__()
        self.grid, self.num_prefix_tokens, self.dim = grid, num_prefix_tokens, dim

    def table(self) -> Tensor | None:
        """The full (1, T, D) table added to the tokens, or None when nothing is added."""
        return None

    def patch_vectors(self) -> Tensor | None:
        """One vector per patch, row-major, (N, D); None for kinds without vectors."""
        table = self.table()
        return None if table is None else table[0, self.num_prefix_tokens :]

    def set_grid(self, grid: Grid) -> None:
        self.grid = grid

    def forward(self, x: Tensor) -> Tensor:
        table = self.table()
        return x if table is None else x + table.to(x.dtype)

    def extra_repr(self) -> str:
        return (
            f"kind={self.kind}, grid={self.grid}, prefix={self.num_prefix_tokens}, dim={self.dim}"
        )


class LearnedPosEmbed(PosEmbed):
    """The paper's default: one learned vector per index 0..N (prefix first), normal(0.02)."""

    kind = "learned"

    def __init__(self, grid: Grid, num_prefix_tokens: int, dim: int) -> None:
        super().__init__(grid, num_prefix_tokens, dim)
        self.weight = nn.Parameter(torch.empty(1, num_prefix_tokens + grid[0] * grid[1], dim))
        nn.init.normal_(self.weight, std=0.02)

    def table(self) -> Tensor:
        return self.weight

    def set_grid(self, grid: Grid) -> None:
        with torch.no_grad():
            new = resample_pos_embed(self.weight.data, grid, self.grid, self.num_prefix_tokens)
        self.weight = nn.Parameter(new, requires_grad=self.weight.requires_grad)
        super().set_grid(grid)


def timm_table_name(model: nn.Module, state: dict, prefix: str, *_: object) -> None:
    """A load_state_dict pre-hook of a model whose learned table is the module `pos_embed`
    (`pos_embed.weight`), where timm's state dicts hold the tensor `pos_embed`: either loads."""
    old, new = prefix + "pos_embed", prefix + "pos_embed.weight"
    if isinstance(model.pos_embed, LearnedPosEmbed) and old in state and new not in state:
        state[new] = state.pop(old)


class Learned2dPosEmbed(PosEmbed):
    """Paper App. D.4 2-D embedding: an X table and a Y table of D/2 each, concatenated per patch
    as [x_col, y_row]; prefix tokens get their own learned vectors."""

    kind = "learned_2d"

    def __init__(self, grid: Grid, num_prefix_tokens: int, dim: int) -> None:
        super().__init__(grid, num_prefix_tokens, dim)
        if dim % 2:
            raise ValueError(f"learned_2d position embeddings need an even width, got {dim}")
        self.x_embed = nn.Parameter(torch.empty(grid[1], dim // 2))
        self.y_embed = nn.Parameter(torch.empty(grid[0], dim // 2))
        self.prefix = (
            nn.Parameter(torch.empty(1, num_prefix_tokens, dim)) if num_prefix_tokens else None
        )
        for p in self.parameters():
            nn.init.normal_(p, std=0.02)

    def table(self) -> Tensor:
        gh, gw = self.grid
        half = self.dim // 2
        xs = self.x_embed[None, :, :].expand(gh, gw, half)
        ys = self.y_embed[:, None, :].expand(gh, gw, half)
        patches = torch.cat([xs, ys], dim=-1).reshape(1, gh * gw, self.dim)  # (1, N, D)
        return patches if self.prefix is None else torch.cat([self.prefix, patches], dim=1)

    def set_grid(self, grid: Grid) -> None:
        with torch.no_grad():
            x = _resample_rows(self.x_embed.data, grid[1])
            y = _resample_rows(self.y_embed.data, grid[0])
        self.x_embed = nn.Parameter(x, requires_grad=self.x_embed.requires_grad)
        self.y_embed = nn.Parameter(y, requires_grad=self.y_embed.requires_grad)
        super().set_grid(grid)


class SinCos2dPosEmbed(PosEmbed):
    """Fixed 2-D sin-cos table (not learned); prefix tokens get zeros."""

    kind = "sincos2d"

    def __init__(self, grid: Grid, num_prefix_tokens: int, dim: int) -> None:
        super().__init__(grid, num_prefix_tokens, dim)
        self.register_buffer("pe", self._build(grid), persistent=False)

    def _build(self, grid: Grid) -> Tensor:
        patches = sincos_2d(grid, self.dim)
        prefix = torch.zeros(self.num_prefix_tokens, self.dim)
        return torch.cat([prefix, patches])[None]  # (1, T, D)

    def table(self) -> Tensor:
        return self.pe

    def set_grid(self, grid: Grid) -> None:
        self.pe = self._build(grid).to(self.pe.device)
        super().set_grid(grid)


class RelativeOnlyPosEmbed(PosEmbed):
    """Nothing added at the input: the relative bias lives in every attention layer."""

    kind = "relative"


POS_EMBEDS: dict[str, type[PosEmbed]] = {
    "learned": LearnedPosEmbed,
    "learned_2d": Learned2dPosEmbed,
    "sincos2d": SinCos2dPosEmbed,
    "relative": RelativeOnlyPosEmbed,
    "none": PosEmbed,
}


class RelativePositionBias(nn.Module):
    """The paper's relative attention (App. D.4): each offset (dy, dx) between a query patch and a
    key patch has a learned embedding r (head width d, shared by the heads); an extra attention of
    the query against these embeddings gives logits q . r / sqrt(d) that are added to the content
    logits before the softmax. Pairs with a prefix token use three learned embeddings
    (prefix -> patch, patch -> prefix, prefix -> prefix). The embeddings start unit normal, the
    scale of the content keys they stand beside (not the 0.02 of the absolute tables)."""

    def __init__(self, grid: Grid, num_prefix_tokens: int, head_dim: int) -> None:
        super().__init__()
        self.grid, self.num_prefix_tokens = grid, num_prefix_tokens
        rows = (2 * grid[0] - 1) * (2 * grid[1] - 1) + (3 if num_prefix_tokens else 0)
        self.table = nn.Parameter(torch.empty(rows, head_dim))
        nn.init.normal_(self.table, std=1.0)
        self.register_buffer("index", self._index(grid), persistent=False)

    def _index(self, grid: Grid) -> Tensor:
        """(T, T) row of `table` for each (query, key) pair."""
        gh, gw = grid
        ys, xs = torch.meshgrid(torch.arange(gh), torch.arange(gw), indexing="ij")
        coords = torch.stack([ys.flatten(), xs.flatten()], dim=1)  # (N, 2)
        rel = coords[:, None, :] - coords[None, :, :]  # (N, N, 2)
        patch_index = (rel[..., 0] + gh - 1) * (2 * gw - 1) + (rel[..., 1] + gw - 1)
        p = self.num_prefix_tokens
        if not p:
            return patch_index
        base = (2 * gh - 1) * (2 * gw - 1)
        n = gh * gw
        index = torch.full((p + n, p + n), base + 2, dtype=patch_index.dtype)
        index[:p, p:] = base
        index[p:, :p] = base + 1
        index[p:, p:] = patch_index
        return index

    def set_grid(self, grid: Grid) -> None:
        if tuple(grid) == tuple(self.grid):
            return
        (oh, ow), (nh, nw) = self.grid, grid
        base = (2 * oh - 1) * (2 * ow - 1)
        with torch.no_grad():
            offsets = self.table.data[:base].float().reshape(2 * oh - 1, 2 * ow - 1, -1)
            offsets = _interpolate(offsets.permute(2, 0, 1)[None], (2 * nh - 1, 2 * nw - 1))
            offsets = offsets[0].permute(1, 2, 0).reshape((2 * nh - 1) * (2 * nw - 1), -1)
            new = torch.cat([offsets.to(self.table.dtype), self.table.data[base:]])
        self.table = nn.Parameter(new, requires_grad=self.table.requires_grad)
        self.grid = grid
        self.index = self._index(grid).to(self.table.device)

    def forward(self, q: Tensor, scale: float) -> Tensor:
        """q (B, H, T, d) -> additive attention bias (B, H, T, T)."""
        rel = self.table[self.index].to(q.dtype)  # (T, T, d)
        return torch.einsum("bhid,ijd->bhij", q * scale, rel)
