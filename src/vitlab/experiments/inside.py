"""Experiment `inside` (paper Fig. 7, §4.5): what the trained ViT of experiment `pos-embed`
(learned 1-D positions, every seed) learned: mean attention distance per head and layer,
position-embedding similarity, embedding filters, and the attention rollout of a few test images.
It trains nothing of its own: it reuses (or trains) pos-embed's learned 1-D runs."""

from __future__ import annotations

from pathlib import Path

import torch

from vitlab.analysis.attention import embedding_filters, pos_embed_similarity
from vitlab.analysis.page import plot_filters
from vitlab.analysis.report import (
    attention_statistics,
    load_images,
    plot_distances,
    plot_rollout,
    plot_similarity,
)
from vitlab.experiments import pos_embed
from vitlab.experiments.arms import LAST, Arm, Context
from vitlab.experiments.base import Experiment, Summary
from vitlab.experiments.verdict import (
    DISTANCE_FLOOR,
    SIMILARITY_FLOOR,
    combine,
    greater_verdict,
    stat,
)
from vitlab.models.checkpoint import load_checkpoint

NAME = "inside"
LEARNED = tuple(k for k in pos_embed.KINDS if k[0] == "learned")


def arms(ctx: Context) -> list[Arm]:
    return pos_embed.arms(ctx, pos_embed.NAME, LEARNED)


def row_column_score(sim: torch.Tensor) -> float:
    """Mean cosine similarity of a patch's position embedding with the patches in its row or
    column, minus that with all other patches (itself excluded). sim: (N, rows, cols)."""
    n, rows, cols = sim.shape
    r = torch.arange(n) // cols
    c = torch.arange(n) % cols
    flat = sim.reshape(n, n)
    same = (r[:, None] == r[None, :]) | (c[:, None] == c[None, :])
    same.fill_diagonal_(False)
    other = ~same
    other.fill_diagonal_(False)
    return float(flat[same].mean() - flat[other].mean())


def trends(distances: torch.Tensor) -> tuple[float, float]:
    """(growth: the last layer's mean distance over heads - the first's, mixing: the first
    layer's spread of heads - the last's), (L, H) pixels; a head without a distance (NaN: no
    query attended to patches) left out."""
    if (none := distances.isnan().all(dim=-1).nonzero().flatten()).numel():
        raise ValueError(f"layer {int(none[0]) + 1}: no head attended to any patch (every "
                         f"query's weight on the prefix tokens): its attention distance is "
                         f"undefined")  # fmt: skip
    low, high = head_range(distances)
    per_layer = distances.nanmean(dim=-1)
    return float(per_layer[-1] - per_layer[0]), float((high - low)[0] - (high - low)[-1])


def head_range(distances: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The smallest and largest of the last dimension (the heads), NaN (no distance) left out."""
    unknown = distances.isnan()
    return (distances.masked_fill(unknown, torch.inf).amin(dim=-1),
            distances.masked_fill(unknown, -torch.inf).amax(dim=-1))  # fmt: skip


def measure(folder: Path, ctx: Context, out: Path | None) -> dict:
    """One run's numbers (and, with `out`, its figures)."""
    model, meta = load_checkpoint(str(folder / "checkpoints" / LAST))
    model.eval()
    pre = meta.preprocessing
    images = load_images(pre, None, ctx.data, None, ctx.budget.analysis_images)
    distances, maps = attention_statistics(model, images.inputs)  # (L, H) pixels, (B, N)
    sim = pos_embed_similarity(model)  # (N, rows, cols)
    if out is not None:
        plot_distances(distances, out / "mean_attention_distance.png", "mean attention distance")
        plot_similarity(sim, out / "pos_embed_similarity.png")
        plot_filters(embedding_filters(model), out / "embedding_filters.png")
        for i, name in enumerate(images.names):
            path = out / f"rollout_{i:03d}.png"
            plot_rollout(images.display[i], maps[i], model.config.grid, path, name)
    growth, mixing = trends(distances)
    return {
        "mean_attention_distance": distances.tolist(),
        "growth": growth,
        "mixing": mixing,
        "row_column": row_column_score(sim),
        "images": images.names,
    }


def summarize(ctx: Context, rows: list[dict], out: Path) -> Summary:
    found = [measure(ctx.out / r["arm"], ctx, out if i == 0 else None) for i, r in enumerate(rows)]
    dist = torch.tensor([f["mean_attention_distance"] for f in found])  # (seeds, L, H)
    verdict = combine([
        greater_verdict("mean distance of the last layer - of the first (heads averaged)",
                        stat(f["growth"] for f in found), DISTANCE_FLOOR, "px",
                        "Attention distance grows with depth"),
        greater_verdict("range over heads (max - min) of the first layer - of the last",
                        stat(f["mixing"] for f in found), DISTANCE_FLOOR, "px",
                        "Low layers mix local and global heads, more than the last layer does"),
        greater_verdict("mean similarity to the patches in the same row or column - to the "
                        "others", stat(f["row_column"] for f in found), SIMILARITY_FLOOR,
                        "cosine", "Position embeddings learn rows and columns"),
    ])  # fmt: skip
    table = []
    for layer in range(dist.shape[1]):  # a head without a distance (NaN) left out
        means = stat(dist[:, layer].nanmean(dim=1).tolist())
        low, high = head_range(dist[:, layer])
        table.append([str(layer + 1), means.text(1.0), f"{low.min():.1f}", f"{high.max():.1f}"])
    figures = [
        ("mean_attention_distance.png", "mean attention distance per head and layer (seed 0)"),
        ("pos_embed_similarity.png", "cosine similarity of position embeddings (seed 0)"),
        ("embedding_filters.png", "principal components of the patch embedding (seed 0)"),
    ]
    figures += [(f"rollout_{i:03d}.png", f"attention rollout: {name}")
                for i, name in enumerate(found[0]["images"])]  # fmt: skip
    return Summary(
        [
            "layer",
            "mean attention distance (px, heads averaged)",
            "smallest head (px)",
            "largest head (px)",
        ],  # fmt: skip
        table,
        verdict,
        figures,
        [
            f"The models of experiment pos-embed with learned 1-D positions (their last "
            f"checkpoints), {len(found)} seed(s); "
            f"distances over {ctx.budget.analysis_images} test images."
        ],  # fmt: skip
        {"per_seed": [{k: v for k, v in f.items() if k != "images"} for f in found]},
        f"Each model is analysed at its last checkpoint: attention distances and the rollout over "
        f"the first {ctx.budget.analysis_images} images of the whole test split (the same images "
        f"for every seed), position-embedding similarity from its weights; no accuracy is "
        f"measured here.",
    )


EXPERIMENT = Experiment(
    name=NAME,
    title="Inside the ViT (Fig. 7)",
    source="paper Fig. 7 and §4.5 (ViT-L/16 on JFT; mean attention distance of ViT-L/16, B/32)",
    claim="Mean attention distance grows with depth, with local and global heads side by side in "
    "the lowest layers, and learned position embeddings encode the patch grid's rows and columns.",
    paper=[
        ("mean attention distance, lowest layers", "~10-120 px of 224 (local and global)"),
        ("mean attention distance, deepest layers", "~120 px for all heads (global)"),
        ("position-embedding similarity", "row-column structure"),
    ],  # fmt: skip
    arms=arms,
    summarize=summarize,
    metric="mean attention distance, position-embedding similarity",
)
