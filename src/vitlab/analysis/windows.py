"""Attention inside Swin's windows: where each window slot's token lies in the image, the mean
attention distance per head in input pixels, and the centre query's attention painted back onto
the map.

Geometry. Stage i's tokens are (P 2^i)-pixel squares; token (r, c) of its map has its centre at
((r + 0.5) P 2^i, (c + 0.5) P 2^i) pixels. A block with cyclic shift (sh, sw) rolls the map by -s
before partitioning, so slot (r, c) of the rolled map holds token ((r + sh) mod h, (c + sw) mod w);
the map is then padded at the bottom and right to whole windows (swin_layers.SwinBlock). Distances
are measured between the tokens' own positions in the image, the roll undone: pairs from one
region of a shifted window are neighbours in the image, and the pairs the shift mask separates
(a window that wraps around the image's edge) are far apart but get weight ~exp(-100), nothing.
Padding slots have no place in the image: their keys' weights are dropped (each query's row
re-normalised) and their queries left out. Where the window does not tile the map, the shift
mask's regions are labelled on the padded map (as timm 1.0 does), so a shifted window may join
unmasked tokens from opposite edges of the image (a 5-row map, window 4, shift 2: rows 2, 3, 4
and 0); their distance is counted across the image, where they are, and can exceed the window's
diagonal. Where the window tiles the map, every weighted pair lies within it.
"""

from __future__ import annotations

from collections.abc import Collection

import torch
from torch import Tensor

from vitlab.models.pos_embed import Grid
from vitlab.models.swin import SwinTransformer
from vitlab.models.swin_layers import SwinBlock, window_partition, window_reverse
from vitlab.runtime import eval_mode


