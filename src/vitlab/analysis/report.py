"""`vitlab analyze`: the paper's Fig. 6-7 analyses of one checkpoint, written as images, raw numbers
(analysis.json) and a page (index.html) that opens from disk without a server.

Attention is taken one layer at a time (iter_intermediates), folded into the running statistics
(mean distances, rollout product) and dropped, so memory holds one layer's maps beyond the model.
A Swin's page is analysis.swin_report's."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from vitlab.analysis.attention import (
    attention_distance_sums,
    check_head_fusion,
    embedding_filters,
    pos_embed_similarity,
    rollout_map,
    rollout_step,
)
from vitlab.analysis.page import Images, Report, out_folder, plot_filters, pyplot, write_index
from vitlab.analysis.swin_report import analyze_swin
from vitlab.config import DataConfig, RunConfig
from vitlab.data.datasets import ArraySplit, DatasetError
from vitlab.data.decode import decode_image
from vitlab.data.folders import FolderSplit, decode_file
from vitlab.data.hf import HFSplit
from vitlab.data.workers import warn_once
from vitlab.eval.run import data_config, evaluation_split, reads_whole
from vitlab.models.cnn import CNN
from vitlab.models.swin import SwinTransformer
from vitlab.models.vit import VisionTransformer
from vitlab.preprocessing import Preprocessing
from vitlab.runtime import eval_mode
from vitlab.validation import json_text

IMAGES_OR_DATA = "pass --images FILE... or --data NAME"


def load_images(
    pre: Preprocessing,
    files: list[str] | None,
    data: str | None,
    data_dir: str | None,
    n: int,
    run: RunConfig | None = None,
    classes: list[str] | None = None,
) -> Images:
    """Image files (any format, size, mode), named by their file names (made unique), or the
    first n test images of dataset `data` (default: `run`'s test split as vitlab eval reads it,
    labelled by the checkpoint's `classes`, else digits; see dataset_images)."""
    if files:
        return file_images(pre, files)
    return dataset_images(pre, data_config(run, data, data_dir), n, classes, run)


def file_images(pre: Preprocessing, files: list[str]) -> Images:
    """Image files decoded as training decodes them, in the model's channels, and resized as it
    sees them."""
    shown = [pre.resize(decode_file(f, pre.in_chans)[None])[0] for f in files]
    display = torch.stack(shown)
    return Images(unique_names(files), display, pre.normalize(display))


def dataset_images(
    pre: Preprocessing,
    cfg: DataConfig,
    n: int,
    classes: list[str] | None = None,
    run: RunConfig | None = None,
) -> Images:
    """The first n images of the test split of `cfg`'s data (eval's evaluation_split), named
    DATASET-test-I-CLASS: in-memory images with their channels matched to the model's (grey
    repeated to RGB, RGB to grey), an image folder's or a Hugging Face dataset's decoded in the
    model's mode; another image folder without train/ than `run`'s is read whole, as eval reads
    it (reads_whole). Streamed shards cannot be indexed: DatasetError."""
    name = cfg.test or cfg.name
    if name.startswith("wds:"):
        raise DatasetError(
            f"analyze reads a dataset's first test images, and {name} streams WebDataset "
            f"shards, which cannot be indexed: {IMAGES_OR_DATA}"
        )
    try:
        split = evaluation_split(cfg, "test", classes, pre, reads_whole(cfg, run))
    except DatasetError as e:
        raise DatasetError(f"{e}; {IMAGES_OR_DATA}") from None
    if not len(split):
        raise DatasetError(f"{name} has no test images: {IMAGES_OR_DATA}")
    if isinstance(split, ArraySplit):
        rows = list(range(min(n, len(split))))
        display = pre.resize(split.images[: len(rows)])
    elif isinstance(split, FolderSplit | HFSplit):
        rows, shown = _decoded(split, n, pre)
        display = torch.cat(shown)
    else:
        kind = type(split).__name__
        raise DatasetError(f"analyze cannot index {name} ({kind}): {IMAGES_OR_DATA}")
    if display.shape[1] != pre.in_chans:  # files decode to grey or RGB
        raise DatasetError(
            f"{name}'s images decode to {display.shape[1]} channel{'s' * (display.shape[1] != 1)} "
            f"and the model takes {pre.in_chans}: {IMAGES_OR_DATA}"
        )
    labels = split.labels[rows].tolist()  # an unlabelled folder's: no class in the name
    names = [f"{name}-test-{i}" + (f"-{split.classes[y]}" if split.classes else "")
             for i, y in zip(rows, labels, strict=True)]  # fmt: skip
    return Images(names, display, pre.normalize(display))  # the shown pixels, not cropped again


def _decoded(split: FolderSplit | HFSplit, n: int, pre: Preprocessing) -> tuple[list, list]:
    """(rows, resized uint8 (1, C, H, W) images) of an indexable split's first n images that
    decode, as the training loader decodes them; one that does not is skipped and named."""
    rows, shown, seen = [], [], set()
    for i in range(len(split)):
        if len(rows) == n:
            break
        where = split.where(i)
        try:
            shown.append(pre.resize(decode_image(split.read(i), pre.in_chans, where)[None]))
        except (OSError, DatasetError) as e:
            warn_once(seen, [(where, str(e) if isinstance(e, DatasetError) else f"{where}: {e}")])
            continue
        rows.append(i)
    if not rows:
        raise DatasetError(f"none of the {len(split):,} test images decodes: {IMAGES_OR_DATA}")
    return rows, shown


def unique_names(files: list[str]) -> list[str]:
    """Each file's name; a name met before gets -2, -3, ... before its suffix (a/x.png and
    b/x.png: x.png, x-2.png), so that no image's numbers replace another's in analysis.json."""
    names: list[str] = []
    for f in files:
        path, k = Path(f), 1
        name = path.name
        while name in names:
            k += 1
            name = f"{path.stem}-{k}{path.suffix}"
        names.append(name)
    return names


@torch.no_grad()
def attention_statistics(
    model: VisionTransformer, inputs: Tensor, batch_size: int = 16, head_fusion: str = "mean"
) -> tuple[Tensor, Tensor]:
    """(mean attention distance per layer and head (L, H) in pixels, rollout maps (B, N)), with
    the model in eval mode (its own mode restored after)."""
    cfg = model.config
    depth = len(model.blocks)
    if not depth:
        raise ValueError("a model without blocks has no attention to analyse (depth=0)")
    check_head_fusion(head_fusion)
    sums = torch.zeros(2, depth, cfg.num_heads, dtype=torch.float64)  # distances, queries
    maps = []
    device = next(model.parameters()).device  # analyze --device's; the results on the CPU
    with eval_mode(model):
        for batch in inputs.split(batch_size):
            rollout = None
            for i, _, attn in model.iter_intermediates(batch.to(device), return_attention=True):
                p = cfg.num_prefix_tokens
                total, counted = attention_distance_sums(attn, cfg.grid, cfg.patch_size, p)
                sums[:, i] += torch.stack([total, counted]).cpu()
                rollout = rollout_step(rollout, attn, head_fusion)
                del attn  # one layer's maps at a time
            maps.append(rollout_map(rollout, cfg.num_prefix_tokens).cpu())
    return (sums[0] / sums[1]).float(), torch.cat(maps)  # a head with no query counted: NaN


def plot_distances(distances: Tensor, path: Path, title: str) -> None:
    plt = pyplot()
    depth, heads = distances.shape
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for h in range(heads):
        ax.scatter(torch.arange(1, depth + 1), distances[:, h], s=18, alpha=0.8, label=f"head {h}")
    ax.set(xlabel="network depth (layer)", ylabel="mean attention distance (pixels)", title=title)
    ax.set_xticks(range(1, depth + 1))
    if heads <= 16:
        ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1))  # beside the dots
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def plot_similarity(sim: Tensor, path: Path) -> None:
    """A grid of small maps in patch layout, drawn as one mosaic."""
    plt = pyplot()
    n, rows, cols = sim.shape
    pad = 1
    mosaic = torch.full((rows * (rows + pad), cols * (cols + pad)), float("nan"))
    for idx in range(n):
        r, c = divmod(idx, cols)
        y, x = r * (rows + pad), c * (cols + pad)
        mosaic[y : y + rows, x : x + cols] = sim[idx]
    fig, ax = plt.subplots(figsize=(7, 7 * rows / cols + 0.5))
    im = ax.imshow(mosaic.numpy(), cmap="viridis", vmin=-1, vmax=1)
    ax.set(xticks=[], yticks=[], xlabel="input patch column", ylabel="input patch row")
    ax.set_title("position embedding similarity")
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04, label="cosine similarity")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_rollout(image: Tensor, heat: Tensor, grid: tuple[int, int], path: Path, name: str) -> None:
    plt = pyplot()
    h, w = image.shape[-2:]
    m = heat.reshape(1, 1, *grid)
    m = torch.nn.functional.interpolate(m, size=(h, w), mode="bilinear", align_corners=False)[0, 0]
    m = (m - m.min()) / (m.max() - m.min()).clamp(min=1e-12)
    img = image.float() / 255
    shown = img[0].numpy() if img.shape[0] == 1 else img[:3].permute(1, 2, 0).numpy()
    fig, axes = plt.subplots(1, 3, figsize=(7.5, 2.8))
    axes[0].imshow(shown, cmap="gray")
    axes[0].set_title("input")
    axes[1].imshow(m.numpy(), cmap="inferno")
    axes[1].set_title("attention rollout")
    axes[2].imshow(shown, cmap="gray")
    axes[2].imshow(m.numpy(), cmap="inferno", alpha=0.55)
    axes[2].set_title("overlay")
    for ax in axes:
        ax.axis("off")
    fig.suptitle(name, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def analyze(
    model: VisionTransformer | SwinTransformer,
    pre: Preprocessing,
    images: Images,
    out: Path,
    title: str,
    head_fusion: str = "mean",
) -> Path:
    """Write every figure, analysis.json and index.html into `out`; returns index.html's path.
    A Swin gets analyze_swin's page (no rollout: head_fusion is not used). The model runs in eval
    mode and is left in its own."""
    out_folder(out)
    if isinstance(model, SwinTransformer):
        return analyze_swin(model, images, out, title)
    if isinstance(model, CNN):
        raise ValueError(
            "vitlab analyze shows attention (distance, rollout) and position embeddings; a CNN "
            f"({model.config.arch}) has neither: see vitlab cost for its per-stage cost"
        )
    cfg = model.config
    distances, maps = attention_statistics(model, images.inputs, head_fusion=head_fusion)
    out.mkdir(parents=True, exist_ok=True)
    report = Report(out)
    plot_distances(distances, out / "mean_attention_distance.png", "mean attention distance")
    report.files.append(
        (
            "mean_attention_distance.png",
            f"Mean attention distance (paper Fig. 7 right): one dot per head and layer, over "
            f"{len(images.names)} images; {cfg.patch_size}-pixel patches on a "
            f"{cfg.img_hw[0]}x{cfg.img_hw[1]} image.",
        )
    )
    try:
        plot_similarity(pos_embed_similarity(model), out / "pos_embed_similarity.png")
        report.files.append(
            (
                "pos_embed_similarity.png",
                "Position embedding similarity (Fig. 7 centre): tile (r, c) shows the cosine "
                "similarity of patch (r, c)'s embedding with every other patch's.",
            )
        )
    except ValueError as e:
        report.notes.append(f"position-embedding similarity skipped: {e}")
    try:
        filters = embedding_filters(model, k=28)
        plot_filters(filters, out / "embedding_filters.png")
        report.files.append(
            (
                "embedding_filters.png",
                f"Patch embedding filters (Fig. 7 left): the top {len(filters)} principal "
                f"components of E, as {cfg.patch_size}x{cfg.patch_size} images.",
            )
        )
    except ValueError as e:
        report.notes.append(f"embedding filters skipped: {e}")
    for i, name in enumerate(images.names):
        file = f"rollout_{i:03d}.png"
        plot_rollout(images.display[i], maps[i], cfg.grid, out / file, name)
        report.files.append(
            (
                file,
                f"Attention rollout (Fig. 6, heads fused by {head_fusion}) for {name}: input, "
                f"map, map over the input.",
            )
        )
    if not cfg.num_prefix_tokens:
        report.notes.append("no class token: rollout maps are the mean over patch queries")
    elif cfg.pool == "gap":
        report.notes.append("rollout maps: the class token's row (the gap head does not read it)")
    elif cfg.distilled:  # two heads read two tokens: the map is one's
        report.notes.append("rollout maps: the class token's row; the distillation token's head, "
                            "whose logits are averaged with it, reads its own row")  # fmt: skip
    result = {
        "image_size": list(cfg.img_hw),
        "patch_size": cfg.patch_size,
        "grid": list(cfg.grid),
        "num_images": len(images.names),
        "pos_embed": cfg.pos_embed,
        "pool": cfg.pool,
        "head_fusion": head_fusion,
        "mean_attention_distance": distances.tolist(),  # layers x heads, pixels
        "rollout": {n: maps[i].tolist() for i, n in enumerate(images.names)},
        "files": [f for f, _ in report.files],
        "notes": report.notes,
    }
    (out / "analysis.json").write_text(json_text(result, indent=1) + "\n")
    summary = (
        f"{cfg.depth} layer{'s' * (cfg.depth != 1)}, {cfg.num_heads} "
        f"head{'s' * (cfg.num_heads != 1)}, width {cfg.embed_dim}, {cfg.pos_embed} "
        f"position embeddings, {cfg.pool} pooling, {len(images.names)} images."
    )
    return write_index(report, title, summary)
