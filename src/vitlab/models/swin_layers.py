"""Building blocks of the Swin Transformer (Liu et al. 2021, timm `swin_transformer.py`): windows,
the relative position bias, the shifted-window mask, window attention, the Swin block, patch
merging and a stage. Maps are channels-last (B, H, W, C); windows are (B, nW, N, C), nW windows per
image in row-major order, N = Mh * Mw tokens per window in row-major order; M the window, s the
cyclic shift, h the heads, d = C / h the head width. Module and parameter names are timm's, so a
timm state dict loads strictly."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from vitlab.models.layers import DropPath, Mlp, attention_probs
from vitlab.models.patch_embed import PatchEmbed
from vitlab.models.pos_embed import Grid, resample_pos_embed

MASKED = -100.0  # the additive bias between regions of a shifted window (the paper's, timm's)


@dataclass(frozen=True)
class StageSpec:
    """One stage's shape, derived from a SwinConfig by SwinConfig.stage(i); what its blocks read."""

    embed_dim: int  # C of the stage (after its patch merging)
    num_heads: int
    mlp_dim: int  # int(C * mlp_ratio), as timm
    grid: Grid  # the stage's map (h, w): ceil(patch grid / 2^i)
    window: Grid  # the configured window, clamped per axis to the map (timm)
    shift: Grid  # M // 2 per axis where the map is larger than the window, else 0 (timm)
    qkv_bias: bool
    dropout: float  # after the attention projection and in the MLP (timm's proj_drop)
    attn_dropout: float
    norm_eps: float
    act: str = "gelu"  # read by layers.Mlp

    @property
    def padded(self) -> Grid:
        """The map padded at the bottom and right to multiples of the window."""
        (h, w), (mh, mw) = self.grid, self.window
        return -(-h // mh) * mh, -(-w // mw) * mw


# --- windows, offsets, masks ---------------------------------------------------------------------


def window_partition(x: Tensor, window: Grid) -> Tensor:
    """(B, H, W, C) -> (B, nW, Mh * Mw, C); H and W must be multiples of the window."""
    b, h, w, c = x.shape
    mh, mw = window
    x = x.reshape(b, h // mh, mh, w // mw, mw, c).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(b, (h // mh) * (w // mw), mh * mw, c)


def window_reverse(windows: Tensor, window: Grid, hw: Grid) -> Tensor:
    """(B, nW, Mh * Mw, C) -> (B, H, W, C): the inverse of window_partition for a map of size hw."""
    b, _, _, c = windows.shape
    (mh, mw), (h, w) = window, hw
    x = windows.reshape(b, h // mh, w // mw, mh, mw, c).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(b, h, w, c)


def relative_position_index(window: Grid, device: torch.device | None = None) -> Tensor:
    """(N, N): the bias-table row of each (query, key) pair of a window,
    (dh + Mh - 1) (2 Mw - 1) + (dw + Mw - 1) with (dh, dw) the query's position minus the key's."""
    mh, mw = window
    ys, xs = torch.meshgrid(
        torch.arange(mh, device=device), torch.arange(mw, device=device), indexing="ij"
    )
    ys, xs = ys.flatten(), xs.flatten()
    dh = ys[:, None] - ys[None, :]
    dw = xs[:, None] - xs[None, :]
    return (dh + mh - 1) * (2 * mw - 1) + (dw + mw - 1)


def shift_regions(
    length: int, window: int, shift: int, device: torch.device | None = None
) -> Tensor:
    """(length,) region label of each row (or column) of a map rolled by -shift and padded to
    `length` (a multiple of the window): [0, L - M) -> 0, [L - M, L - s) -> 1, [L - s, L) -> 2, as
    timm 1.0 labels them on the padded map; a single region when shift is 0."""
    labels = torch.zeros(length, dtype=torch.long, device=device)
    if shift:
        labels[length - window :] = 1
        labels[length - shift :] = 2
    return labels


def shift_window_mask(
    grid: Grid, window: Grid, shift: Grid, device: torch.device | None = None
) -> Tensor | None:
    """(nW, N, N) additive attention mask of a shifted block on a map of size `grid`: 0 for
    pairs from the same region of the rolled (and padded) map, MASKED otherwise; None if no axis
    is shifted. Padded positions are not masked out (timm 1.0 neither)."""
    if not any(shift):
        return None
    hp, wp = (-(-n // m) * m for n, m in zip(grid, window))
    rows = shift_regions(hp, window[0], shift[0], device)
    cols = shift_regions(wp, window[1], shift[1], device)
    region = rows[:, None] * 3 + cols[None, :]  # (Hp, Wp)
    region = window_partition(region[None, :, :, None], window)[0, :, :, 0]  # (nW, N)
    same = region[:, :, None] == region[:, None, :]  # (nW, N, N)
    return torch.zeros(same.shape, device=device).masked_fill(~same, MASKED)


TABLE_RESAMPLING = ("bicubic", "timm")  # how a relative position table takes another window


def resample_rel_pos_table(
    table: Tensor, old_window: Grid, new_window: Grid, method: str = "bicubic"
) -> Tensor:
    """A ((2Mh - 1)(2Mw - 1), h) relative bias table resampled to another window, in float32.
    'bicubic': the offsets' 2-D grid interpolated bicubically, without antialias, as the official
    Swin code fine-tunes 224 -> 384 (timm's resize_rel_pos_bias_table_simple alike). 'timm': as
    timm's checkpoint loader (resize_rel_pos_bias_table, from BEiT): the old offsets spread
    geometrically over the new ones (_spread_offsets), read off linearly, the outermost held. The
    same window returns the table unchanged."""
    if method not in TABLE_RESAMPLING:
        raise ValueError(f"method must be one of {TABLE_RESAMPLING}, got {method!r}")
    old = (2 * old_window[0] - 1, 2 * old_window[1] - 1)
    new = (2 * new_window[0] - 1, 2 * new_window[1] - 1)
    if old == new:
        return table
    if method == "bicubic":
        return resample_pos_embed(table[None], new, old, num_prefix_tokens=0, antialias=False)[0]
    rows, cols = (_linear_weights(_spread_offsets(o, n), n) for o, n in zip(old, new))
    grid = table.float().t().reshape(-1, *old)  # (h, 2Mh - 1, 2Mw - 1)
    out = rows.to(grid.device) @ grid @ cols.t().to(grid.device)
    return out.reshape(len(grid), -1).t().to(table.dtype)


def _spread_offsets(old: int, new: int) -> Tensor:
    """Where timm's loader places an axis's `old` offsets (-k..k) among the new ones: 0, +-1,
    +-(1 + q), +-(1 + q + q^2), ..., the ratio q bisected in [1.01, 1.5] until the outermost
    reach new // 2 (to 1e-6 in q; BEiT's fine-tuning code)."""
    k, reach, low, high = old // 2, new // 2, 1.01, 1.5
    while high - low > 1e-6:
        q = (low + high) / 2
        low, high = (low, q) if (1 - q**k) / (1 - q) > reach else (q, high)
    out = list(itertools.accumulate(q**i for i in range(k)))  # summed in timm's order
    return torch.tensor([-d for d in reversed(out)] + [0.0] + out)


def _linear_weights(points: Tensor, size: int) -> Tensor:
    """(size, len(points)) weights reading the integer offsets -(size // 2)..size // 2 off values
    at `points` (increasing) linearly; beyond the outermost points, their values."""
    at = torch.arange(size, dtype=points.dtype) - size // 2
    weights = torch.zeros(size, len(points))
    if len(points) == 1:
        return weights + 1
    right = torch.searchsorted(points, at).clamp(1, len(points) - 1)
    left, span = right - 1, points[right] - points[right - 1]
    frac = ((at - points[left]) / span).clamp(0, 1)
    rows = torch.arange(size)
    weights[rows, left] = 1 - frac
    weights[rows, right] += frac
    return weights


# --- modules -------------------------------------------------------------------------------------


class SwinPatchEmbed(PatchEmbed):
    """P x P patches, a linear map each, then LayerNorm: (B, C, H, W) -> (B, H/P, W/P, D)."""

    def __init__(
        self, img_size: Grid, patch_size: int, in_chans: int, embed_dim: int, eps: float
    ) -> None:
        super().__init__(img_size, patch_size, in_chans, embed_dim)
        self.norm = nn.LayerNorm(embed_dim, eps=eps)

    def forward(self, x: Tensor) -> Tensor:
        self.check_input(x)
        return self.norm(self.project(x))  # (B, gh, gw, D)


class WindowAttention(nn.Module):
    """Multi-head self-attention inside each window with a learned bias per relative offset and
    head (table ((2Mh - 1)(2Mw - 1), h), looked up by relative_position_index) plus, in shifted
    blocks, the region mask. F.scaled_dot_product_attention with bias + mask as attn_mask, except
    on CPU, which takes the explicit softmax((q * scale) k^T + bias) v path: at a window's 49
    tokens PyTorch's CPU kernel (its math fallback with a float mask) is 2-4x slower in fp32 and
    bf16 alike, and timm's Swin takes the explicit path too (BENCHMARKS.md). `fused` (None: by
    device) forces either path."""

    fused: bool | None = None

    def __init__(self, spec: StageSpec) -> None:
        super().__init__()
        dim, self.num_heads = spec.embed_dim, spec.num_heads
        self.head_dim = dim // self.num_heads
        self.scale = self.head_dim**-0.5
        self.window = spec.window
        self.qkv = nn.Linear(dim, 3 * dim, bias=spec.qkv_bias)
        rows = (2 * spec.window[0] - 1) * (2 * spec.window[1] - 1)
        self.relative_position_bias_table = nn.Parameter(torch.zeros(rows, self.num_heads))
        nn.init.trunc_normal_(self.relative_position_bias_table, std=0.02)
        index = relative_position_index(spec.window, self.relative_position_bias_table.device)
        self.register_buffer("relative_position_index", index, persistent=False)
        self.attn_drop = spec.attn_dropout
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(spec.dropout)

    def set_window(self, window: Grid, table_resampling: str = "bicubic") -> None:
        """Resize to another window: the bias table resampled (resample_rel_pos_table's
        `table_resampling` method), the index rebuilt."""
        if tuple(window) == tuple(self.window):
            return
        old = self.relative_position_bias_table
        with torch.no_grad():
            table = resample_rel_pos_table(old.data, self.window, window, table_resampling)
        self.relative_position_bias_table = nn.Parameter(table, requires_grad=old.requires_grad)
        self.relative_position_index = relative_position_index(window, table.device)
        self.window = tuple(window)

    def relative_bias(self) -> Tensor:
        """(h, N, N) bias of each head for each (query, key) pair of a window."""
        n = self.window[0] * self.window[1]
        bias = self.relative_position_bias_table[self.relative_position_index.reshape(-1)]
        return bias.reshape(n, n, self.num_heads).permute(2, 0, 1)

    def _qkv_bias(self, x: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """q, k, v (B, nW, h, N, d) each, and the additive bias (h, N, N) or, with a mask,
        (nW, h, N, N), in q's dtype."""
        b, nw, n, _ = x.shape
        qkv = self.qkv(x).reshape(b, nw, n, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.permute(3, 0, 1, 4, 2, 5).unbind(0)
        bias = self.relative_bias()  # (h, N, N)
        if mask is not None:
            bias = bias + mask[:, None]  # (nW, h, N, N)
        return q, k, v, bias.to(q.dtype)

    def attention_probs(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """x (B, nW, N, C), mask (nW, N, N) or None -> (B, nW, h, N, N): softmax((q * scale) k^T
        + bias (+ mask)) over each window's keys (rows sum to 1), the weights forward() applies
        to v (before attention dropout). For analysis; forward() does not call it."""
        q, k, _, bias = self._qkv_bias(x, mask)
        return attention_probs(q, k, self.scale, bias)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """x (B, nW, N, C), mask (nW, N, N) or None -> (B, nW, N, C)."""
        b, nw, n, c = x.shape
        h, d = self.num_heads, self.head_dim
        q, k, v, bias = self._qkv_bias(x, mask)
        drop = self.attn_drop if self.training else 0.0
        fused = self.fused if self.fused is not None else q.device.type != "cpu"
        if not fused:
            probs = attention_probs(q, k, self.scale, bias)  # (B, nW, h, N, N)
            out = F.dropout(probs, drop, training=self.training) @ v
        else:
            groups = h if mask is None else nw * h  # the mask differs per window
            q, k, v = (t.reshape(-1, groups, n, d) for t in (q, k, v))
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=bias.reshape(groups, n, n), dropout_p=drop, scale=self.scale
            )
        out = out.reshape(b, nw, h, n, d).transpose(2, 3).reshape(b, nw, n, c)
        return self.proj_drop(self.proj(out))


class SwinBlock(nn.Module):
    """x + DropPath(W-MSA(LN(x))), then x + DropPath(MLP(LN(x))) on a (B, H, W, C) map. A shifted
    block rolls the normed map by -s before partitioning into windows (padded at the bottom and
    right to whole windows) and masks pairs from different regions; rolled back after."""

    def __init__(self, spec: StageSpec, shifted: bool, drop_path: float = 0.0) -> None:
        super().__init__()
        self.shifted = shifted
        self.norm1 = nn.LayerNorm(spec.embed_dim, eps=spec.norm_eps)
        self.attn = WindowAttention(spec)
        self.drop_path1 = DropPath(drop_path)
        self.norm2 = nn.LayerNorm(spec.embed_dim, eps=spec.norm_eps)
        self.mlp = Mlp(spec)
        self.drop_path2 = DropPath(drop_path)
        self.set_spec(spec)

    def set_spec(self, spec: StageSpec, table_resampling: str = "bicubic") -> None:
        """Adopt another map size or window: bias table resampled, mask rebuilt."""
        self.grid, self.window, self.padded = spec.grid, spec.window, spec.padded
        self.shift = spec.shift if self.shifted else (0, 0)
        self.attn.set_window(spec.window, table_resampling)
        device = self.norm1.weight.device
        mask = shift_window_mask(spec.grid, spec.window, self.shift, device)
        self.register_buffer("attn_mask", mask, persistent=False)

    def _attention(self, x: Tensor) -> Tensor:
        """(B, H, W, C) normed map -> (B, H, W, C) window attention output."""
        _, h, w, _ = x.shape
        sh, sw = self.shift
        if sh or sw:
            x = torch.roll(x, shifts=(-sh, -sw), dims=(1, 2))
        (hp, wp), window = self.padded, self.window
        if (hp, wp) != (h, w):  # (B, Hp, Wp, C), zeros at bottom and right
            x = F.pad(x, (0, 0, 0, wp - w, 0, hp - h))
        out = self.attn(window_partition(x, window), self.attn_mask)  # (B, nW, N, C)
        x = window_reverse(out, window, (hp, wp))
        if (hp, wp) != (h, w):
            x = x[:, :h, :w]
        if sh or sw:
            x = torch.roll(x, shifts=(sh, sw), dims=(1, 2))
        return x

    def forward(self, x: Tensor) -> Tensor:
        """(B, H, W, C) -> (B, H, W, C)."""
        x = x + self.drop_path1(self._attention(self.norm1(x)))
        return x + self.drop_path2(self.mlp(self.norm2(x)))


class PatchMerging(nn.Module):
    """2x2 neighbours concatenated in the order (0, 0), (1, 0), (0, 1), (1, 1) (row, column
    offsets), LayerNorm(4C), Linear(4C -> C_out) without bias: (B, H, W, C) -> (B, ceil(H / 2),
    ceil(W / 2), C_out); an odd side is padded with a zero row or column first (timm)."""

    def __init__(self, dim: int, out_dim: int, eps: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(4 * dim, eps=eps)
        self.reduction = nn.Linear(4 * dim, out_dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        _, h, w, _ = x.shape
        x = F.pad(x, (0, 0, 0, w % 2, 0, h % 2))
        x = torch.cat([x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2], x[:, 1::2, 1::2]], -1)
        return self.reduction(self.norm(x))


class SwinStage(nn.Module):
    """Patch merging (stages after the first, as timm places it: `layers.{i}.downsample`), then
    blocks alternating plain and shifted windows."""

    def __init__(
        self, spec: StageSpec, in_dim: int, depth: int, drop_paths: Sequence[float], merge: bool
    ) -> None:
        super().__init__()
        if merge:
            self.downsample: nn.Module = PatchMerging(in_dim, spec.embed_dim, spec.norm_eps)
        else:
            self.downsample = nn.Identity()
        self.blocks = nn.ModuleList(
            SwinBlock(spec, shifted=j % 2 == 1, drop_path=drop_paths[j]) for j in range(depth)
        )
        self.grad_checkpointing = False

    def set_spec(self, spec: StageSpec, table_resampling: str = "bicubic") -> None:
        for blk in self.blocks:
            blk.set_spec(spec, table_resampling)

    def forward(self, x: Tensor) -> Tensor:
        """(B, H, W, C_in) -> (B, H', W', C), H' = ceil(H / 2) after merging, else H."""
        x = self.downsample(x)
        for blk in self.blocks:
            if self.grad_checkpointing and torch.is_grad_enabled():
                x = checkpoint(blk, x, use_reentrant=False)
            else:
                x = blk(x)
        return x