def window_token_centres(
    grid: Grid, window: Grid, shift: Grid, stride: int
) -> tuple[Tensor, Tensor]:
    """For a block on a (h, w) map with window (Mh, Mw) and cyclic shift (sh, sw), and tokens of
    `stride` pixels: (nW, N, 2) float64 pixel coordinates (y, x) in the image of the token each
    window slot holds (the roll undone), and (nW, N) bool, False for padding slots."""
    (h, w), (mh, mw), (sh, sw) = grid, window, shift
    hp, wp = -(-h // mh) * mh, -(-w // mw) * mw
    rows, cols = torch.arange(hp), torch.arange(wp)
    ys = ((rows + sh) % h + 0.5) * stride  # (Hp,) image row of each rolled row
    xs = ((cols + sw) % w + 0.5) * stride
    coords = torch.stack(torch.meshgrid(ys.double(), xs.double(), indexing="ij"), dim=-1)
    real = (rows < h)[:, None] & (cols < w)[None, :]  # (Hp, Wp)
    centres = window_partition(coords[None], window)[0]  # (nW, N, 2)
    return centres, window_partition(real[None, :, :, None], window)[0, :, :, 0]


def mean_window_attention_distance(attention: Tensor, centres: Tensor, real: Tensor) -> Tensor:
    """Per head, the pixel distance between query and key token centres within each window,
    weighted by attention and summed over keys, averaged over the real queries of every window and
    image: attention (B, nW, h, N, N), centres (nW, N, 2), real (nW, N) -> (h,)."""
    if attention.ndim != 5 or attention.shape[-1] != attention.shape[-2]:
        raise ValueError(
            f"expected attention of shape (B, windows, heads, N, N), got {tuple(attention.shape)}"
        )
    nw, n = real.shape
    if attention.shape[1] != nw or attention.shape[-1] != n or centres.shape != (nw, n, 2):
        raise ValueError(
            f"attention {tuple(attention.shape)} does not fit {nw} windows of {n} tokens "
            f"(centres {tuple(centres.shape)})"
        )
    keep = real.to(torch.float64)  # (nW, N)
    a = attention.double() * keep[None, :, None, None, :]
    a = a / a.sum(dim=-1, keepdim=True).clamp(min=1e-300)
    dist = torch.cdist(centres, centres)  # (nW, N, N)
    per_query = (a * dist[None, :, None]).sum(dim=-1)  # (B, nW, h, N)
    total = (per_query * keep[None, :, None, :]).sum(dim=(0, 1, 3))
    return (total / (attention.shape[0] * keep.sum())).float()


def centre_query_map(attention: Tensor, block: SwinBlock) -> Tensor:
    """(B, nW, h, N, N) attention of `block` -> (B, h_map, w_map): each token's weight from the
    centre query (slot (Mh // 2, Mw // 2)) of the window that holds it, mean over heads, painted
    at the token's place in the map (the roll undone, padding cropped, as the block puts its
    output back). NaN in windows whose centre slot is padding."""
    (h, w), (mh, mw), (sh, sw), padded = block.grid, block.window, block.shift, block.padded
    centre = (mh // 2) * mw + mw // 2
    weights = attention.float().mean(dim=2)[:, :, centre]  # (B, nW, N)
    _, real = window_token_centres(block.grid, block.window, block.shift, 1)
    centre_is_real = real[:, centre].to(weights.device)  # (nW,)
    weights = weights.masked_fill(~centre_is_real[None, :, None], float("nan"))
    painted = window_reverse(weights[..., None], block.window, padded)[:, :h, :w, 0]
    return torch.roll(painted, shifts=(sh, sw), dims=(1, 2))


def swin_blocks(model: SwinTransformer) -> list[tuple[int, int, SwinBlock]]:
    """(stage, block within the stage, block) for every block, in order."""
    return [(i, j, b) for i, stage in enumerate(model.layers) for j, b in enumerate(stage.blocks)]


def block_stride(model: SwinTransformer, stage: int) -> int:
    """Input pixels per token side in `stage`: P 2^stage."""
    return model.config.patch_size * 2**stage


def uniform_distance(block: SwinBlock, stride: int) -> float:
    """The mean distance of attention spread evenly over what each query may see (its window's
    keys of its own region, in a shifted block): a reference for the heads' values."""
    centres, real = window_token_centres(block.grid, block.window, block.shift, stride)
    nw, n = real.shape
    mask = block.attn_mask if block.attn_mask is not None else torch.zeros(nw, n, n)
    uniform = mask.double().cpu().softmax(dim=-1)[None, :, None]  # (1, nW, 1, N, N)
    return mean_window_attention_distance(uniform, centres, real).item()


@torch.no_grad()
def swin_attention_statistics(
    model: SwinTransformer,
    inputs: Tensor,
    map_blocks: Collection[tuple[int, int]] = (),
    batch_size: int = 8,
) -> tuple[list[Tensor], dict[tuple[int, int], Tensor]]:
    """Mean attention distance in pixels per block, in order, as (heads,) tensors; and the
    centre-query maps (B, h, w) of the blocks in `map_blocks` ((stage, block) pairs). Each block's
    attention (WindowAttention.attention_probs of the windows it is given) is folded into the
    statistics inside a hook and dropped, so one block's maps are held at a time. The model runs
    in eval mode (no drop path) and is left in its own."""
    blocks = swin_blocks(model)
    sums = [torch.zeros(b.attn.num_heads, dtype=torch.float64) for _, _, b in blocks]
    maps: dict[tuple[int, int], list[Tensor]] = {key: [] for key in map_blocks}

    def hook(k: int):
        stage, j, block = blocks[k]
        centres, real = window_token_centres(
            block.grid, block.window, block.shift, block_stride(model, stage)
        )

        def capture(attn, args) -> None:
            windows, mask = args  # (B, nW, N, C), (nW, N, N) or None
            probs = attn.attention_probs(windows, mask)  # (B, nW, h, N, N)
            where = probs.device
            dist = mean_window_attention_distance(probs, centres.to(where), real.to(where))
            sums[k] += len(windows) * dist.double().cpu()
            if (stage, j) in maps:
                maps[(stage, j)].append(centre_query_map(probs, block).cpu())

        return capture

    handles = [b.attn.register_forward_pre_hook(hook(k)) for k, (_, _, b) in enumerate(blocks)]
    try:
        device = next(model.parameters()).device  # the model's; the statistics come to the CPU
        with eval_mode(model):
            for batch in inputs.split(batch_size):
                model.forward_features(batch.to(device))
    finally:
        for handle in handles:
            handle.remove()
    return [(s / len(inputs)).float() for s in sums], {k: torch.cat(v) for k, v in maps.items()}
