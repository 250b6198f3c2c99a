"""The paper's looks inside a trained ViT (§4.5, App. D.7-D.8, Fig. 6-7; VIT_REFERENCE.md §8):
mean attention distance, attention rollout, position-embedding similarity, embedding filters."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from vitlab.models.indices import whole_number
from vitlab.models.swin import SwinTransformer
from vitlab.models.vit import VisionTransformer


def patch_centres(grid: tuple[int, int], patch_size: int) -> Tensor:
    """(N, 2) pixel coordinates (y, x) of each patch's centre, row-major."""
    ys, xs = torch.meshgrid(
        torch.arange(grid[0], dtype=torch.float64),
        torch.arange(grid[1], dtype=torch.float64),
        indexing="ij",
    )
    return (torch.stack([ys.flatten(), xs.flatten()], dim=1) + 0.5) * patch_size


def mean_attention_distance(
    attention: Tensor, grid: tuple[int, int], patch_size: int, num_prefix_tokens: int
) -> Tensor:
    """Per head, the pixel distance between query and key patch centres weighted by attention,
    summed over keys, averaged over patch queries and the batch: attention (B, H, T, T) -> (H,).
    Prefix-token rows and columns are left out and each query's weights re-normalised, however
    small their sum (float32 keeps 1e-16 to seven digits); a query whose weights on patches are
    all exactly zero has no distance and is left out (a head with none left: NaN)."""
    total, counted = attention_distance_sums(attention, grid, patch_size, num_prefix_tokens)
    return (total / counted).float()  # 0 / 0: NaN


def attention_distance_sums(
    attention: Tensor, grid: tuple[int, int], patch_size: int, num_prefix_tokens: int
) -> tuple[Tensor, Tensor]:
    """mean_attention_distance's parts, per head, to add up over batches: the sum of the
    counted queries' distances and their count (float64, (H,) each)."""
    if attention.ndim != 4 or attention.shape[-1] != attention.shape[-2]:
        raise ValueError(
            f"expected attention of shape (B, heads, T, T), got {tuple(attention.shape)}"
        )
    n = grid[0] * grid[1]
    if attention.shape[-1] != n + num_prefix_tokens:
        raise ValueError(
            f"attention has {attention.shape[-1]} tokens, grid {grid[0]}x{grid[1]} with "
            f"{num_prefix_tokens} prefix tokens needs {n + num_prefix_tokens}"
        )
    p = num_prefix_tokens
    attn = attention[..., p:, p:].double()  # (B, H, N, N)
    centres = patch_centres(grid, patch_size).to(attn.device)
    dist = torch.cdist(centres, centres)  # (N, N)
    per_query = (attn * dist).sum(dim=-1) / attn.sum(dim=-1)  # (B, H, N); 0 / 0: NaN
    counted = ~per_query.isnan()
    return per_query.nan_to_num().sum(dim=(0, 2)), counted.sum(dim=(0, 2)).double()


HEAD_FUSIONS = ("mean", "max", "min")


def check_head_fusion(head_fusion: str) -> None:
    """A ValueError naming the choices unless `head_fusion` is one of HEAD_FUSIONS."""
    if head_fusion not in HEAD_FUSIONS:
        raise ValueError(
            f"head_fusion must be one of {', '.join(HEAD_FUSIONS)}, got {head_fusion!r}"
        )


def fuse_heads(attention: Tensor, head_fusion: Literal["mean", "max", "min"]) -> Tensor:
    """(B, H, T, T) -> (B, T, T): the heads' mean, max or min (only the one asked for)."""
    check_head_fusion(head_fusion)
    if head_fusion == "mean":
        return attention.mean(dim=1)
    return attention.amax(dim=1) if head_fusion == "max" else attention.amin(dim=1)


def rollout_step(
    rollout: Tensor | None, attention: Tensor, head_fusion: Literal["mean", "max", "min"] = "mean"
) -> Tensor:
    """One layer of rollout: fuse heads of (B, H, T, T), add the identity (the residual),
    re-normalise rows, multiply onto the product so far. Returns (B, T, T) in float64."""
    fused = fuse_heads(attention.double(), head_fusion)
    fused = fused + torch.eye(fused.shape[-1], dtype=fused.dtype, device=fused.device)
    fused = fused / fused.sum(dim=-1, keepdim=True)
    return fused if rollout is None else fused @ rollout


def rollout_map(rollout: Tensor, num_prefix_tokens: int) -> Tensor:
    """(B, T, T) rollout -> (B, N) map over patches: the class token's row, or the mean over
    patch queries for models without prefix tokens."""
    p = num_prefix_tokens
    return (rollout[:, 0, p:] if p else rollout.mean(dim=1)).float()


def attention_rollout(
    attentions: Sequence[Tensor],
    num_prefix_tokens: int,
    head_fusion: Literal["mean", "max", "min"] = "mean",
) -> Tensor:
    """Abnar & Zuidema's rollout through all layers (see rollout_step): (B, N) maps over patches."""
    check_head_fusion(head_fusion)
    if not attentions:
        raise ValueError("attention_rollout needs at least one layer's attention")
    rollout = None
    for attn in attentions:
        rollout = rollout_step(rollout, attn, head_fusion)
    return rollout_map(rollout, num_prefix_tokens)


def pos_embed_similarity(model: VisionTransformer) -> Tensor:
    """Cosine similarity of each patch's position embedding with all others, in patch layout:
    (N, rows, cols). Raises for kinds without per-patch vectors (relative, none)."""
    vectors = model.pos_embed.patch_vectors()
    if vectors is None:
        raise ValueError(
            f"position embeddings of kind {model.config.pos_embed!r} have no per-patch vectors"
        )
    v = F.normalize(vectors.detach().float().cpu(), dim=-1)
    rows, cols = model.config.grid
    return (v @ v.T).reshape(rows * cols, rows, cols)


def embedding_filters(model: VisionTransformer | SwinTransformer, k: int = 28) -> Tensor:
    """The top-k principal components of the patch-embedding filters E (a ViT's or a Swin's) as
    images (k, C, P, P); fewer where E has fewer components (min(D, C*P*P)). A conv stem has no
    such linear filters, and k must be a positive whole number: ValueError."""
    if whole_number(k) is None or k < 1:
        raise ValueError(f"k must be a positive number of components, got {k!r}")
    stem = getattr(model.config, "stem", "patch")  # a Swin always embeds linear patches
    if stem != "patch":
        raise ValueError(f"a {stem} stem has no P x P linear embedding filters")
    w = model.patch_embed.proj.weight.detach().float().cpu()  # (D, C, P, P)
    d, c, p, _ = w.shape
    flat = w.reshape(d, c * p * p)
    flat = flat - flat.mean(dim=0, keepdim=True)
    k = min(k, *flat.shape)
    _, _, v = torch.linalg.svd(flat, full_matrices=False)  # rows of v: principal directions
    return v[:k].reshape(k, c, p, p)
